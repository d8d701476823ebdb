"""The front doors (the server, the benchmark, the CLI, the integrations) decode through `kvlab.engine`'s
public names only: no engine submodule, no round, feed, prefill or packed forward of their own."""

from __future__ import annotations

import ast

from tests.unit.source_scan import ROOT, module_name, source_files

FRONT_DOORS = ("kvlab.serve", "kvlab.bench", "kvlab.cli", "kvlab.integrations")
# Decoding machinery below the engine: a front door that imports it decodes beside the engine.
DECODING_MODULES = (
    "kvlab.lossless.round", "kvlab.lossless.remote_prefix", "kvlab.lossless.acceptance", "kvlab.generation.feed",
    "kvlab.generation.reference", "kvlab.generation.prefill", "kvlab.cache.step",
)
DECODING_NAMES = {"kvlab.cache": {"run_packed", "run_step", "forward", "ForwardStep", "Segment", "PackedStep"}}
# (module, name): why it is not decoding beside the engine.
EXEMPT = {
    ("kvlab.bench.codec.harness", "forward"): "captures a prompt's KV for the codec benchmark; it decodes nothing",
    # Inside vLLM, vLLM's engine decodes and verifies; the proposer drafts through kvlab's engine runner and
    # drafters, and computes the last prompt tokens over KV handed over from vLLM's pages (docs/vllm.md).
    ("kvlab.integrations.vllm.adoption", "ForwardStep"): "a prompt's last tokens over KV handed over by vLLM",
    ("kvlab.integrations.vllm.adoption", "run_step"): "a prompt's last tokens over KV handed over by vLLM",
}


def front_door_imports() -> list[tuple[str, int, str, str]]:
    """`(module, line, imported module, name)` of every `from kvlab... import name` in the front doors."""
    found = []
    for path in source_files():
        module = module_name(path)
        if not module.startswith(FRONT_DOORS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvlab"):
                found += [(module, node.lineno, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(module, node.lineno, alias.name, "")
                          for alias in node.names if alias.name.startswith("kvlab")]
    return found


def offences(imports: list[tuple[str, int, str, str]]) -> list[str]:
    found = []
    for module, line, imported, name in imports:
        where = f"{(ROOT / module.replace('.', '/')).relative_to(ROOT.parent)}:{line}"
        if imported.startswith("kvlab.engine."):
            found.append(f"{where} imports {imported}: use the public names of kvlab.engine")
        elif imported.startswith(DECODING_MODULES) or f"{imported}.{name}".startswith(DECODING_MODULES):
            found.append(f"{where} imports {imported} {name}: decode through kvlab.engine")
        elif name in DECODING_NAMES.get(imported, ()) and (module, name) not in EXEMPT:
            found.append(f"{where} imports {imported}.{name}: decode through kvlab.engine")
    return found


def test_front_doors_decode_through_the_engines_public_names_only() -> None:
    found = offences(front_door_imports())
    assert not found, "\n".join(found)


def test_every_exemption_names_an_import_that_exists() -> None:
    present = {(module, name) for module, _, _, name in front_door_imports()}
    assert set(EXEMPT) <= present, sorted(set(EXEMPT) - present)


def test_the_check_sees_an_engine_submodule_a_round_and_a_packed_forward() -> None:
    found = offences([
        ("kvlab.serve.engine", 1, "kvlab.engine.engine", "Engine"),
        ("kvlab.bench.methods", 2, "kvlab.lossless.round", "lossless_rounds"),
        ("kvlab.cli.generate", 3, "kvlab.cache", "run_packed"),
        ("kvlab.cli.generate", 4, "kvlab.lossless", "round"),
        ("kvlab.cli.generate", 5, "kvlab.engine", "Engine"),
    ])
    assert [line.split(" imports")[0].rsplit(":", 1)[1] for line in found] == ["1", "2", "3", "4"]
