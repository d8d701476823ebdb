"""Real text bundled with kvlab, for prompts, tests and benchmarks that must run offline."""

from __future__ import annotations

from importlib.resources import files

from transformers import PreTrainedTokenizerBase


def reference_text() -> str:
    """About 195 KB (47K SmolLM2 or Gemma 3 tokens) of the Python Language Reference; see data/NOTICE.

    Long enough for 32K-token contexts with room for per-row offsets in a batch.
    """
    return (files(__package__) / "python_reference.txt").read_text(encoding="utf-8")


def document_token_ids(tokenizer: PreTrainedTokenizerBase, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of the bundled document, tokenized without special tokens.

    Raises:
        ValueError: The document is shorter than `num_tokens` for this tokenizer.
    """
    ids = list(tokenizer(reference_text(), add_special_tokens=False)["input_ids"])
    if len(ids) < num_tokens:
        raise ValueError(f"the bundled document has only {len(ids)} tokens for this tokenizer, {num_tokens} asked")
    return ids[:num_tokens]
