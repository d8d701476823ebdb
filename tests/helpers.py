"""Helpers the tests share: tiny random models, the transformers reference paths, redis servers,
ports, and the identity-compression check. Fixtures built on them live in `tests/conftest.py`."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import weakref
from pathlib import Path

import pytest
import redis
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvlab import attention_kernels
from kvlab.cache import KVCache, forward
from kvlab.compress import Compressor
from kvlab.models import LoadedModel, wrap_model
from kvlab.models.packed_linear import dense_copy, is_packed

TINY_VOCAB = 96


TINY_EOS = 2


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over words w0..w95 (w2 is end-of-sequence), built in memory."""
    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2", pad_token="w1")
    return tokenizer


def tiny_llama(num_kv_heads: int = 2, seed: int = 0, num_layers: int = 3, packed_weights: bool = True) -> LoadedModel:
    """A randomly initialised Llama (4 query heads; GQA when num_kv_heads < 4), with oneDNN-packed
    linear layers like `load_model`'s unless `packed_weights` is False."""
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        eos_token_id=TINY_EOS,
        bos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return wrap_model(model, tiny_tokenizer(), name=f"tiny-llama-kv{num_kv_heads}", packed_weights=packed_weights)


_TRANSFORMERS_LAYERS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def transformers_layers(model: torch.nn.Module) -> torch.nn.Module:
    """`model` itself, or, when kvlab packed its linear layers, a copy with transformers' own
    `torch.nn.Linear` layers (made once per model): the reference kvlab's fast paths are held to."""
    if not is_packed(model):
        return model
    if model not in _TRANSFORMERS_LAYERS:
        _TRANSFORMERS_LAYERS[model] = dense_copy(model)
    return _TRANSFORMERS_LAYERS[model]


class plain_attention:
    """Run a kvlab-prepared model through transformers' own attention (the reference path): SDPA, or
    the eager path for models that soft-cap attention logits, which SDPA cannot."""

    def __init__(self, loaded: LoadedModel | torch.nn.Module) -> None:
        self.config = loaded.model.config if isinstance(loaded, LoadedModel) else loaded.config
        self.implementation = "eager" if getattr(self.config, "attn_logit_softcapping", None) else "sdpa"

    def __enter__(self) -> None:
        self.previous = self.config._attn_implementation
        self.config._attn_implementation = self.implementation

    def __exit__(self, *exc: object) -> None:
        self.config._attn_implementation = self.previous


def transformers_greedy(loaded: LoadedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """New token ids of transformers' `generate(do_sample=False)` with its own layers (unpacked), the
    oracle for greedy decoding."""
    model = transformers_layers(loaded.model)
    with plain_attention(model), torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt], device=loaded.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=loaded.device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=loaded.tokenizer.pad_token_id or 0,
        )
    return output[0, len(prompt) :].tolist()


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Terminate a server the tests started (by its own process), killing it after 5 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class RedisServer:
    """A private redis-server on a free loopback port, without persistence, for the store tests."""

    def __init__(self, workdir: Path) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            pytest.fail("redis-server is not on PATH; install it (apt-get install redis-server) to run the store tests")
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "redis-server.log"
        # Another process may take the free port before redis-server binds it; a new port fixes that.
        for _ in range(3):
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
            with self.log.open("wb") as log:
                self.process = subprocess.Popen(
                    [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", str(workdir)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            if self._wait_until_ready(timeout_s=10.0):
                return
        pytest.fail(f"redis-server did not start: {self.log.read_text(errors='replace')[-2000:]}")

    def _wait_until_ready(self, timeout_s: float) -> bool:
        """Whether the server answered PING in time (False when it exited, e.g. the port was taken)."""
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if client.ping():
                        return True
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    time.sleep(0.05)
        finally:
            client.close()
        if self.process.poll() is None:
            self.stop()
            pytest.fail(f"redis-server on port {self.port} did not answer PING within {timeout_s:.0f} s")
        return False

    def flush(self) -> None:
        with redis.Redis(host="127.0.0.1", port=self.port) as client:
            client.flushdb()

    def stop(self) -> None:
        stop_process(self.process)


def wait_until_healthy(process: subprocess.Popen[bytes], url: str, log: Path, name: str, timeout_s: float,
                       poll_s: float) -> str | None:
    """Poll `url`/health until it answers 200 (None); else why not, with the tail of the server's `log`: the
    process exited, or `timeout_s` went by."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"{name} exited with {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(poll_s)
    return f"{name} did not answer /health within {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-4000:]}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    # The OS picks an unused port; RedisServer retries with another if it is taken before the bind.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def assert_identity_compression_is_bit_identical(
    loaded: LoadedModel, compressor: Compressor, ids: torch.Tensor, label: str
) -> None:
    """A compressor set to keep everything gives the plain cache's logits bit for bit: the prompt
    ([1, 32] of the 48 `ids`), then 16 decode steps."""
    plain = KVCache.allocate(loaded.architecture, 1, 64, loaded.dtype, loaded.device)
    compressed = KVCache.allocate(loaded.architecture, 1, 64, loaded.dtype, loaded.device, compressor)
    expected = [forward(loaded.model, plain, ids[:, :32])]
    actual = [forward(loaded.model, compressed, ids[:, :32], compress=True)]
    for t in range(32, 48):
        expected.append(forward(loaded.model, plain, ids[:, t : t + 1]))
        actual.append(forward(loaded.model, compressed, ids[:, t : t + 1]))
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(want, got), f"{label}: step {step} differs"


def decode_fetching_in_background(
    loaded: LoadedModel, prefix: object, prompts: list[list[int]], config: object
) -> tuple[object, list[int]]:
    """Decode `prompts` in one engine that fetches each prefix from `prefix` in the background before
    admitting its request (fetch-aware admission); returns the engine and the request ids."""
    import time

    from kvlab.engine import Engine, EngineConfig, Request, SinglePrefixSource

    engine = Engine(loaded, EngineConfig(fetch_workers=1), SinglePrefixSource(prefix))  # type: ignore[arg-type]
    ids = [engine.add_request(Request(prompt, config)) for prompt in prompts]  # type: ignore[arg-type]
    try:
        while engine.num_unfinished():
            if not engine.has_work():
                time.sleep(0.005)  # only fetches in flight
            engine.step()
    finally:
        engine.close()
    return engine, ids


class FakeClock:
    """A clock that moves only when slept on or moved by the test: what a token bucket charges is read, not timed."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def spy_on_newest_attention(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every call of the C++ attention kernel from now on, as its sequences' query counts (one list a call)."""
    calls: list[list[int]] = []
    kernel = attention_kernels.NEWEST_ATTENTION
    original = kernel.attend

    def spy(folded: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
            num_queries: list[int], scaling: float) -> list[torch.Tensor] | None:
        calls.append(list(num_queries))
        return original(folded, keys, values, num_queries, scaling)

    monkeypatch.setattr(kernel, "attend", spy)
    return calls

