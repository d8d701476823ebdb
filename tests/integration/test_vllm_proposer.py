"""KVLabDraftProposer: drafts are the compressed-cache model's greedy tokens, kept per sequence across
reordered rows; inside a real vLLM engine (in .venv-vllm) output equals plain greedy decoding."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
import torch

from kvlab.compress import create_compressor
from kvlab.engine import generate
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.integrations.vllm.proposer import DRAFTER_ENV, KVLabDraftProposer, drafter_from_environment
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama

NUM_SPECULATIVE_TOKENS = 4
MAX_MODEL_LEN = 256


def vllm_config(num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS) -> Any:
    """The parts of a VllmConfig the proposer reads."""
    return types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
        model_config=types.SimpleNamespace(model="unused", dtype="float32", max_model_len=MAX_MODEL_LEN),
    )


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=11)


def proposer_for(model: LoadedModel, drafter: str = "snapkv", draft_length: str = "fixed",
                 **params: Any) -> KVLabDraftProposer:
    """A proposer drafting `num_speculative_tokens` every step (`fixed`: the tests check what it drafts)."""
    proposer = KVLabDraftProposer(vllm_config(), create_compressor(drafter, **params), draft_length=draft_length)
    proposer.model = model  # what load_model loads from the served checkpoint
    return proposer


def batch(histories: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's (num_tokens_no_spec [rows], token_ids_cpu [rows, max_model_len]) for these histories."""
    token_ids = np.zeros((len(histories) + 2, MAX_MODEL_LEN), dtype=np.int32)
    for row, history in enumerate(histories):
        token_ids[row, : len(history)] = history
    return np.array([len(h) for h in histories] + [0, 0]), token_ids


def greedy_continuation(model: LoadedModel, history: list[int], num_tokens: int) -> list[int]:
    config = GenerationConfig(max_new_tokens=num_tokens, ignore_eos=True)
    return generate(model, [history], config).requests[0].token_ids


PROMPTS = [[(3 * i + 5) % 90 + 3 for i in range(40)], [(11 * i + 1) % 90 + 3 for i in range(33)]]


def test_a_drafter_that_keeps_everything_drafts_the_greedy_continuation(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    lengths, token_ids = batch(PROMPTS)
    drafts = proposer.propose([[p[-1]] for p in PROMPTS], lengths, token_ids)
    for row, prompt in enumerate(PROMPTS):
        assert drafts[row] == greedy_continuation(tiny, prompt, NUM_SPECULATIVE_TOKENS), f"row {row}"


def test_sequences_are_found_again_by_prefix_when_rows_are_reordered(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    lengths, token_ids = batch(PROMPTS)
    first = proposer.propose([[p[-1]] for p in PROMPTS], lengths, token_ids)
    # vLLM accepted two drafts of row 0 and none of row 1 (plus a bonus token each), then swapped the rows.
    grown = [PROMPTS[1] + [7], PROMPTS[0] + first[0][:2] + [9]]
    lengths, token_ids = batch(grown)
    drafts = proposer.propose([[7], first[0][:2] + [9]], lengths, token_ids)
    assert proposer.stats.num_prefills == 2, "a kept sequence was prefilled again"
    assert proposer.stats.num_catch_up_tokens == 2 + 1 + 3, "each step feeds only the tokens vLLM accepted"
    assert drafts == [greedy_continuation(tiny, history, NUM_SPECULATIVE_TOKENS) for history in grown]


def test_rows_without_sampled_tokens_or_at_the_length_limit_get_no_drafts(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.5)
    long_history = [5] * (MAX_MODEL_LEN - 2)
    lengths, token_ids = batch([PROMPTS[0], long_history, PROMPTS[1]])
    drafts = proposer.propose([[], [5], [PROMPTS[1][-1]]], lengths, token_ids)
    assert drafts[0] == [] and drafts[1] == [] and len(drafts[2]) == NUM_SPECULATIVE_TOKENS
    assert proposer.stats.num_prefills == 1


def test_a_compressing_drafter_still_drafts_from_its_own_cache(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "streamingllm", budget=16)
    lengths, token_ids = batch(PROMPTS[:1])
    drafts = proposer.propose([[PROMPTS[0][-1]]], lengths, token_ids)
    assert len(drafts[0]) == NUM_SPECULATIVE_TOKENS
    stored_keys, _ = proposer.by_prefix[0].cache.layers[0].stored(0)
    # The compressed prompt plus the last token, fed after compression; the drafts' KV was dropped.
    assert stored_keys.shape[-2] == 16 + 1 < len(PROMPTS[0])


def test_a_prompt_shorter_than_the_budget_drafts_from_a_full_cache(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "snapkv", budget=1000)
    lengths, token_ids = batch(PROMPTS[:1])
    drafts = proposer.propose([[PROMPTS[0][-1]]], lengths, token_ids)
    assert drafts[0] == greedy_continuation(tiny, PROMPTS[0], NUM_SPECULATIVE_TOKENS)


def test_the_drafter_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DRAFTER_ENV, '{"name": "streamingllm", "budget": 64}')
    compressor, lookup = drafter_from_environment()
    assert compressor.to_dict()["budget"] == 64 and lookup is None
    monkeypatch.setenv(DRAFTER_ENV, '{"name": "ngram+snapkv", "budget": 32}')
    compressor, lookup = drafter_from_environment()
    assert compressor.to_dict()["budget"] == 32 and lookup is not None
    monkeypatch.setenv(DRAFTER_ENV, "snapkv")
    with pytest.raises(ConfigError, match=DRAFTER_ENV):
        drafter_from_environment()
    monkeypatch.setenv(DRAFTER_ENV, '{"name": "nope"}')
    with pytest.raises(ConfigError, match="unknown compressor"):
        drafter_from_environment()


# ----- inside a vLLM engine (.venv-vllm)


@pytest.fixture(scope="module")
def spec_engine() -> Any:
    pytest.importorskip("vllm", reason="the vLLM integration tests run in .venv-vllm (make test-vllm)")
    from tests.integration.vllm.engines import make_engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DRAFTER_ENV, '{"name": "snapkv", "budget": 64}')
        llm = make_engine(
            speculative_config={
                "method": "custom_class",
                "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                "model": "kvlab.integrations.vllm.KVLabDraftProposer",
            },
            disable_log_stats=False,
        )
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.integration
def test_vllm_drafting_with_a_kvlab_compressor_keeps_greedy_output(spec_engine: Any) -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvlab.data import document_token_ids
    from kvlab.integrations.vllm.model import model_directory, transformers_model

    proposer = proposer_of(spec_engine)  # drafting every step from here on
    document = document_token_ids(AutoTokenizer.from_pretrained(model_directory()), 300)
    prompts = [document[:160], document[160:260]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = spec_engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    reference = transformers_model(model_directory(), "float32")
    expected = generate(reference, prompts, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    for row, (output, wanted) in enumerate(zip(outputs, expected.requests, strict=True)):
        assert list(output.outputs[0].token_ids) == wanted.token_ids, f"prompt {row} decoded differently"
    assert proposer.stats.num_prefills == 2 and proposer.stats.num_draft_tokens > 0
    accepted = spec_decode_counter(spec_engine, "vllm:spec_decode_num_accepted_tokens")
    assert accepted > 0, "vLLM accepted none of the drafts"


def proposer_of(engine: Any, draft_length: str = "fixed") -> KVLabDraftProposer:
    """The proposer inside an in-process engine (the engine core runs in this process in the tests), set to
    draft every step (`fixed`): these tests check the drafting paths, which `auto` skips where a tiny model's
    vLLM step is cheaper than a draft forward."""
    runner = engine.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert isinstance(runner.drafter, KVLabDraftProposer)
    runner.drafter.draft_length = draft_length
    return runner.drafter


def spec_decode_counter(engine: Any, name: str) -> int:
    return int(sum(metric.value for metric in engine.get_metrics() if metric.name == name))


# ----- with KVLabConnector handing vLLM's KV over (.venv-vllm)

# Drafters at settings that compress prompts of 100-300 tokens.
ENGINE_DRAFTERS: dict[str, dict[str, Any]] = {
    "snapkv": {"budget": 64},
    "snapkv_agnostic": {"budget": 64},
    "h2o": {"budget": 64},
    "streamingllm": {"budget": 48},
    "cam": {"budget": 64},
    "kivi": {"bits": 2, "group_size": 32, "residual_length": 32},
    "turboquant": {"bits": 3},
}
# Few enough blocks (of 32 tokens) that four 320-token requests preempt each other; enough for one
# request of MAX_MODEL_LEN (1024 tokens), which vLLM requires.
NUM_BLOCKS = 34


@pytest.fixture(scope="module")
def handover_engine() -> Any:
    pytest.importorskip("vllm", reason="the vLLM integration tests run in .venv-vllm (make test-vllm)")
    from vllm.config import KVTransferConfig

    from tests.integration.vllm.engines import make_engine

    transfer = KVTransferConfig(kv_connector="KVLabConnector", kv_connector_module_path="kvlab.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config={})
    llm = make_engine(
        speculative_config={"method": "custom_class", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                            "model": "kvlab.integrations.vllm.KVLabDraftProposer"},
        kv_transfer_config=transfer, num_gpu_blocks_override=NUM_BLOCKS, disable_log_stats=False,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def document() -> list[int]:
    from transformers import AutoTokenizer

    from kvlab.data import document_token_ids
    from kvlab.integrations.vllm.model import model_directory

    return document_token_ids(AutoTokenizer.from_pretrained(model_directory()), 1300)


def decode_both(engine: Any, prompts: list[list[int]], lengths: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(vLLM's greedy tokens, kvlab's plain greedy tokens) of each prompt, `lengths[i]` new tokens each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvlab.integrations.vllm.model import model_directory, transformers_model

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    reference = transformers_model(model_directory(), "float32")
    expected = [generate(reference, [p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).requests[0].token_ids
                for p, n in zip(prompts, lengths, strict=True)]
    return [list(output.outputs[0].token_ids) for output in outputs], expected


@pytest.mark.integration
@pytest.mark.parametrize("drafter", sorted(ENGINE_DRAFTERS))
def test_drafting_from_handed_over_kv_keeps_greedy_output(handover_engine: Any, document: list[int],
                                                          drafter: str) -> None:
    proposer = proposer_of(handover_engine)
    proposer.drafter = create_compressor(drafter, **ENGINE_DRAFTERS[drafter])
    proposer.stats = type(proposer.stats)()
    # Three requests at once that end at different steps.
    prompts, lengths = [document[:160], document[160:260], document[300:600]], [24, 9, 30]
    got, expected = decode_both(handover_engine, prompts, lengths)
    assert got == expected
    stats = proposer.stats
    # A compressor that scores with every prompt query needs the prompt computed whole.
    prefilled = proposer.drafter.observes_every_query
    assert (stats.num_adopted, stats.num_prefills, stats.fallbacks) == (0 if prefilled else 3, 3 * prefilled, {})
    prompt_tokens_handed = 0 if prefilled else sum(len(p) for p in prompts) - 3 * 64
    assert stats.num_handover_tokens > prompt_tokens_handed, "accepted tokens came from pages"
    assert stats.num_draft_tokens > 0


def test_compressors_are_all_tried_inside_vllm() -> None:
    from kvlab.compress import compressors

    assert sorted(ENGINE_DRAFTERS) == compressors.names()


@pytest.mark.integration
def test_preempted_requests_keep_their_draft_caches_and_output(handover_engine: Any, document: list[int]) -> None:
    proposer = proposer_of(handover_engine)
    proposer.drafter = create_compressor("snapkv", budget=64)
    proposer.stats = type(proposer.stats)()
    preempted = spec_decode_counter(handover_engine, "vllm:num_preemptions")
    # All four fit in the blocks at first (800 tokens) but not once they have grown (1280).
    prompts = [document[i * 300:i * 300 + 200] for i in range(4)]
    got, expected = decode_both(handover_engine, prompts, [120] * 4)
    assert got == expected
    assert spec_decode_counter(handover_engine, "vllm:num_preemptions") > preempted, "nothing was preempted"
    assert proposer.stats.num_prefills == 0 and proposer.stats.fallbacks == {}
    assert proposer.stats.num_adopted == 4, "a resumed request was adopted again instead of extended"


@pytest.mark.integration
def test_handed_over_kv_is_the_kv_kvlab_computes(handover_engine: Any, document: list[int],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlab.integrations.vllm import handover
    from kvlab.integrations.vllm.adoption import FLOAT32_TOLERANCE
    from kvlab.integrations.vllm.model import model_directory, transformers_model
    from tests.integration.test_vllm_handover import model_kv

    prompt = document[:300]
    gathered: list[Any] = []
    publish = handover.HandoverBoard.publish

    def capture(board: Any, engine: str, step: Any) -> None:
        if not gathered:
            gathered.extend(step.gather(0, 0, len(prompt)))
        publish(board, engine, step)

    monkeypatch.setattr(handover.HandoverBoard, "publish", capture)
    decode_both(handover_engine, [prompt], [2])
    computed = model_kv(transformers_model(model_directory(), "float32"), prompt)
    worst = 0.0
    for (keys, values), (want_keys, want_values) in zip(gathered, computed, strict=True):
        for got, want in ((keys[0], want_keys), (values[0], want_values)):
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    assert worst <= FLOAT32_TOLERANCE, f"vLLM's KV is {worst:.2e} (relative) from kvlab's"


@pytest.mark.integration
@pytest.mark.parametrize("fault", ["forged", "truncated"])
def test_a_faulty_hand_over_in_vllm_falls_back_with_identical_output(
    handover_engine: Any, document: list[int], fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from kvlab.integrations.vllm import handover

    proposer = proposer_of(handover_engine)
    proposer.drafter = create_compressor("snapkv", budget=64)
    proposer.stats = type(proposer.stats)()
    publish = handover.HandoverBoard.publish

    def corrupt(board: Any, engine: str, step: Any) -> None:
        if fault == "forged":
            step = dataclasses.replace(step, pages=[torch.randn_like(page) for page in step.pages])
        else:
            rows = [dataclasses.replace(row, num_tokens=row.num_tokens // 2) for row in step.rows]
            step = dataclasses.replace(step, rows=rows)
        publish(board, engine, step)

    monkeypatch.setattr(handover.HandoverBoard, "publish", corrupt)
    got, expected = decode_both(handover_engine, [document[:200]], [12])
    assert got == expected
    assert proposer.stats.num_adopted == 0 and proposer.stats.num_prefills >= 1
    assert sum(proposer.stats.fallbacks.values()) >= 1


@pytest.mark.integration
def test_prompt_lookup_composed_with_the_cache_keeps_greedy_output(handover_engine: Any, document: list[int]) -> None:
    from kvlab.lossless.prompt_lookup import PromptLookup

    proposer = proposer_of(handover_engine)
    proposer.drafter, proposer.lookup = create_compressor("snapkv", budget=64), PromptLookup()
    proposer.stats = type(proposer.stats)()
    try:
        # A prompt that repeats itself: the lookup finds what follows.
        prompts = [document[:150] * 2, document[400:600]]
        got, expected = decode_both(handover_engine, prompts, [40, 40])
    finally:
        proposer.lookup = None
    assert got == expected
    assert proposer.stats.num_lookup_rounds > 0 and proposer.stats.num_draft_forwards > 0


def test_the_draft_weights_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlab.integrations.vllm.proposer import DRAFT_WEIGHTS_ENV, draft_weights_from_environment

    assert draft_weights_from_environment() == "same"
    monkeypatch.setenv(DRAFT_WEIGHTS_ENV, "int8")
    assert draft_weights_from_environment() == "int8"
    monkeypatch.setenv(DRAFT_WEIGHTS_ENV, "int4")
    assert draft_weights_from_environment() == "int4"
    monkeypatch.setenv(DRAFT_WEIGHTS_ENV, "fp8")
    with pytest.raises(ConfigError, match="KVLAB_VLLM_DRAFT_WEIGHTS must be one of same, bf16, int8, int4, got 'fp8'"):
        draft_weights_from_environment()
