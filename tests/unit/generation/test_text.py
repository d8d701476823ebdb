"""Streamed text increments: never taken back, never leak a stop string, add up to the final text."""

from __future__ import annotations

from kvlab.generation.text import TextDeltas

WORDS = ["Hel", "lo", " wor", "ld", ",", " S", "TOP", " here"]


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def test_increments_add_up_to_the_final_text_without_a_stop_string() -> None:
    deltas = TextDeltas(decode, ())
    sent = "".join(deltas.push([i]) for i in range(len(WORDS)))
    assert sent + deltas.finish(decode(list(range(len(WORDS))))) == "Hello world, STOP here"


def test_a_stop_string_is_held_back_and_never_sent() -> None:
    deltas = TextDeltas(decode, (" STOP",))
    sent = [deltas.push([i]) for i in range(7)]
    assert " S" not in "".join(sent), f"a possible start of the stop string was sent early: {sent}"
    assert "".join(sent) + deltas.finish("Hello world,") == "Hello world,"


def test_an_incomplete_character_waits_for_its_next_token() -> None:
    pieces = {0: b"caf", 1: b"\xc3", 2: b"\xa9!"}

    def decode_bytes(ids: list[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    deltas = TextDeltas(decode_bytes, ())
    assert [deltas.push([0]), deltas.push([1]), deltas.push([2])] == ["caf", "", "é!"]
