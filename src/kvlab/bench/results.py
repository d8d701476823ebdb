"""The results folder: where each cell's files live, and reading and writing them safely.

Layout::

    OUT/config.json                          the last run's configuration
    OUT/environment.json                     git revision, package versions, CPU/GPU of the last run
    OUT/MODEL/TASK/METHOD/cell.json          what the cell measures (refuses mixing settings)
    OUT/MODEL/TASK/METHOD/predictions.jsonl  one line per finished sample (appended as they finish)
    OUT/MODEL/TASK/METHOD/metrics.json       the cell's summary; present once the cell is complete
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError

logger = logging.getLogger(__name__)

# Field names that results written by earlier kvlab versions use, and their names today. Applied
# when reading, so old result folders still resume and render.
LEGACY_FIELDS = {
    "spec": "lossless",  # a prediction's lossless acceptance figures ("spec" names no benchmark row now)
}

CELL_FILE = "cell.json"
PREDICTIONS_FILE = "predictions.jsonl"
METRICS_FILE = "metrics.json"


def model_slug(model: str) -> str:
    """A folder name for a model name, path or hub id."""
    return model.strip("/").replace("/", "--").replace("\\", "--") or "model"


def cell_dir(out: Path, model: str, task: str, method: str) -> Path:
    return out / model_slug(model) / task / method


def prepare_output_dir(out: str | Path) -> Path:
    """Create `out` if needed and check that files can be written there.

    Raises:
        ConfigError: The folder cannot be created or written.
    """
    path = Path(out).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ConfigError(f"cannot write results to {path}: {error.strerror or error}") from None
    return path


def write_json(path: Path, payload: Any) -> None:
    """Write JSON atomically (a crash leaves the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True, default=str)
        handle.write("\n")
    os.replace(temporary, path)


def read_json(path: Path) -> Any | None:
    """The parsed file, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def read_predictions(path: Path) -> list[dict[str, Any]]:
    """Complete prediction records of a cell; a torn last line (interrupted write) is dropped."""
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            logger.warning("%s: dropped an incomplete prediction line", path)
            continue
        if isinstance(record, dict) and "id" in record:
            records.append(upgrade_fields(record))
    return records


def upgrade_fields(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with legacy field names (`LEGACY_FIELDS`) renamed, at any depth; the input is not changed."""
    upgraded: dict[str, Any] = {}
    for key, value in record.items():
        name = LEGACY_FIELDS.get(key, key)
        if name != key:
            logger.debug("renamed the legacy result field %r to %r", key, name)
        upgraded[name] = upgrade_fields(value) if isinstance(value, dict) else value
    return upgraded


def rewrite_predictions(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace the file with exactly `records` (drops torn lines before appending resumes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, default=str) + "\n")
    os.replace(temporary, path)


def append_prediction(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def claim_cell(directory: Path, fingerprint: dict[str, Any]) -> None:
    """Record what the cell measures, refusing a folder that holds results of other settings."""
    existing = read_json(directory / CELL_FILE)
    if existing is not None and existing != fingerprint:
        differing = sorted(key for key in {*existing, *fingerprint} if existing.get(key) != fingerprint.get(key))
        raise ConfigError(
            f"{directory} holds results made with other settings ({', '.join(differing)} differ"
            f"{': the code changed since' if 'code_revision' in differing else ''}); "
            "use another --out folder or remove it"
        )
    if existing is None:
        write_json(directory / CELL_FILE, fingerprint)


def load_cell_metrics(out: Path) -> list[dict[str, Any]]:
    """Every finished cell's metrics under a results folder, in a stable order."""
    cells = []
    for path in sorted(out.glob(f"*/*/*/{METRICS_FILE}")):
        metrics = read_json(path)
        if isinstance(metrics, dict) and "task" in metrics and "method" in metrics:
            cells.append(upgrade_fields(metrics))
        else:
            logger.warning("%s: unreadable metrics file skipped", path)
    return cells
