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
            # A value larger than a chunk of the reader's geometry can be is refused before it is read.
            assert outcome.startswith(("fetched 16 tokens; CodecError", "fetched 16 tokens; StoredValueError")), \
                f"{name}: {outcome}"
        else:
            assert outcome.startswith("CodecError"), f"{name}: {outcome}"


# A sparse value far above the limit in a file store: sized with fstat and refused, never read.
SPARSE_PROBE = """
import json, os, resource, sys
import torch
from kvlab.store import ChunkSealer, create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.resolution import RESOLUTIONS, ChunkGeometry, encode_chunk
from kvlab.store.verify import verify_store
from tests.hostile.memory_probe import SHAPE, TOKENS, address_space_bytes

root, headroom = sys.argv[1], int(sys.argv[2]) << 20
config = PrefixConfig(chunk_tokens=SHAPE[2], allow_recompute=False)
geometry = ChunkGeometry(SHAPE[2], 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3], *SHAPE[:2], SHAPE[3], torch.float32)
store = create_store("file://" + root)
prefix = PrefixCache(store, "victim", 8 * SHAPE[0] * SHAPE[1] * SHAPE[3], config, geometry, ChunkSealer(None))
keys = prefix.keys(TOKENS, "exact")
for key in keys[:2]:
    store.put(key, encode_chunk(RESOLUTIONS["exact"], torch.randn(SHAPE), torch.randn(SHAPE)))
os.truncate(os.path.join(root, keys[1][:2], keys[1]), int(sys.argv[3]))
limit = address_space_bytes() + headroom
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
fetched = prefix.fetch(TOKENS)
checks = {check.key: check.problem for check in verify_store(store, ChunkSealer(None))}
print(json.dumps({"fetch": f"fetched {fetched.num_tokens} tokens; {fetched.stats.failure}",
                  "verify": [checks[keys[0]], checks[keys[1]]]}))
"""


def test_a_sparse_value_far_above_the_limit_is_refused_without_being_read(tmp_path: Path) -> None:
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    size = 3 << 30
    done = subprocess.run([sys.executable, "-c", SPARSE_PROBE, str(tmp_path / "store"), str(HEADROOM_MIB), str(size)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["fetch"].startswith("fetched 16 tokens; StoredValueError"), report["fetch"]
    assert f"has {size} bytes" in report["fetch"], report["fetch"]
    intact, oversized = report["verify"]
    assert intact is None and oversized is not None and "StoredValueError" in oversized, report["verify"]
