"""Each hostile value is refused within 512 MiB of address space (RLIMIT_AS, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.hostile.corpus import FOREIGN, MALFORMED, hostile_chunks, hostile_frames

HEADROOM_MIB = 512
ROOT = Path(__file__).resolve().parents[2]


def test_every_hostile_value_is_refused_under_a_512_mib_address_space_limit(tmp_path: Path) -> None:
    shape = (3, 2, 16, 16)
    for name, data in hostile_frames(shape).items():
        (tmp_path / f"frame-{name}.bin").write_bytes(data)
    for name, data in hostile_chunks(torch.randn(shape), torch.randn(shape)).items():
        (tmp_path / f"chunk-{name}.bin").write_bytes(data)
    # One malloc arena: each thread's own arena reserves 64 MiB of address space it may never use.
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.hostile.memory_probe", str(tmp_path), str(HEADROOM_MIB)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["control"] == "MemoryError", "600 MiB must not fit under the limit, or the limit tests nothing"
    results = report["results"]
    assert len(results) == len(MALFORMED) + len(MALFORMED) + len(FOREIGN) + 1
    for name, result in results.items():
        outcome = result["outcome"]
        assert "MemoryError" not in outcome, f"{name}: {outcome}"
        if name.startswith("chunk-"):
            assert outcome.startswith("fetched 16 tokens; CodecError"), f"{name}: {outcome}"
        else:
            assert outcome.startswith("CodecError"), f"{name}: {outcome}"
