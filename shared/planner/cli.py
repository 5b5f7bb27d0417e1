"""The command line: python -m shared.planner (make plan)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable

from shared.config import ConfigError
from shared.planner.activations import RECOMPUTE
from shared.planner.hardware import PRECISIONS
from shared.planner.memory import Settings, tp_candidates
from shared.planner.render import make_plan, render_table, to_json
from shared.planner.specs import ModelSpec, from_counts, from_hf_config, from_preset
from shared.planner.units import format_size, parse_size


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the usage before its error; the project's contract is one line."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m shared.planner",
        description="Per-GPU memory of DDP, ZeRO-1/2/3, FSDP2, TP, TP+SP and TP x FSDP, and "
        "the strategy to use.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="gpt2-tiny gpt2 gpt2-medium gpt2-large gpt2-xl "
                     "llama-tiny llama-500m llama-7b llama-13b llama-70b")  # fmt: skip
    src.add_argument("--config", help="a transformers config.json (GPT-2 or Llama-style)")
    src.add_argument("--params", type=float, help="parameter count (with the shape flags)")
    p.add_argument("--layers", type=int, help="--params: transformer layers")
    p.add_argument("--hidden", type=int, help="--params: hidden size")
    p.add_argument("--heads", type=int, help="--params: attention heads")
    p.add_argument("--kv-heads", type=int, default=0, help="--params: KV heads (default heads)")
    p.add_argument("--ffn", type=int, default=0, help="--params: MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (presets: the tokenizer's)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in total (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="default min(gpus, 8)")
    p.add_argument("--gpu-mem", default="80GiB", help="memory per GPU: 16GiB, 80GB, bytes")
    p.add_argument(
        "--headroom",
        default="10%",
        help="kept free for the CUDA context and fragmentation: 10%%, 0.1 or 2GiB",
    )
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=0, help="default: the model's context")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel size (default: the largest that fits a node)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    if args.preset:
        return from_preset(args.preset, args.vocab, args.seq_len)
    if args.config:
        return from_hf_config(args.config, args.vocab, args.seq_len)
    missing = [f"--{n}" for n in ("layers", "hidden", "heads") if not getattr(args, n)]
    if missing or not args.vocab:
        raise ConfigError(
            f"--params needs {', '.join(missing + ([] if args.vocab else ['--vocab']))} "
            "for the activation estimate."
        )
    if args.params < 1:
        raise ConfigError(f"--params must be >= 1 (got {args.params:g}).")
    return from_counts(int(args.params), args.layers, args.hidden, args.heads, args.vocab,
                       args.ffn, args.kv_heads, args.seq_len)  # fmt: skip


def parse_headroom(text: str, gpu_mem: int) -> int:
    """A fraction ('10%', '0.1') of the GPU memory, or a size ('2GiB')."""
    text = text.strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        fraction = None
    if fraction is not None and fraction < 1:
        if fraction < 0:
            raise ConfigError(f"--headroom must be >= 0 (got '{text}').")
        return int(gpu_mem * fraction)
    headroom = parse_size(text, "--headroom")
    if headroom >= gpu_mem:
        raise ConfigError(
            f"--headroom ({format_size(headroom)}) must be less than --gpu-mem "
            f"({format_size(gpu_mem)})."
        )
    return headroom


def settings_from_args(args: argparse.Namespace, model: ModelSpec) -> Settings:
    for name in ("gpus", "micro_batch"):
        if getattr(args, name) < 1:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})."
            )
    if args.seq_len < 0 or args.gpus_per_node < 0 or args.tp < 0:
        raise ConfigError("--seq-len, --gpus-per-node and --tp must be >= 1 when given.")
    per_node = args.gpus_per_node or min(args.gpus, 8)
    if args.gpus > per_node and args.gpus % per_node:
        raise ConfigError(
            f"--gpus ({args.gpus}) must be a multiple of --gpus-per-node ({per_node})."
        )
    per_node = min(per_node, args.gpus)
    gpu_mem = parse_size(args.gpu_mem, "--gpu-mem")
    if gpu_mem <= 0:
        raise ConfigError(f"--gpu-mem must be > 0 (got '{args.gpu_mem}').")
    return Settings(
        gpus=args.gpus,
        gpus_per_node=per_node,
        gpu_mem=gpu_mem,
        headroom=parse_headroom(args.headroom, gpu_mem),
        micro_batch=args.micro_batch,
        seq_len=args.seq_len or model.default_seq_len,
        precision=PRECISIONS[args.precision],
        recompute=args.recompute,
        tp=resolve_tp(args.tp, model, args.gpus, per_node),
    )


def resolve_tp(tp: int, model: ModelSpec, gpus: int, gpus_per_node: int) -> int:
    """The requested TP size after the same checks jobs/tp2d makes, or the largest valid."""
    if not tp:
        candidates = tp_candidates(model, gpus, gpus_per_node)
        return max(candidates) if candidates else 1
    for what, size in (("attention heads", model.heads), ("KV heads", model.kv_heads)):
        if size % tp:
            raise ConfigError(f"--tp ({tp}) must divide the {size} {what} of {model.name}.")
    if gpus % tp:
        raise ConfigError(f"--gpus ({gpus}) must be divisible by --tp ({tp}).")
    if tp > gpus_per_node:
        raise ConfigError(
            f"--tp ({tp}) must not exceed --gpus-per-node ({gpus_per_node}): a TP group talks "
            "in every layer and has to stay inside one node."
        )
    return tp


def main(argv: Iterable[str] | None = None, out: Callable[[str], None] = print) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    try:
        model = model_from_args(args)
        plan = make_plan(model, settings_from_args(args, model))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out(json.dumps(to_json(plan), indent=2) if args.json else render_table(plan))
    return 0
