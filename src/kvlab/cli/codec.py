"""`kvlab codec`: benchmark codecs on real KV, and encode/decode KV saved as safetensors."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvlab.bench.codec import DEFAULT_CASES, bench_codecs, collect_kv
from kvlab.bench.codec.report import codec_table
from kvlab.cli.base import EXIT_OK, Command, add_json_flag, add_subcommand, print_json, read_prompt_file
from kvlab.cli.progress import TokenProgress
from kvlab.codec import DEFAULT_MAX_DECODED_BYTES, CodecError, ExpectedFrame, codecs, decode_frame
from kvlab.errors import ConfigError
from kvlab.models import DEFAULT_MODEL, load_model

FRAMES_FORMAT = "kvlab-codec-frames"


class CodecCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        verbs = parser.add_subparsers(dest="codec_verb", required=True, metavar="VERB")
        bench = add_subcommand(verbs, "bench", "ratio, speed and error of every codec on the model's KV")
        bench.add_argument(
            "--model", default=DEFAULT_MODEL, help="embedded alias, .gguf file, model dir or cached hub id"
        )
        bench.add_argument("--context", type=int, default=4096, help="tokens of the bundled document to prefill")
        bench.add_argument("--codecs", default="", help="comma-separated codec names to run (default: all rows)")
        bench.add_argument("--rate-fidelity", action="store_true",
                           help="every code-lossless coder x bit width, the entropy bound and task fidelity, "
                                "with a plot")
        bench.add_argument("--bits", default="8,4,3,2", help="code widths of --rate-fidelity")
        bench.add_argument("--samples-per-task", type=int, default=2,
                           help="prompts per task for --rate-fidelity's task columns (0: skip them)")
        bench.add_argument("--plot", type=Path, default=Path("codec_rate_fidelity.png"),
                           help="PNG written by --rate-fidelity")
        add_json_flag(bench)
        capture = add_subcommand(
            verbs, "capture", "prefill a prompt and save its KV (keys, values [layers, kv heads, tokens, dim], fp16)"
        )
        capture.add_argument("output", type=Path, help="safetensors file to write (input of `kvlab codec encode`)")
        capture.add_argument(
            "--model", default=DEFAULT_MODEL, help="embedded alias, .gguf file, model dir or cached hub id"
        )
        capture.add_argument(
            "--prompt-file", type=Path, help="UTF-8 text to prefill, - reads stdin (default: the bundled document)"
        )
        capture.add_argument(
            "--context", type=int, default=1024, help="tokens to prefill (fewer if the prompt is shorter)"
        )
        add_json_flag(capture)
        encode = add_subcommand(verbs, "encode", "encode every tensor of a safetensors file into codec frames")
        encode.add_argument("input", type=Path, help="safetensors file of float tensors (e.g. keys, values)")
        encode.add_argument("output", type=Path, help="safetensors file of frames to write")
        encode.add_argument("--codec", default="byteplane", help="codec name (see `kvlab ls`)")
        encode.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="codec parameter")
        add_json_flag(encode)
        decode = add_subcommand(verbs, "decode", "decode a file written by `kvlab codec encode`")
        decode.add_argument("input", type=Path, help="safetensors file of frames")
        decode.add_argument("output", type=Path, help="safetensors file of tensors to write")
        decode.add_argument(
            "--max-tensor-bytes", type=int, default=DEFAULT_MAX_DECODED_BYTES, metavar="BYTES",
            help="refuse frames that decode to more than this (checked before decoding; "
                 f"default {DEFAULT_MAX_DECODED_BYTES >> 20} MiB)",
        )
        add_json_flag(decode)

    def run(self, args: argparse.Namespace) -> int:
        if args.codec_verb == "bench":
            return _bench(args)
        if args.codec_verb == "capture":
            return _capture(args)
        if args.codec_verb == "encode":
            return _encode(args)
        return _decode(args)


def _bench(args: argparse.Namespace) -> int:
    if args.context < 1:
        raise ConfigError(f"--context must be at least 1, got {args.context}")
    if args.rate_fidelity:
        from kvlab.cli.codec_rate import rate_fidelity_command

        return rate_fidelity_command(args)
    selected = [name.strip() for name in args.codecs.split(",") if name.strip()]
    for name in selected:
        codecs.get(name)
    cases = [case for case in DEFAULT_CASES if not selected or case.codec in selected]
    loaded = load_model(args.model)
    if args.context > loaded.architecture.max_context:
        raise ConfigError(
            f"--context {args.context} exceeds {loaded.name}'s context of {loaded.architecture.max_context} tokens"
        )
    keys, values = collect_kv(loaded, args.context)
    with TokenProgress(total=len(cases), enabled=not args.json, unit="codec") as progress:
        results = bench_codecs(keys, values, cases, on_progress=lambda _: progress.update(1))
    if args.json:
        print_json({"model": loaded.name, "context": args.context, "kv_shape": list(keys.shape),
                    "results": [dataclasses.asdict(result) for result in results]})
        return EXIT_OK
    print(f"{loaded.name}: keys and values {list(keys.shape)} each, fp16, {2 * 2 * keys.numel() / 1e6:.1f} MB")
    print(codec_table(results))
    return EXIT_OK


def _capture(args: argparse.Namespace) -> int:
    if args.context < 1:
        raise ConfigError(f"--context must be at least 1, got {args.context}")
    _check_output(args.output)
    text = None if args.prompt_file is None else read_prompt_file(args.prompt_file)
    loaded = load_model(args.model)
    token_ids = None if text is None else list(loaded.tokenizer(text, add_special_tokens=True)["input_ids"])
    if token_ids is not None and not token_ids:
        raise ConfigError(f"{args.prompt_file} holds no text to prefill")
    num_tokens = args.context if token_ids is None else min(args.context, len(token_ids))
    if num_tokens > loaded.architecture.max_context:
        raise ConfigError(
            f"--context {num_tokens} exceeds {loaded.name}'s context of {loaded.architecture.max_context} tokens"
        )
    keys, values = collect_kv(loaded, num_tokens, token_ids)
    save_file({"keys": keys.contiguous(), "values": values.contiguous()}, str(args.output),
              metadata={"model": loaded.name, "tokens": str(keys.shape[2])})
    summary = {"output": str(args.output), "model": loaded.name, "shape": list(keys.shape), "dtype": "float16",
               "bytes": 2 * keys.numel() * keys.element_size()}
    if args.json:
        print_json(summary)
    else:
        print(f"wrote keys and values {tuple(keys.shape)} fp16 of {loaded.name} to {args.output}")
    return EXIT_OK


def _encode(args: argparse.Namespace) -> int:
    _check_output(args.output)
    tensors = _load(args.input)
    explicit = [assignment.partition("=")[0].strip() for assignment in args.set]
    has_kind = any(param.name == "kind" for param in codecs.parameters(args.codec))
    frames: dict[str, torch.Tensor] = {}
    report: list[dict[str, Any]] = []
    for name, tensor in tensors.items():
        assignments = list(args.set)
        if has_kind and "kind" not in explicit:
            assignments.append(f"kind={_kind_of(name)}")
        codec = codecs.create_from_strings(args.codec, assignments)
        if not tensor.is_floating_point():
            raise ConfigError(f"tensor {name!r} is {tensor.dtype}; the codecs encode float32, float16, bfloat16")
        data = codec.encode(tensor)
        frames[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        report.append({"tensor": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype), "codec": codec.name,
                       "lossless": codec.lossless, "bytes": len(data),
                       "bits_per_value": 8 * len(data) / max(tensor.numel(), 1),
                       "kv_bytes_ratio": 2 * tensor.numel() / max(len(data), 1)})
    save_file(frames, str(args.output), metadata={"format": FRAMES_FORMAT})
    _report(report, args.json)
    return EXIT_OK


def _check_output(path: Path) -> None:
    """Refuse an output path whose directory does not exist, before any work is done."""
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {path}: directory {path.parent} does not exist")


def _decode(args: argparse.Namespace) -> int:
    if args.max_tensor_bytes < 1:
        raise ConfigError(f"--max-tensor-bytes must be at least 1, got {args.max_tensor_bytes}")
    expected = ExpectedFrame(max_bytes=args.max_tensor_bytes)
    _check_output(args.output)
    frames = _load(args.input, expect_frames=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, frame in frames.items():
        if frame.dtype != torch.uint8 or frame.dim() != 1:
            raise ConfigError(f"{args.input}: tensor {name!r} is not a codec frame (uint8 vector)")
        try:
            tensors[name] = decode_frame(frame.numpy().tobytes(), expected)
        except CodecError as error:
            # Bad data is a runtime failure (exit 1), not a usage error.
            raise CodecError(f"{args.input}: tensor {name!r}: {error}") from None
    save_file(tensors, str(args.output))
    _report([{"tensor": name, "shape": list(t.shape), "dtype": str(t.dtype)} for name, t in tensors.items()], args.json)
    return EXIT_OK


def _load(path: Path, expect_frames: bool = False) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ConfigError(f"input file not found: {path}")
    try:
        tensors = load_file(str(path))
        if expect_frames:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            if metadata.get("format") != FRAMES_FORMAT:
                raise ConfigError(f"{path} was not written by `kvlab codec encode`")
    except (SafetensorError, OSError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{path} is not a readable safetensors file ({error})") from None
    if not tensors:
        raise ConfigError(f"{path} holds no tensors")
    return tensors


def _kind_of(name: str) -> str:
    lowered = name.lower()
    is_key, is_value = "key" in lowered, "value" in lowered
    if is_key == is_value:
        raise ConfigError(f"cannot tell whether tensor {name!r} holds keys or values; pass --set kind=keys|values")
    return "keys" if is_key else "values"


def _report(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print_json({"tensors": rows})
        return
    for row in rows:
        extra = f" -> {row['bytes']} bytes ({row['kv_bytes_ratio']:.2f}x vs fp16, {row['lossless']})" \
            if "bytes" in row else ""
        print(f"{row['tensor']}: {row['shape']} {row['dtype']}{extra}", file=sys.stdout)
