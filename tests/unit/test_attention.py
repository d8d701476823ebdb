"""Fast attention paths against their plain references: equal argmax, values within a stated tolerance."""

from __future__ import annotations

import pytest
import torch

from kvlab import attention_kernels
from kvlab.attention import (
    FOLDED_SCORES_MAX_QUERIES,
    attend_newest,
    attend_newest_each,
    attend_newest_reference,
    attention_with_lse,
    attention_with_lse_reference,
    merge_attention,
)
from kvlab.attention_kernels import SPLIT_KV_CHUNK, SPLIT_KV_MIN_KEYS, split_kv_decode, warm_up_split_kv
from tests.helpers import spy_on_newest_attention

# Float32 results of the split path differ from one masked kernel only in the reduction order.
TOLERANCE = 1e-5


# 2, 9 and 33 queries take the folded-scores path, 80 the split one (flash prefix + causal block).
@pytest.mark.parametrize("num_queries", [1, 2, 9, 33, 80])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (4, 1)])
@pytest.mark.parametrize("num_keys", [80, 300])
def test_attend_newest_matches_the_masked_reference(num_queries: int, heads: int, kv_heads: int, num_keys: int) -> None:
    assert FOLDED_SCORES_MAX_QUERIES in range(33, 80)  # both paths are exercised
    generator = torch.Generator().manual_seed(num_queries * 100 + heads + num_keys)
    queries = torch.randn(1, heads, num_queries, 64, generator=generator)
    keys = torch.randn(1, kv_heads, num_keys, 64, generator=generator)
    values = torch.randn(1, kv_heads, num_keys, 64, generator=generator)
    fast = attend_newest(queries, keys, values, 0.125)
    reference = attend_newest_reference(queries, keys, values, 0.125)
    torch.testing.assert_close(fast, reference, rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.equal(fast.argmax(dim=-1), reference.argmax(dim=-1))


def test_queries_that_are_all_the_keys_are_plain_causal_attention() -> None:
    generator = torch.Generator().manual_seed(7)
    queries = torch.randn(1, 4, 12, 16, generator=generator)
    keys, values = torch.randn(1, 2, 12, 16, generator=generator), torch.randn(1, 2, 12, 16, generator=generator)
    torch.testing.assert_close(
        attend_newest(queries, keys, values, 0.25), attend_newest_reference(queries, keys, values, 0.25),
        rtol=TOLERANCE, atol=TOLERANCE,
    )


@pytest.mark.parametrize("causal", [False, True])
def test_the_kernel_with_log_sum_exp_matches_the_formula(causal: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(1, 3, 20, 32, generator=generator)
    keys, values = torch.randn(1, 3, 20, 32, generator=generator), torch.randn(1, 3, 20, 32, generator=generator)
    output, lse = attention_with_lse(queries, keys, values, 0.2, causal)
    expected, expected_lse = attention_with_lse_reference(queries, keys, values, 0.2, causal)
    torch.testing.assert_close(output, expected, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(lse, expected_lse, rtol=TOLERANCE, atol=TOLERANCE)


def test_merging_two_halves_equals_attention_over_the_union() -> None:
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(1, 2, 4, 8, generator=generator)
    keys, values = torch.randn(1, 2, 30, 8, generator=generator), torch.randn(1, 2, 30, 8, generator=generator)
    first = attention_with_lse_reference(queries, keys[:, :, :11], values[:, :, :11], 0.3, False)
    second = attention_with_lse_reference(queries, keys[:, :, 11:], values[:, :, 11:], 0.3, False)
    whole, _ = attention_with_lse_reference(queries, keys, values, 0.3, False)
    torch.testing.assert_close(merge_attention(*first, *second), whole, rtol=TOLERANCE, atol=TOLERANCE)


def verify_logits_both_ways(loaded, prompt: list[int], following: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Logits of feeding `following` after `prompt`: through the packed forward (split attention) and
    through one masked attention call per layer (the reference)."""
    from kvlab.cache import KVCache, Segment, forward, run_packed

    caches = []
    for _ in range(2):
        cache = KVCache.allocate(loaded.architecture, 1, len(prompt) + len(following), loaded.dtype, loaded.device)
        forward(loaded.model, cache, torch.tensor([prompt]), logits_to_keep=1)
        caches.append(cache)
    fast = run_packed(loaded.model, [Segment(caches[0], len(following))], [following], list(range(len(following))))
    reference = forward(loaded.model, caches[1], torch.tensor([following]))[0]
    return fast, reference


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_verify_forward_through_the_fast_path_matches_the_masked_one_on_a_model(kv_heads: int) -> None:
    from tests.helpers import tiny_llama

    loaded = tiny_llama(num_kv_heads=kv_heads)
    generator = torch.Generator().manual_seed(kv_heads)
    tokens = torch.randint(3, 96, (120,), generator=generator).tolist()
    fast, reference = verify_logits_both_ways(loaded, tokens[:100], tokens[100:])
    torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast.argmax(dim=-1), reference.argmax(dim=-1))


def stored(kv_heads: int, num_keys: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as a cache layer holds them: the first `num_keys` of a larger preallocated buffer."""
    capacity = num_keys + 40
    keys = torch.randn(1, kv_heads, capacity, 64, generator=generator)[:, :, :num_keys]
    values = torch.randn(1, kv_heads, capacity, 64, generator=generator)[:, :, :num_keys]
    return keys, values


# One chunk with the shortest and the longest tail (2 and SPLIT_KV_CHUNK + 1 keys), two chunks, long caches.
@pytest.mark.parametrize("num_keys", [SPLIT_KV_CHUNK + 2, 2 * SPLIT_KV_CHUNK + 1, 2 * SPLIT_KV_CHUNK + 2, 100, 1000])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 1), (4, 4)])
def test_split_kv_decode_matches_the_masked_reference(num_keys: int, heads: int, kv_heads: int) -> None:
    generator = torch.Generator().manual_seed(num_keys + heads)
    queries = torch.randn(1, heads, 1, 64, generator=generator)
    keys, values = stored(kv_heads, num_keys, generator)
    folded = queries.reshape(1, kv_heads, heads // kv_heads, 64)
    split = split_kv_decode(folded, keys, values, 0.125).reshape(1, heads, 1, 64)
    reference = attend_newest_reference(queries, keys, values, 0.125)
    torch.testing.assert_close(split, reference, rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.equal(split.argmax(dim=-1), reference.argmax(dim=-1))


# Pieces that leave no keys over and some, one query per folded row and many, more queries than 64.
@pytest.mark.parametrize("pieces", [2, 3, 4])
@pytest.mark.parametrize("num_queries", [3, 9, 80])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 1), (4, 4)])
def test_verify_in_pieces_matches_the_masked_reference(
    pieces: int, num_queries: int, heads: int, kv_heads: int
) -> None:
    generator = torch.Generator().manual_seed(pieces * 1000 + num_queries * 10 + heads)
    for num_prefix in (12 * pieces, 12 * pieces + pieces - 1):
        num_keys = num_prefix + num_queries
        queries = torch.randn(1, heads, num_queries, 64, generator=generator)
        keys, values = stored(kv_heads, num_keys, generator)
        folded = queries.reshape(1, kv_heads, heads // kv_heads * num_queries, 64)
        output = attention_kernels.verify_in_pieces(folded, keys, values, 0.125, num_queries, pieces)
        output = output.reshape(1, heads, num_queries, 64)
        reference = attend_newest_reference(queries, keys, values, 0.125)
        torch.testing.assert_close(output, reference, rtol=TOLERANCE, atol=TOLERANCE)
        assert torch.equal(output.argmax(dim=-1), reference.argmax(dim=-1))


def test_a_verify_over_a_long_cache_takes_the_key_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    in_pieces = attention_kernels.verify_in_pieces

    def spy(*args: object) -> torch.Tensor:
        taken.append(args[-1])  # type: ignore[arg-type]
        return in_pieces(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_kernels, "verify_in_pieces", spy)
    monkeypatch.setattr(attention_kernels, "key_pieces", lambda kv_heads: 2)
    generator = torch.Generator().manual_seed(17)
    fewest, most = attention_kernels.PIECES_MIN_QUERIES, FOLDED_SCORES_MAX_QUERIES
    shapes = [(attention_kernels.PIECES_MIN_KEYS - 1, fewest), (attention_kernels.PIECES_MIN_KEYS, fewest - 1),
              (attention_kernels.PIECES_MIN_KEYS, most + 1), (attention_kernels.PIECES_MIN_KEYS, fewest),
              (attention_kernels.PIECES_MIN_KEYS, most)]
    with attention_kernels.NEWEST_ATTENTION.set_aside():  # the routing without the C++ kernel
        for num_prefix, num_queries in shapes:
            queries = torch.randn(1, 9, num_queries, 64, generator=generator)
            keys, values = stored(3, num_prefix + num_queries, generator)
            output = attend_newest(queries, keys, values, 0.125)
            reference = attend_newest_reference(queries, keys, values, 0.125)
            torch.testing.assert_close(output, reference, rtol=TOLERANCE, atol=TOLERANCE)
    assert taken == [2, 2], "only verifies of PIECES_MIN_QUERIES to 64 queries past PIECES_MIN_KEYS keys take them"


def test_steps_and_short_verifies_take_the_cpp_kernel_longer_ones_the_products(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy_on_newest_attention(monkeypatch)
    generator = torch.Generator().manual_seed(19)
    most = attention_kernels.NEWEST_ATTENTION_MAX_ROWS // 3
    for num_keys, num_queries in [(20, 1), (5000, 1), (5000, 2), (5000, most), (5000, most + 1), (40, most + 1)]:
        queries = torch.randn(1, 9, num_queries, 64, generator=generator)
        keys, values = stored(3, num_keys, generator)
        output = attend_newest(queries, keys, values, 0.125)
        reference = attend_newest_reference(queries, keys, values, 0.125)
        torch.testing.assert_close(output, reference, rtol=TOLERANCE, atol=TOLERANCE)
    assert calls == [[1], [1], [2], [most]], calls


def test_one_query_over_a_long_cache_takes_the_compiled_split_path_for_every_length() -> None:
    assert SPLIT_KV_CHUNK > 1
    generator = torch.Generator().manual_seed(11)
    compiled = attention_kernels.CompiledSplitKV()
    # Lengths on both sides of a chunk boundary, from one buffer as a decoding cache grows.
    for num_keys in (SPLIT_KV_MIN_KEYS, SPLIT_KV_MIN_KEYS + 1, SPLIT_KV_MIN_KEYS + SPLIT_KV_CHUNK + 3, 2000):
        queries = torch.randn(1, 9, 1, 64, generator=generator)
        keys, values = stored(3, num_keys, generator)
        folded = queries.reshape(1, 3, 3, 64)
        output = compiled.attend(folded, keys, values, 0.125)
        assert output is not None, f"the compiled path failed at {num_keys} keys"
        reference = attend_newest_reference(queries, keys, values, 0.125)
        torch.testing.assert_close(output.reshape(1, 9, 1, 64), reference, rtol=TOLERANCE, atol=TOLERANCE)


def test_attend_newest_takes_sdpa_once_compiling_fails(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(attention_kernels, "SPLIT_KV", attention_kernels.CompiledSplitKV())
    monkeypatch.setattr(attention_kernels, "NEWEST_ATTENTION", attention_kernels.NewestAttentionKernel())
    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(attention_kernels, "_build_newest_attention", no_compiler)
    generator = torch.Generator().manual_seed(13)
    queries = torch.randn(1, 9, 1, 64, generator=generator)
    keys, values = stored(3, SPLIT_KV_MIN_KEYS + 5, generator)
    with caplog.at_level("WARNING", logger="kvlab.attention_kernels"):
        first = attend_newest(queries, keys, values, 0.125)
        second = attend_newest(queries, keys, values, 0.125)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        queries.reshape(1, 3, 3, 64), keys, values, scale=0.125).reshape(1, 9, 1, 64)
    assert torch.equal(first, sdpa) and torch.equal(second, sdpa)
    messages = [record.message for record in caplog.records]
    assert len(messages) == 2, messages
    assert "could not be built" in messages[0] and "could not be compiled" in messages[1], "each warned once"


def test_warming_up_readies_the_one_query_path_before_the_first_long_cache() -> None:
    assert warm_up_split_kv(kv_heads=3, group=3, head_dim=64), "neither one-query path is ready"
    assert attention_kernels.NEWEST_ATTENTION.ready(), "the C++ kernel did not build here (g++ and ninja?)"


# Keys: fewer than a block, one block and one over, chunk boundaries (512), several chunks.
@pytest.mark.parametrize("num_keys", [1, 2, 15, 16, 17, 511, 512, 513, 1100])
@pytest.mark.parametrize(("heads", "kv_heads", "num_queries"), [(9, 3, 1), (4, 1, 1), (4, 4, 1), (9, 3, 9), (4, 2, 3)])
def test_the_cpp_kernel_matches_the_masked_reference(num_keys: int, heads: int, kv_heads: int,
                                                     num_queries: int) -> None:
    if num_queries > num_keys:
        pytest.skip("more queries than keys")
    generator = torch.Generator().manual_seed(num_keys * 7 + heads + num_queries)
    queries = torch.randn(1, heads, num_queries, 64, generator=generator)
    keys, values = stored(kv_heads, num_keys, generator)
    folded = queries.reshape(kv_heads, heads // kv_heads * num_queries, 64)
    outputs = attention_kernels.NEWEST_ATTENTION.attend([folded], [keys], [values], [num_queries], 0.125)
    assert outputs is not None, "the C++ kernel did not build here (g++ and ninja?)"
    output = outputs[0].reshape(1, heads, num_queries, 64)
    reference = attend_newest_reference(queries, keys, values, 0.125)
    torch.testing.assert_close(output, reference, rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.equal(output.argmax(dim=-1), reference.argmax(dim=-1))


@pytest.mark.parametrize("head_dim", [64, 128, 80])  # sizes the kernel is specialized for, and one it is not
def test_the_cpp_kernel_serves_every_head_size(head_dim: int) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    queries = torch.randn(1, 4, 1, head_dim, generator=generator)
    keys = torch.randn(1, 2, 700, head_dim, generator=generator)
    values = torch.randn(1, 2, 700, head_dim, generator=generator)
    output = attention_kernels.NEWEST_ATTENTION.attend([queries.reshape(2, 2, head_dim)], [keys], [values], [1], 0.1)
    assert output is not None
    reference = attend_newest_reference(queries, keys, values, 0.1)
    torch.testing.assert_close(output[0].reshape(1, 4, 1, head_dim), reference, rtol=TOLERANCE, atol=TOLERANCE)


def test_one_call_for_several_sequences_gives_each_what_it_gets_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`attend_newest_each` (a packed forward's one-token segments): each sequence's output is bit for bit
    `attend_newest`'s for it alone, whatever its length and its queries' dtype; and the kernel is called once."""
    generator = torch.Generator().manual_seed(17)
    lengths = [1, 40, 513, 2000]
    queries = [torch.randn(1, 9, 1, 64, generator=generator) for _ in lengths]
    queries[1] = queries[1].to(torch.bfloat16)  # a draft on bf16 weights
    kv = [stored(3, length, generator) for length in lengths]
    calls = spy_on_newest_attention(monkeypatch)
    together = attend_newest_each(queries, [k for k, _ in kv], [v for _, v in kv], 0.125)
    assert calls == [[1] * len(lengths)], calls
    for query, (keys, values), output in zip(queries, kv, together, strict=True):
        alone = attend_newest(query.to(torch.float32), keys, values, 0.125).to(query.dtype)
        assert output.dtype == query.dtype and torch.equal(output, alone)


_FIRST_LONG_STEP = """
import torch
from torch._dynamo.utils import counters
from kvlab.attention_kernels import warm_up_split_kv
from kvlab.cache import KVCache, Segment, forward, run_packed
from tests.helpers import tiny_llama

from kvlab import attention_kernels
loaded = tiny_llama(num_kv_heads=2)
architecture = loaded.architecture
with attention_kernels.NEWEST_ATTENTION.set_aside():  # the compiled split path, the C++ kernel's fallback
    assert warm_up_split_kv(architecture.num_kv_heads, architecture.num_kv_groups, architecture.head_dim)
    graphs = counters["stats"]["unique_graphs"]
    cache = KVCache.allocate(architecture, 1, 1200, torch.float32, "cpu", None)  # capacity past the keys
    forward(loaded.model, cache, torch.randint(3, 90, (1, 900)))
    run_packed(loaded.model, [Segment(cache, 1)], [[7]], [0])  # the engine's decode step: the split path
print(graphs, counters["stats"]["unique_graphs"])
"""


def test_after_warming_up_the_first_long_decode_step_compiles_nothing() -> None:
    # A graph compiled for other strides, grad mode or dispatch keys than a forward's was compiled again at
    # the first long request's first decode step (0.6 s or more, inside its timed decoding).
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _FIRST_LONG_STEP], capture_output=True, text=True, cwd=root,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = result.stdout.split()[-2:]
    assert int(before) >= 1, "warming up compiled nothing"
    assert after == before, "the first long decode step compiled the split path again"


@pytest.mark.parametrize("num_keys", [40, 530, 1100])
def test_a_verify_row_in_the_cpp_kernel_is_the_plain_step_at_its_position_bit_for_bit(num_keys: int) -> None:
    """Query i of a verify of q tokens sees the keys up to its own, as the plain step at its position does: the
    kernel gives both the same output, bit for bit, wherever the keys end within a block or a chunk."""
    generator = torch.Generator().manual_seed(num_keys)
    num_queries = attention_kernels.NEWEST_ATTENTION_MAX_ROWS // 3
    queries = torch.randn(1, 9, num_queries, 64, generator=generator)
    keys, values = stored(3, num_keys, generator)
    verify = attend_newest(queries, keys, values, 0.125)
    for i in range(num_queries):
        visible = num_keys - num_queries + i + 1
        step = attend_newest(queries[:, :, i : i + 1], keys[:, :, :visible], values[:, :, :visible], 0.125)
        assert torch.equal(verify[:, :, i : i + 1], step), i


def test_the_cost_model_is_told_how_many_queries_the_cpp_kernel_takes_for_a_model() -> None:
    cpu = torch.device("cpu")
    built = attention_kernels.NEWEST_ATTENTION.ready()
    # Groups of 2 query heads: 18 rows are 9 queries; of 3 (SmolLM2), 6.
    assert attention_kernels.newest_kernel_queries(2, cpu, torch.float32) == (9 if built else 1)
    assert attention_kernels.newest_kernel_queries(3, cpu, torch.float32) == (6 if built else 1)
    with attention_kernels.NEWEST_ATTENTION.set_aside():
        assert attention_kernels.newest_kernel_queries(2, cpu, torch.float32) == 1
    assert attention_kernels.newest_kernel_queries(2, cpu, torch.bfloat16) == 1
    assert attention_kernels.newest_kernel_queries(2, torch.device("meta"), torch.float32) == 1


def test_building_the_kernel_puts_the_interpreters_folder_on_path_for_the_build_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys
    from pathlib import Path

    from torch.utils import cpp_extension

    seen: list[str] = []

    def load(**kwargs: object) -> str:
        seen.append(os.environ["PATH"])
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("PATH", "/nowhere")
    assert attention_kernels._build_newest_attention() == "module"  # type: ignore[comparison-overlap]
    assert seen == [os.pathsep.join([str(Path(sys.executable).parent), "/nowhere"])]
    assert os.environ["PATH"] == "/nowhere"
