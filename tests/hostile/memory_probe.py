"""Run in a subprocess by test_memory_cap: decode every hostile value under an address-space limit.

Usage: python -m tests.hostile.memory_probe CORPUS_DIR HEADROOM_MIB. CORPUS_DIR holds `chunk-<case>.bin`
(stored values, unsealed) and `frame-<case>.bin` (codec frames). After the imports, RLIMIT_AS is set
to the address space in use plus HEADROOM_MIB (torch alone maps more than 512 MiB of address space
before any work). Prints one JSON object: per value, how it ended and the peak RSS after it.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from kvlab.codec import CodecError, decode_frame
from kvlab.store import ChunkSealer, create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.resolution import RESOLUTIONS, ChunkGeometry, encode_chunk

SHAPE = (3, 2, 16, 16)
BOMB_CONTROL_BYTES = 600 << 20
TOKENS = list(range(3, 3 + 40))


def address_space_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def fetch_outcome(value: bytes) -> str:
    config = PrefixConfig(chunk_tokens=SHAPE[2], allow_recompute=False)
    geometry = ChunkGeometry(
        SHAPE[2], 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3], *SHAPE[:2], SHAPE[3], torch.float32
    )
    prefix = PrefixCache(create_store("memory://"), "victim", 8 * SHAPE[0] * SHAPE[1] * SHAPE[3], config, geometry,
                         ChunkSealer(None))
    keys = prefix.keys(TOKENS, "exact")
    prefix.store.put(keys[0], encode_chunk(RESOLUTIONS["exact"], torch.randn(SHAPE), torch.randn(SHAPE)))
    prefix.store.put(keys[1], value)
    fetched = prefix.fetch(TOKENS)
    return f"fetched {fetched.num_tokens} tokens; {fetched.stats.failure}"


def decode_outcome(frame: bytes) -> str:
    try:
        decode_frame(frame)
    except CodecError as error:
        return f"CodecError: {error}"
    return "decoded"


def main() -> None:
    corpus, headroom = Path(sys.argv[1]), int(sys.argv[2]) << 20
    values = {path.name: path.read_bytes() for path in sorted(corpus.glob("*.bin"))}
    limit = address_space_bytes() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    results = {}
    for name, data in values.items():
        try:
            outcome = fetch_outcome(data) if name.startswith("chunk-") else decode_outcome(data)
        except MemoryError as error:
            outcome = f"MemoryError: {error}"
        results[name] = {"outcome": outcome, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    # The control: inflating one of the bombs for real must hit the limit, or the test proves nothing.
    try:
        bytearray(BOMB_CONTROL_BYTES)
        control = "allocated"
    except MemoryError:
        control = "MemoryError"
    print(json.dumps(
        {"control": control, "limit_mib": limit / 2**20, "headroom_mib": headroom / 2**20, "results": results}
    ))


if __name__ == "__main__":
    main()
