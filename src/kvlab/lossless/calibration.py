"""A short calibration of the cost model on a new lossless sequence's own caches, rolled back after.

The planner costs a round before it runs it, so its first round needs a fitted model. A few forwards
cover the shapes a round runs: plain steps and verifies of 8 and 16 drafts on the served weights, and
draft steps on the weights that draft; again for a cache more than twice as long as any calibrated (the
keys' coefficients need more than one length, and a short warm-up request must not stand for a long one).
Each feeds copies of one token and is rolled back at once
(`drop_last`, the same rollback as a rejected draft's), so the caches hold exactly what they held.
A full KV on a slower tier is not read (every read would cost the link): the served weights are then
calibrated on the draft cache, which is in fast memory.

A batch is calibrated too, once per new largest batch (`calibrate_batch`): one packed plain step over
every running sequence's full cache and one packed draft step over their draft caches (each the faster
of two, as every calibration forward). Without it the model would learn a large batch's costs only from
the ticks the planner chose, and a batch that drafts never shows what its plain ticks cost (at 8K and
batch 8, a plain tick costs about half of what single sequences' costs add up to).

Both are kept between runs (`CalibrationStore`: one file per model, dtype, machine, torch version, thread
count and kvlab source under the kvlab cache directory), so a later run on the same machine starts fitted and
runs none of these forwards (at 8K, batch 8: about a second of a 64-token run's 10).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from kvlab.cache import KVCache, Segment, run_packed
from kvlab.cache.tiers import TieredKVLayer
from kvlab.lossless.cost_model import NUM_FEATURES, ForwardCostModel, SegmentShape
from kvlab.paths import cache_dir
from kvlab.timing import Stopwatch

logger = logging.getLogger(__name__)

# The folder for kept calibrations; set empty to keep none (every run calibrates). Default: the kvlab cache
# directory's "calibration" folder.
CALIBRATION_DIR_ENV = "KVLAB_CALIBRATION_DIR"
# Bumped when a kept row's meaning changes (the cost model's features). A change to what kvlab's forwards
# cost changes kvlab's source, which `source_digest` keys the file by.
FORMAT = 3
KVLAB_SOURCE = Path(__file__).resolve().parents[1]

# Tokens per calibration forward on the served weights (a plain step twice: its first pays set-ups), and a
# verify the C++ attention kernel takes (`ForwardCostModel.kernel_queries`), where it runs.
SERVED_TOKENS = (1, 1, 9, 17)
DRAFT_STEPS = 3


def calibrate(
    costs: ForwardCostModel, models: dict[str, torch.nn.Module], full: KVCache, draft: KVCache, token_id: int
) -> bool:
    """Fit `costs` for each weight set in `models` ("same" for the served weights) whose calibration does not
    cover these caches' lengths yet (`ForwardCostModel.calibration_covers`); returns whether any ran."""
    served = draft if isinstance(full.layers[0], TieredKVLayer) else full
    calibrated = False
    for weights, model in models.items():
        cache = served if weights == "same" else draft
        if costs.calibration_covers(weights, cache.stored_tokens()):
            continue
        calibrated = True
        if weights == "same":
            lengths = [*SERVED_TOKENS, *([costs.kernel_queries] if costs.kernel_queries > 1 else [])]
            runs = [(served, tokens) for tokens in lengths] + [(draft, 1)] * DRAFT_STEPS
        else:
            runs = [(draft, 1)] * (DRAFT_STEPS + 1)
        for cache, num_tokens in runs:
            seconds, shapes = fastest_packed(model, [cache], token_id, num_tokens)
            costs.observe_tick([(weights, shapes, seconds)], calibration=True)
    return calibrated


def calibrate_batch(costs: ForwardCostModel, models: dict[str, torch.nn.Module], pairs: list[tuple[KVCache, KVCache]],
                    token_id: int) -> None:
    """One packed plain step over the full caches of `pairs` (those in fast memory) on the served weights, and
    one packed draft step over their draft caches on each weight set in `models`, rolled back after."""
    fulls = [full for full, _ in pairs if not isinstance(full.layers[0], TieredKVLayer)]
    drafts = [draft for _, draft in pairs]
    if len(fulls) > 1:
        seconds, shapes = fastest_packed(models["same"], fulls, token_id)
        costs.observe_tick([("same", shapes, seconds)], calibration=True)
    for weights, model in models.items():
        seconds, shapes = fastest_packed(model, drafts, token_id)
        costs.observe_tick([(weights, shapes, seconds)], calibration=True)


def fastest_packed(
    model: torch.nn.Module, caches: list[KVCache], token_id: int, num_tokens: int = 1
) -> tuple[float, list[SegmentShape]]:
    """The faster of two timed packed forwards (`_timed_packed`). A shared machine only ever adds time, and one
    slow calibration forward would hold the planner to a wrong cost until enough forwards of that shape
    outweigh it; a batch's plain step is a shape a drafting run's own forwards rarely show again, so there it
    would price plain steps high for the whole run and every later one (a kept plain step of 8 rows at 8K
    measured 291 ms; that run's plain ticks 250 ms)."""
    (seconds, shapes), (again, _) = (_timed_packed(model, caches, token_id, num_tokens) for _ in range(2))
    return min(seconds, again), shapes


def _timed_packed(
    model: torch.nn.Module, caches: list[KVCache], token_id: int, num_tokens: int = 1
) -> tuple[float, list[SegmentShape]]:
    """One packed forward feeding `num_tokens` copies of `token_id` to each cache, rolled back after."""
    shapes = [SegmentShape(num_tokens, cache.stored_tokens()) for cache in caches]
    provisional = [cache.layers[0].deferred for cache in caches]  # a draft cache mid-round stays provisional
    for cache in caches:
        cache.set_provisional(True)  # a compressed layer never compresses what is rolled back
    try:
        ends = [num_tokens * (index + 1) - 1 for index in range(len(caches))]
        clock = Stopwatch(model.device)  # type: ignore[arg-type]
        with torch.inference_mode():
            run_packed(model, [Segment(cache, num_tokens) for cache in caches],  # type: ignore[arg-type]
                       [[token_id] * num_tokens for _ in caches], ends)
        seconds = clock.elapsed()
        for cache in caches:
            cache.drop_last(num_tokens)
    finally:
        for cache, was_provisional in zip(caches, provisional, strict=True):
            cache.set_provisional(was_provisional)
    return seconds, shapes


@dataclasses.dataclass(frozen=True, slots=True)
class CalibrationStore:
    """An earlier run's calibration forwards of one model on this machine: `ForwardCostModel.calibration`'s
    rows and its `calibrated_batch`, in one JSON file (`path`; None: nothing is kept).

    A file that cannot be read or written is a run that calibrates: never an error."""

    path: Path | None

    @classmethod
    def for_model(
        cls, source: str, dtype: torch.dtype, device: torch.device, forward: str = "eager"
    ) -> CalibrationStore:
        """The store of `source`'s weights in `dtype` on `device` run by `forward` (how its forward runs:
        `kvlab.models.forward_kind`), on this machine (None path: kept nowhere)."""
        configured = os.environ.get(CALIBRATION_DIR_ENV)
        if configured == "":
            return cls(None)
        directory = Path(configured).expanduser() if configured else cache_dir() / "calibration"
        key = json.dumps([FORMAT, NUM_FEATURES, source, str(dtype), machine_name(device), torch.__version__,
                          torch.get_num_threads(), source_digest(), forward])
        return cls(directory / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json")

    def restore(self, costs: ForwardCostModel) -> None:
        """Fold the kept calibration into `costs` (`ForwardCostModel.restore`), when there is one."""
        if self.path is None or not self.path.exists():
            return
        try:
            kept = json.loads(self.path.read_text())
            rows = {str(weights): [[float(v) for v in row] for row in weight_rows
                                   if len(row) == NUM_FEATURES + 1] for weights, weight_rows in kept["rows"].items()}
            calibrated_batch = int(kept["calibrated_batch"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            logger.warning("ignoring the kept calibration %s (%s); this run calibrates", self.path, error)
            return
        costs.restore(rows, calibrated_batch)

    def save(self, costs: ForwardCostModel) -> None:
        """Keep `costs`'s calibration for later runs (written whole, then renamed into place)."""
        if self.path is None or not costs.calibration:
            return
        text = json.dumps({"rows": costs.calibration, "calibrated_batch": costs.calibrated_batch})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(self.path)
        except OSError as error:
            logger.warning("could not keep the calibration in %s (%s); later runs calibrate again", self.path, error)


@functools.cache
def source_digest(root: Path = KVLAB_SOURCE) -> str:
    """A digest of kvlab's own Python source. A calibration times kvlab's kernels and forward as they were:
    when a verify's keys went into pieces (0.75-0.87x the verify's time at 8K), a run on the calibration kept
    from before measured the cost model's error at 18-19% a forward on its prompt-lookup rows, 11-12% on the
    same rows calibrated afresh. Any change to the source starts a new file, kept apart from the old."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def machine_name(device: torch.device) -> str:
    """The processor (CPU model name) or accelerator a calibration ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"
