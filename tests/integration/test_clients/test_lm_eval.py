"""lm-evaluation-harness 0.4.13 (.venv-lmeval) drives `kvlab serve` through `local-completions` with its
default settings (token-id prompts tokenized with the model directory's tokenizer) on the local tasks of
tasks/: generation completes and is the same batched and in lossless mode; multiple-choice accuracy and
perplexity equal lm-eval's own `hf` backend on the same model directory."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_clients.clients import TASKS, run_client
from tests.integration.test_serve.server import ServeProcess

GENERATION = "kvlab_generation"
MULTIPLE_CHOICE = "kvlab_multiple_choice"
PERPLEXITY = "kvlab_perplexity"
# The server's float32 forward (kvlab's attention) and transformers' own differ in the last bits: measured
# 1.4e-5 at most on any loglikelihood here (1e-7 relative on the perplexities), far inside these bounds.
PERPLEXITY_RTOL = 1e-4
LOGLIKELIHOOD_ATOL = 1e-4
TIMEOUT_S = 600


@dataclass(frozen=True)
class LMEvalRun:
    """One lm-eval run: `results` per task (metric name -> value), `samples` per task (one dict a document)."""

    results: dict[str, dict[str, Any]]
    samples: dict[str, list[dict[str, Any]]]

    def answers(self, task: str) -> list[str]:
        """A generation task's answer to each document, as generated (logged as [[text]])."""
        return [str(sample["resps"][0][0]) for sample in self.samples[task]]


def lm_eval(venv: Path, workdir: Path, label: str, model_args: dict[str, object], *args: str) -> LMEvalRun:
    """`lm-eval run --model ... --tasks ...` from tasks/ (its data paths are relative), with per-document samples."""
    output = workdir / label
    model_args_text = ",".join(f"{key}={value}" for key, value in model_args.items())
    command = [str(venv / "bin" / "lm-eval"), "run", "--model_args", model_args_text, "--include_path", str(TASKS),
               "--output_path", str(output), "--log_samples", *args]
    run_client(command, workdir, f"lm-eval-{label}.log", TIMEOUT_S, cwd=TASKS)
    results = json.loads(next(output.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in results:
        path = next(output.rglob(f"samples_{task}_*.jsonl"))
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return LMEvalRun(results, samples)


def through_server(
    venv: Path, workdir: Path, server: ServeProcess, model_dir: str, label: str, tasks: str, *args: str
) -> LMEvalRun:
    """lm-eval's `local-completions` against the server, otherwise at its defaults."""
    model_args = {"model": "smollm2", "base_url": server.url + "/v1/completions", "tokenizer": model_dir}
    return lm_eval(venv, workdir, label, model_args, "--model", "local-completions", "--tasks", tasks, *args)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lm-eval")


@pytest.fixture(scope="module")
def hf_reference(lmeval_venv: Path, workdir: Path, model_dir: str) -> LMEvalRun:
    """lm-eval's own transformers backend on the model directory the server loads, in the server's float32."""
    model_args = {"pretrained": model_dir, "dtype": "float32"}
    tasks = f"{MULTIPLE_CHOICE},{PERPLEXITY}"
    return lm_eval(lmeval_venv, workdir, "hf", model_args, "--model", "hf", "--tasks", tasks, "--batch_size", "1")


@pytest.fixture(scope="module")
def plain(lmeval_venv: Path, workdir: Path, server: ServeProcess, model_dir: str) -> LMEvalRun:
    """The three tasks through the server in one run, everything at lm-eval's defaults (batch size 1)."""
    tasks = f"{GENERATION},{MULTIPLE_CHOICE},{PERPLEXITY}"
    return through_server(lmeval_venv, workdir, server, model_dir, "plain", tasks)


def test_generation_through_the_server_answers_every_document(plain: LMEvalRun) -> None:
    num_docs = len((TASKS / "generation.jsonl").read_text().splitlines())
    answers = plain.answers(GENERATION)
    assert len(answers) == num_docs, f"lm-eval scored {len(answers)} of {num_docs} documents"
    # Greedy answers of a 135M model to questions such as the capital of France: some must be right.
    assert plain.results[GENERATION]["exact_match,strip"] > 0, answers


def test_generation_with_batch_size_2_equals_batch_size_1(
    lmeval_venv: Path, workdir: Path, server: ServeProcess, model_dir: str, plain: LMEvalRun
) -> None:
    """Two token-id prompts per request (a list of lists) give the answers one prompt a request gives."""
    batched = through_server(lmeval_venv, workdir, server, model_dir, "generation-batch2", GENERATION,
                             "--batch_size", "2")
    assert batched.answers(GENERATION) == plain.answers(GENERATION)
    assert batched.results[GENERATION] == plain.results[GENERATION]


def test_lossless_generation_equals_plain(
    lmeval_venv: Path, workdir: Path, server: ServeProcess, model_dir: str, plain: LMEvalRun
) -> None:
    lossless_before = server.metric("kvlab:spec_decode_num_drafts_total")
    # A fixed draft length: under `auto` a sequence may stand aside (draft nothing) on a loaded machine.
    lossless = through_server(lmeval_venv, workdir, server, model_dir, "generation-lossless", GENERATION,
                              "--gen_kwargs", json.dumps({"kvlab": {"mode": "lossless", "draft_length": 4}}))
    assert server.metric("kvlab:spec_decode_num_drafts_total") > lossless_before, "no request was decoded lossless"
    for doc, (want, got) in enumerate(
        zip(plain.answers(GENERATION), lossless.answers(GENERATION), strict=True)
    ):
        assert got == want, f"document {doc}: lossless {got!r} != plain {want!r}"
    assert lossless.results[GENERATION] == plain.results[GENERATION]


def loglikelihoods(run: LMEvalRun, task: str) -> list[list[tuple[float, str]]]:
    """Per document, per request: (loglikelihood, is_greedy or "" for a rolling one), logged as strings:
    a multiple-choice request as [["-11.2", "False"]], a rolling one as ["-147.9"]."""
    entries = [[resp[0] if isinstance(resp[0], list) else resp for resp in s["resps"]] for s in run.samples[task]]
    return [[(float(entry[0]), "".join(entry[1:])) for entry in doc] for doc in entries]


def test_multiple_choice_accuracy_equals_hf_backend(plain: LMEvalRun, hf_reference: LMEvalRun) -> None:
    """Each choice's loglikelihood and greedy flag (the server's echoed prompt logprobs and top logprobs)
    match the hf backend's; so does each document's accuracy, and the aggregates exactly."""
    want_docs, got_docs = loglikelihoods(hf_reference, MULTIPLE_CHOICE), loglikelihoods(plain, MULTIPLE_CHOICE)
    for doc, (want, got) in enumerate(zip(want_docs, got_docs, strict=True)):
        for choice, ((want_ll, want_greedy), (got_ll, got_greedy)) in enumerate(zip(want, got, strict=True)):
            where = f"document {doc} choice {choice}"
            assert math.isclose(got_ll, want_ll, abs_tol=LOGLIKELIHOOD_ATOL), f"{where}: {got_ll} vs hf {want_ll}"
            assert got_greedy == want_greedy, f"{where}: is_greedy {got_greedy} vs hf {want_greedy}"
    for want, got in zip(hf_reference.samples[MULTIPLE_CHOICE], plain.samples[MULTIPLE_CHOICE], strict=True):
        assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"]), f"document {got['doc_id']}"
    for metric in ("acc,none", "acc_norm,none"):
        assert plain.results[MULTIPLE_CHOICE][metric] == hf_reference.results[MULTIPLE_CHOICE][metric]


def test_perplexity_equals_hf_backend(plain: LMEvalRun, hf_reference: LMEvalRun) -> None:
    docs = zip(loglikelihoods(hf_reference, PERPLEXITY), loglikelihoods(plain, PERPLEXITY), strict=True)
    for doc, (want, got) in enumerate(docs):
        assert math.isclose(got[0][0], want[0][0], rel_tol=PERPLEXITY_RTOL), f"document {doc}: {got} vs hf {want}"
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        got_value = plain.results[PERPLEXITY][metric]
        want_value = hf_reference.results[PERPLEXITY][metric]
        assert math.isclose(got_value, want_value, rel_tol=PERPLEXITY_RTOL), (
            f"{metric}: {got_value} through the server, {want_value} in the hf backend"
        )
