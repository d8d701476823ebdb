"""The target's KV handed from KVLabConnector to KVLabDraftProposer: rows matched to requests by their
blocks, prompts adopted from the pages instead of prefilled, accepted tokens appended from them, and
every missing, truncated or forged hand-over falling back to the drafter's own prefill with the same
drafts. Pages here are written with the layout vLLM's CPU kernel uses (see test_vllm_connector.py for
the layout against the kernel itself); the engine tests are in test_vllm_proposer.py."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch

from kvlab.cache import KVCache, forward
from kvlab.compress import create_compressor
from kvlab.integrations.vllm.adoption import FLOAT32_TOLERANCE, handover_tolerance, kv_mismatch
from kvlab.integrations.vllm.handover import (
    BOARD,
    HandedRow,
    HandoverBoard,
    ScheduledRequest,
    StepHandover,
    rows_of_step,
)
from kvlab.integrations.vllm.layouts import CPUTransposedKeyLayout, slots_of
from kvlab.integrations.vllm.proposer import KVLabDraftProposer
from kvlab.integrations.vllm.sources import StepCosts
from kvlab.lossless.cost_model import SegmentShape
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama
from tests.integration.test_vllm_proposer import NUM_SPECULATIVE_TOKENS, batch, greedy_continuation, vllm_config

BLOCK_SIZE = 8
NUM_BLOCKS = 64
LAYOUT = CPUTransposedKeyLayout()
PROMPTS = [[(7 * i + 3) % 90 + 3 for i in range(70)], [(5 * i + 2) % 90 + 3 for i in range(57)]]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=5)


def model_kv(model: LoadedModel, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, kvlab's own ([H_kv, T, D] keys, values) of `tokens`."""
    cache = KVCache.allocate(model.architecture, 1, len(tokens), model.dtype, model.device)
    forward(model.model, cache, torch.tensor([tokens]))
    return [layer.stored(0) for layer in cache.layers]


class Pages:
    """vLLM-like pages of one engine: per layer `[NUM_BLOCKS, H_kv, BLOCK_SIZE, 2 * D]`, requests'
    block tables handed out from the end of the pool so that they are not the identity."""

    def __init__(self, model: LoadedModel) -> None:
        arch = model.architecture
        shape = (NUM_BLOCKS, arch.num_kv_heads, BLOCK_SIZE, 2 * arch.head_dim)
        self.pages = [torch.zeros(shape) for _ in range(arch.num_layers)]
        self.tables: dict[str, list[int]] = {}
        self.model = model

    def write(self, req_id: str, tokens: list[int]) -> HandedRow:
        """Write kvlab's KV of `tokens` into the request's blocks; the row the connector would hand over."""
        table = self.tables.setdefault(req_id, [])
        while len(table) * BLOCK_SIZE < len(tokens):
            table.append(NUM_BLOCKS - 1 - sum(len(t) for t in self.tables.values()))
        slots = slots_of(table, BLOCK_SIZE, 0, len(tokens))
        for page, (keys, values) in zip(self.pages, model_kv(self.model, tokens), strict=True):
            LAYOUT.scatter(page, slots, keys, values)
        return HandedRow(req_id, torch.tensor(table), len(tokens))

    def step(self, rows: list[HandedRow], finished: frozenset[str] = frozenset()) -> StepHandover:
        return StepHandover(rows, self.pages, LAYOUT, BLOCK_SIZE, finished)


def proposer_for(model: LoadedModel, drafter: str = "snapkv", draft_length: str = "fixed",
                 **params: Any) -> KVLabDraftProposer:
    """A proposer drafting `num_speculative_tokens` every step (`fixed`: the tests check what it drafts)."""
    proposer = KVLabDraftProposer(vllm_config(), create_compressor(drafter, **params), draft_length=draft_length)
    proposer.engine = f"test-{id(proposer)}"
    proposer.model = model
    BOARD.connect(proposer.engine)
    return proposer


def propose(proposer: KVLabDraftProposer, histories: list[list[int]], step: StepHandover | None) -> list[list[int]]:
    if step is not None:
        BOARD.publish(proposer.engine, step)
    lengths, token_ids = batch(histories)
    return proposer.propose([[h[-1]] for h in histories], lengths, token_ids)


def test_gathered_pages_are_the_written_kv(tiny: LoadedModel) -> None:
    pages = Pages(tiny)
    row = pages.write("a", PROMPTS[0])
    gathered = pages.step([row]).gather(0, 5, 61)
    for (keys, values), (want_keys, want_values) in zip(gathered, model_kv(tiny, PROMPTS[0]), strict=True):
        assert torch.equal(keys[0], want_keys[:, 5:61]) and torch.equal(values[0], want_values[:, 5:61])
    with pytest.raises(ValueError, match="holds 70 tokens"):
        pages.step([row]).gather(0, 0, 71)


def test_rows_are_matched_to_requests_by_the_block_of_their_first_new_token() -> None:
    # Row 0: a decode of request b (token 19, in block 7); row 1: a prefill chunk of request a (blocks 3, 4);
    # row 2: a request the scheduler did not name.
    block_table = torch.tensor([[9, 7, 0], [3, 4, 0], [11, 0, 0]], dtype=torch.int32)
    slot_mapping = torch.tensor([7 * 8 + 3, 3 * 8, 3 * 8 + 1, 4 * 8, 11 * 8 + 2])
    metadata = types.SimpleNamespace(query_start_loc=torch.tensor([0, 1, 4, 5]), seq_lens=torch.tensor([12, 9, 3]),
                                     block_table=block_table, slot_mapping=slot_mapping)
    scheduled = [ScheduledRequest("a", 3), ScheduledRequest("b", 7)]
    rows = rows_of_step(metadata, scheduled, BLOCK_SIZE)
    assert [row.req_id for row in rows] == ["b", "a", None]
    assert rows[0].block_ids.tolist() == [9, 7] and rows[0].num_tokens == 12
    assert rows[1].block_ids.tolist() == [3, 4]


def test_the_board_hands_each_step_over_once_and_keeps_finished_requests_until_taken() -> None:
    board = HandoverBoard()
    assert not board.connected("e") and board.take("e") is None
    board.connect("e")
    step = StepHandover([], [], LAYOUT, BLOCK_SIZE, frozenset({"x"}))
    board.publish("e", step)
    board.publish("e", StepHandover([], [], LAYOUT, BLOCK_SIZE, frozenset({"y"})))
    taken = board.take("e")
    assert taken is not None and taken.finished == {"x", "y"} and board.take("e") is None
    board.disconnect("e")
    assert not board.connected("e")


def test_a_handed_over_prompt_is_adopted_and_accepted_tokens_come_from_the_pages(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    pages = Pages(tiny)
    history = PROMPTS[0] + [17]
    drafts = propose(proposer, [history], pages.step([pages.write("a", history[:-1])]))
    assert drafts[0] == greedy_continuation(tiny, history, NUM_SPECULATIVE_TOKENS)
    stats = proposer.stats
    assert (stats.num_adopted, stats.num_prefills, stats.num_window_tokens) == (1, 0, 32)
    assert stats.num_handover_tokens == len(PROMPTS[0]) - 32
    # vLLM accepted two drafts and sampled a bonus token; the pages now hold the KV of all but that one.
    grown = history + drafts[0][:2] + [23]
    drafts = propose(proposer, [grown], pages.step([pages.write("a", grown[:-1])]))
    assert drafts[0] == greedy_continuation(tiny, grown, NUM_SPECULATIVE_TOKENS)
    assert stats.num_prefills == 0 and stats.num_handover_tokens == len(PROMPTS[0]) - 32 + 2
    assert stats.num_catch_up_tokens == 2, "one token fed per step: the last sampled one"
    assert stats.fallbacks == {}


def test_an_adopted_prompt_is_compressed_as_a_prefilled_one(tiny: LoadedModel) -> None:
    handed, prefilled = proposer_for(tiny, "snapkv", budget=40), proposer_for(tiny, "snapkv", budget=40)
    pages = Pages(tiny)
    history = PROMPTS[0] + [17]
    with_handover = propose(handed, [history], pages.step([pages.write("a", history[:-1])]))
    BOARD.disconnect(prefilled.engine)
    assert with_handover == propose(prefilled, [history], None)
    assert handed.stats.num_adopted == 1 and prefilled.stats.num_prefills == 1
    stored_keys, _ = handed.by_request["a"].cache.layers[0].stored(0)
    assert stored_keys.shape[-2] == 40 + 1, "the compressed prompt plus the last token"


def test_rows_keep_their_request_when_vllm_reorders_them_and_finished_requests_are_freed(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    pages = Pages(tiny)
    histories = [PROMPTS[0] + [17], PROMPTS[1] + [19]]
    rows = [pages.write(req, h[:-1]) for req, h in zip("ab", histories, strict=True)]
    first = propose(proposer, histories, pages.step(rows))
    grown = [histories[1] + first[1][:1] + [4], histories[0] + [6]]
    rows = [pages.write(req, h[:-1]) for req, h in zip("ba", grown, strict=True)]
    drafts = propose(proposer, grown, pages.step(rows))
    assert drafts == [greedy_continuation(tiny, h, NUM_SPECULATIVE_TOKENS) for h in grown]
    assert proposer.stats.num_adopted == 2 and proposer.stats.num_prefills == 0
    assert set(proposer.by_request) == {"a", "b"} and proposer.by_prefix == []
    grown = [grown[1] + [8]]
    propose(proposer, grown, pages.step([pages.write("a", grown[0][:-1])], finished=frozenset({"b"})))
    assert set(proposer.by_request) == {"a"}


@pytest.mark.parametrize("fault", ["forged", "truncated", "unmatched"])
def test_a_faulty_hand_over_falls_back_to_a_prefill_with_the_same_drafts(
    tiny: LoadedModel, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    pages = Pages(tiny)
    history = PROMPTS[1] + [29]
    row = pages.write("a", history[:-1])
    if fault == "forged":
        torch.manual_seed(0)
        for page in pages.pages:
            page.normal_()
    elif fault == "truncated":
        row = HandedRow("a", row.block_ids, row.num_tokens - 9)
    else:
        row = HandedRow(None, row.block_ids, row.num_tokens)
    with caplog.at_level(logging.WARNING, logger="kvlab.integrations.vllm.proposer"):
        drafts = propose(proposer, [history], pages.step([row]))
    assert drafts[0] == greedy_continuation(tiny, history, NUM_SPECULATIVE_TOKENS)
    assert proposer.stats.num_prefills == 1 and proposer.stats.num_adopted == 0
    assert sum(proposer.stats.fallbacks.values()) == 1
    assert [r.message for r in caplog.records if "falls back" in r.message], "the fallback was not logged"


def test_without_a_hand_over_the_proposer_says_so_once_and_drafts_from_token_ids(
    tiny: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    BOARD.disconnect(proposer.engine)
    history = PROMPTS[0] + [17]
    with caplog.at_level(logging.WARNING, logger="kvlab.integrations.vllm.proposer"):
        propose(proposer, [history], None)
        drafts = propose(proposer, [history + [3]], None)
    assert drafts[0] == greedy_continuation(tiny, history + [3], NUM_SPECULATIVE_TOKENS)
    said = [r.message for r in caplog.records if "no KVLabConnector" in r.message]
    assert len(said) == 1 and proposer.stats.num_prefills == 1


def test_the_mismatch_check_takes_kernel_noise_and_refuses_other_kv() -> None:
    torch.manual_seed(1)
    keys, values = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    noisy = [(keys * (1 + 1e-5), values + 1e-6)]
    assert kv_mismatch([(keys, values)], noisy) is None
    assert kv_mismatch([(keys, values)], [(keys, values * (1 + 10 * FLOAT32_TOLERANCE))]) is not None
    assert kv_mismatch([(keys, values)], [(keys[:, :, 1:], values[:, :, 1:])]) is not None
    assert kv_mismatch([(keys, values)], [(torch.full_like(keys, float("nan")), values)]) is not None
    assert handover_tolerance(torch.float32) == FLOAT32_TOLERANCE < handover_tolerance(torch.bfloat16) < 0.1


def test_pages_that_stop_matching_the_drafter_make_the_request_draft_from_token_ids(
    tiny: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    pages = Pages(tiny)
    history = PROMPTS[0] + [17]
    propose(proposer, [history], pages.step([pages.write("a", history[:-1])]))
    grown = history + [5, 6]
    row = pages.write("a", grown[:-1])
    # The next step's pages hold another token where the drafter computed the last one.
    row = pages.write("a", grown[:len(history) - 1] + [40] + grown[len(history):-1])
    with caplog.at_level(logging.WARNING, logger="kvlab.integrations.vllm.proposer"):
        drafts = propose(proposer, [grown], pages.step([row]))
    assert drafts[0] == greedy_continuation(tiny, grown, NUM_SPECULATIVE_TOKENS)
    assert proposer.stats.fallbacks == {"hand-over KV": 1} and "a" in proposer.untrusted
    assert proposer.stats.num_prefills == 1 and "a" not in proposer.by_request
    propose(proposer, [grown + [7]], pages.step([pages.write("a", grown)], finished=frozenset({"a"})))
    assert "a" not in proposer.untrusted and proposer.stats.num_prefills == 1


# Every registered compressor, at settings that compress the 70-token prompt.
TINY_DRAFTERS: dict[str, dict[str, Any]] = {
    "snapkv": {"budget": 40},
    "snapkv_agnostic": {"budget": 40},
    "h2o": {"budget": 40},
    "streamingllm": {"budget": 24},
    "cam": {"budget": 40},
    "kivi": {"bits": 2, "group_size": 8, "residual_length": 8},
    "turboquant": {"bits": 3, "residual_length": 8},
}


def test_every_registered_compressor_is_tried_as_a_drafter() -> None:
    from kvlab.compress import compressors

    assert sorted(TINY_DRAFTERS) == compressors.names()


@pytest.mark.parametrize("name", sorted(TINY_DRAFTERS))
def test_every_drafter_drafts_from_a_hand_over(tiny: LoadedModel, name: str) -> None:
    params = TINY_DRAFTERS[name]
    handed, prefilled = proposer_for(tiny, name, **params), proposer_for(tiny, name, **params)
    BOARD.disconnect(prefilled.engine)
    pages = Pages(tiny)
    history = PROMPTS[0] + [17]
    drafts = propose(handed, [history], pages.step([pages.write("a", history[:-1])]))
    assert len(drafts[0]) == NUM_SPECULATIVE_TOKENS and handed.stats.fallbacks == {}
    every_query = handed.drafter.observes_every_query
    assert (handed.stats.num_adopted, handed.stats.num_prefills) == ((0, 1) if every_query else (1, 0))
    # The pages hold kvlab's own KV here, so an adopted prompt drafts exactly as a prefilled one.
    assert drafts == propose(prefilled, [history], None)


def fitted_costs(weights: str, draft_forward_s: float) -> StepCosts:
    """vLLM steps of 100 ms whatever the rows propose, and draft forwards of `draft_forward_s`."""
    costs = StepCosts(weights)
    for proposed in (0, 4, 2, 0, 3, 1, 4, 2, 0):
        costs.observe_step([SegmentShape(proposed + 1, 60)], 0.1)
        costs.observe_draft([SegmentShape(1, 30)], draft_forward_s)
    return costs


def test_a_lookup_round_drafts_no_forward_and_the_row_is_adopted_when_its_cache_first_drafts(
        tiny: LoadedModel) -> None:
    from kvlab.lossless.prompt_lookup import PromptLookup, find_match

    proposer = proposer_for(tiny, "snapkv", draft_length="auto", compression_ratio=0.0)
    proposer.lookup = PromptLookup()
    proposer.costs = fitted_costs(proposer.draft_weights, draft_forward_s=1.0)  # the cache: too dear to draft
    pages = Pages(tiny)
    history = PROMPTS[1][:30] * 2 + [PROMPTS[1][30]]
    drafts = propose(proposer, [history], pages.step([pages.write("a", history[:-1])]))
    assert drafts[0] == find_match(history, NUM_SPECULATIVE_TOKENS, PromptLookup()).token_ids != []
    assert proposer.stats.num_draft_forwards == 0 and proposer.stats.num_lookup_rounds == 1
    assert proposer.stats.num_lookup_draft_tokens == len(drafts[0]) and proposer.stats.num_draft_tokens == 0
    assert proposer.stats.num_adopted == 0, "a row served by its lookup paid for a window and a compression"
    # The lookup's round emitted 1 token; the cache is expected to emit about 3.4 in a round of 4 drafts at
    # 10 ms each beside a 100 ms step: the cache drafts next.
    proposer.costs = fitted_costs(proposer.draft_weights, draft_forward_s=0.01)
    grown = history + [PROMPTS[1][31]]  # the repetition goes on: the lookup has a proposal again
    assert find_match(grown, NUM_SPECULATIVE_TOKENS, PromptLookup()).token_ids
    drafts = propose(proposer, [grown], pages.step([pages.write("a", grown[:-1])]))
    assert drafts[0] == greedy_continuation(tiny, grown, NUM_SPECULATIVE_TOKENS)
    assert proposer.stats.num_draft_forwards == NUM_SPECULATIVE_TOKENS and proposer.stats.fallbacks == {}
    assert (proposer.stats.num_adopted, proposer.stats.num_prefills) == (1, 0)  # from the pages, on its first round


def test_the_first_call_fits_the_draft_forward_on_synthetic_caches_and_adopts_nothing(tiny: LoadedModel) -> None:
    proposer = proposer_for(tiny, "snapkv", draft_length="auto", compression_ratio=0.0)
    assert not proposer.costs.forwards.ready(proposer.draft_weights)
    pages = Pages(tiny)
    history = PROMPTS[0] + [17]
    drafts = propose(proposer, [history], pages.step([pages.write("a", history[:-1])]))
    assert proposer.costs.forwards.ready(proposer.draft_weights)
    # The bootstrap's first plan: this row has no lookup, and the bootstrap never drafts from the cache.
    assert drafts == [[]] and proposer.stats.num_adopted == 0 and proposer.stats.num_draft_forwards == 0


def test_vllm_steps_are_timed_only_where_they_decoded_the_last_calls_sequences_and_nothing_else(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[list[int]] = []
    monkeypatch.setattr(StepCosts, "observe_step", lambda self, rows, seconds: timed.append(
        [row.num_tokens for row in rows]))
    proposer = proposer_for(tiny, "snapkv", compression_ratio=0.0)
    pages = Pages(tiny)
    history = PROMPTS[0] + [17]
    propose(proposer, [history], pages.step([pages.write("a", history[:-1])]))
    assert timed == []  # the step before a request's first call prefilled it
    history = history + [5]
    propose(proposer, [history], pages.step([pages.write("a", history[:-1])]))
    assert timed == [[NUM_SPECULATIVE_TOKENS + 1]]  # the last call's proposal and its sampled token
    # A step that ran a chunk of another request's prefill (its row sampled nothing) is not timed.
    history = history + [6]
    BOARD.publish(proposer.engine, pages.step([pages.write("a", history[:-1])]))
    lengths, token_ids = batch([history, PROMPTS[1][:20]])
    proposer.propose([[history[-1]], []], lengths, token_ids)
    assert len(timed) == 1
