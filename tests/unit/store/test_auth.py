"""Store secrets, chunk tags, namespace salts, the background writer and scheduling when the store fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.engine import generate
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.models import LoadedModel
from kvlab.store import ChunkAuthError, ChunkSealer, StoreUnavailableError, create_store, load_secret
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.prefix.writer import BackgroundWriteError, ChunkWriter
from tests.helpers import decode_fetching_in_background, tiny_llama

SECRET = b"0123456789abcdef0123456789abcdef"
PROMPT = [(7 * i + 3) % 90 + 3 for i in range(40)]
CONFIG = GenerationConfig(max_new_tokens=4, ignore_eos=True, prefill_chunk_tokens=16)


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert load_secret({}) is None
    assert load_secret({"KVLAB_STORE_SECRET": SECRET.decode()}) == SECRET
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    assert load_secret({"KVLAB_STORE_SECRET_FILE": str(tmp_path / "secret")}) == SECRET


@pytest.mark.parametrize(("environ", "message"), [
    ({"KVLAB_STORE_SECRET": "short"}, "at least 16"),
    ({"KVLAB_STORE_SECRET": SECRET.decode(), "KVLAB_STORE_SECRET_FILE": "/x"}, "not both"),
    ({"KVLAB_STORE_SECRET_FILE": "/nonexistent/secret"}, "cannot read the store secret file"),
])
def test_bad_secrets_are_config_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_secret(environ)


def test_a_tag_binds_the_bytes_to_their_key() -> None:
    sealer = ChunkSealer(SECRET)
    sealed = sealer.seal("key-a", b"chunk bytes")
    assert bytes(sealer.open("key-a", sealed)) == b"chunk bytes"
    with pytest.raises(ChunkAuthError, match="authentication failed"):
        sealer.open("key-b", sealed)
    tampered = bytearray(sealed)
    tampered[-1] ^= 1
    with pytest.raises(ChunkAuthError, match="authentication failed"):
        sealer.open("key-a", bytes(tampered))
    with pytest.raises(ChunkAuthError, match="authentication failed"):
        ChunkSealer(SECRET[::-1]).open("key-a", sealed)
    with pytest.raises(ChunkAuthError, match="no authentication tag"):
        sealer.open("key-a", b"chunk bytes")
    with pytest.raises(ChunkAuthError, match="no store secret is set"):
        ChunkSealer(None).open("key-a", sealed)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=3)


def test_a_salt_changes_every_key(model: LoadedModel) -> None:
    def keys(salt: str | None) -> list[str]:
        return PrefixCache.for_model(
            model, "memory://", PrefixConfig(chunk_tokens=16, cache_salt=salt)
        ).keys(PROMPT, "exact")

    unsalted, tenant_a, tenant_b = keys(None), keys("tenant-a"), keys("tenant-b")
    assert not set(unsalted) & set(tenant_a) and not set(tenant_a) & set(tenant_b)
    assert keys("tenant-a") == tenant_a, "a salt must give stable keys"


def test_no_secret_is_said_once_per_shared_store(
    model: LoadedModel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    PrefixCache.for_model(model, "memory://", sealer=ChunkSealer(None))
    PrefixCache.for_model(model, f"file://{tmp_path}", sealer=ChunkSealer(SECRET))
    assert not [r for r in caplog.records if r.name == "kvlab.store.auth"]
    PrefixCache.for_model(model, f"file://{tmp_path}", sealer=ChunkSealer(None))
    said = [r.getMessage() for r in caplog.records if r.name == "kvlab.store.auth"]
    assert len(said) == 1 and "not authenticated" in said[0]


def test_the_writer_carries_unexpected_errors_to_flush_and_keeps_going() -> None:
    writer = ChunkWriter()
    done: list[int] = []
    writer.submit(lambda: (_ for _ in ()).throw(StoreUnavailableError("down")))
    writer.submit(lambda: (_ for _ in ()).throw(TypeError("a defect")))
    writer.submit(lambda: (_ for _ in ()).throw(SystemExit(3)))
    writer.submit(lambda: done.append(1))
    with pytest.raises(BackgroundWriteError, match="TypeError: a defect"):
        writer.flush()
    assert done == [1] and writer.num_failed == 1
    writer.flush()  # reported once
    writer.close()


class DownStore:
    """A store whose every operation fails, as one that is down at admission."""

    url, shared = "redis://down", True

    def __getattr__(self, name: str) -> object:
        def fail(*args: object, **kwargs: object) -> object:
            raise StoreUnavailableError("the store is down")

        return fail


def test_fetch_aware_admission_serves_every_request_when_the_store_is_down(model: LoadedModel) -> None:
    prefix = PrefixCache.for_model(model, "memory://", PrefixConfig(chunk_tokens=16), ChunkSealer(None))
    prefix.store = DownStore()  # type: ignore[assignment]
    prompts = [PROMPT, PROMPT[:20]]
    engine, ids = decode_fetching_in_background(model, prefix, prompts, CONFIG)
    assert [engine.output(i).token_ids for i in ids] == [  # type: ignore[attr-defined]
        generate(model, [prompt], CONFIG).requests[0].token_ids for prompt in prompts]


def test_fetch_aware_admission_serves_the_others_when_a_fetch_raises(model: LoadedModel) -> None:
    store = create_store("memory://")
    prefix = PrefixCache.for_model(
        model, store, PrefixConfig(chunk_tokens=16, allow_recompute=False), ChunkSealer(None)
    )
    generate(model, [PROMPT], CONFIG, prefix=prefix)
    prefix.flush()
    prefix.fetch = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("worker died"))  # type: ignore[method-assign]
    engine, ids = decode_fetching_in_background(model, prefix, [PROMPT], CONFIG)
    assert engine.output(ids[0]).token_ids == generate(model, [PROMPT], CONFIG).requests[0].token_ids  # type: ignore[attr-defined]


def test_a_request_that_fails_fails_alone_and_the_others_are_served(model: LoadedModel) -> None:
    prefix = PrefixCache.for_model(model, "memory://", PrefixConfig(chunk_tokens=16), ChunkSealer(None))
    prompts = [PROMPT, [999] * 4, PROMPT[:8]]
    engine, ids = decode_fetching_in_background(model, prefix, prompts, CONFIG)
    failed = [index for index, request_id in enumerate(ids) if engine.error(request_id) is not None]  # type: ignore[attr-defined]
    assert failed == [1]
    for index in (0, 2):
        expected = generate(model, [prompts[index]], CONFIG).requests[0].token_ids
        assert engine.output(ids[index]).token_ids == expected  # type: ignore[attr-defined]
