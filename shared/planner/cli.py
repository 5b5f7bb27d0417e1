"""The command line: python -m shared.planner (make plan)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable

from shared.config import ConfigError
from shared.planner.activations import ATTENTION, RECOMPUTE
from shared.planner.hardware import GPUS, LINKS, PRECISIONS
from shared.planner.memory import Settings, tp_candidates
from shared.planner.recommend import Search
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
        "the strategy to use, with the micro-batch and recomputation it chose.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="gpt2-tiny gpt2 gpt2-medium gpt2-large gpt2-xl "
                     "llama-tiny llama-500m llama-7b llama-13b llama-70b")  # fmt: skip
    src.add_argument("--config", help="a transformers config.json (GPT-2 or Llama-style)")
    src.add_argument("--params", type=float,
                     help="parameter count; alone it gives the model states, with --layers "
                          "--hidden --heads --vocab the activations too")  # fmt: skip
    p.add_argument("--layers", type=int, default=0, help="--params: transformer layers")
    p.add_argument("--hidden", type=int, default=0, help="--params: hidden size")
    p.add_argument("--heads", type=int, default=0, help="--params: attention heads")
    p.add_argument("--kv-heads", type=int, default=0, help="--params: KV heads (default heads)")
    p.add_argument("--ffn", type=int, default=0, help="--params: MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (presets: the tokenizer's)")
    p.add_argument("--gpus", type=int, help="GPUs in total (default 8, printed)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="default min(gpus, 8), printed")  # fmt: skip
    p.add_argument("--gpu", choices=sorted(GPUS),
                   help="GPU model: memory, native bf16, intra-node link")  # fmt: skip
    p.add_argument(
        "--link",
        choices=LINKS,
        help="intra-node link, for TP's advice (default: --gpu's; nvlink, printed)",
    )
    p.add_argument("--gpu-mem", help="memory per GPU with a unit: 16GiB, 80GB (overrides --gpu)")
    p.add_argument(
        "--headroom",
        default="10%",
        help="kept free for the CUDA context and fragmentation: 10%% (default), 0.1 or 2GiB",
    )
    p.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per rank per step (default: searched, 8 down to 1)")  # fmt: skip
    p.add_argument("--global-batch", type=int, default=0,
                   help="sequences per optimizer step (default: not constrained)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=0, help="default: the model's context")
    p.add_argument("--precision", choices=sorted(PRECISIONS),
                   help="default: bf16 where the GPU has it natively, else fp16")  # fmt: skip
    p.add_argument("--recompute", choices=RECOMPUTE,
                   help="activation recomputation (default: searched, none first)")  # fmt: skip
    p.add_argument("--attention", choices=ATTENTION, default="sdpa",
                   help="sdpa (fused, what the templates use; default) or eager (stores the "
                        "score matrix)")  # fmt: skip
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel size (default: the largest that fits a node)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    if args.preset:
        return from_preset(args.preset, args.vocab, args.seq_len)
    if args.config:
        return from_hf_config(args.config, args.vocab, args.seq_len)
    if args.params < 1:
        raise ConfigError(f"--params must be >= 1 (got {args.params:g}).")
    shape = [args.layers, args.hidden, args.heads, args.vocab]
    if any(shape) and not all(shape):
        missing = [f for f, v in zip(("--layers", "--hidden", "--heads", "--vocab"), shape,
                                     strict=True) if not v]  # fmt: skip
        raise ConfigError(
            f"--params with shape flags needs {', '.join(missing)} too (or none of them, for "
            "the model states alone)."
        )
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


def settings_from_args(args: argparse.Namespace, model: ModelSpec) -> tuple[Settings, list[str]]:
    """The settings, and a line for each one the user did not give (printed as 'assumed')."""
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1 (got {args.gpus}).")
    for name in ("micro_batch", "global_batch"):
        if getattr(args, name) < 0:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})."
            )
    if args.seq_len < 0 or args.gpus_per_node < 0 or args.tp < 0:
        raise ConfigError("--seq-len, --gpus-per-node and --tp must be >= 1 when given.")
    notes = []
    gpus = args.gpus or 8
    if args.gpus is None:
        notes.append("8 GPUs (--gpus to change)")
    per_node = args.gpus_per_node or min(gpus, 8)
    if gpus > per_node and gpus % per_node:
        raise ConfigError(f"--gpus ({gpus}) must be a multiple of --gpus-per-node ({per_node}).")
    per_node = min(per_node, gpus)
    if not args.gpus_per_node and gpus > 1:
        notes.append(f"{per_node} GPUs per node (--gpus-per-node to change)")
    gpu = GPUS.get(args.gpu or "")
    gpu_mem = parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else 0
    if args.gpu_mem and gpu_mem <= 0:
        raise ConfigError(f"--gpu-mem must be > 0 (got '{args.gpu_mem}').")
    gpu_mem = gpu_mem or (gpu.memory if gpu else 0)
    if not gpu_mem and model.has_shape:
        raise ConfigError("give the GPU: --gpu (t4, l4, a10g, a100-40g, a100-80g, h100, h200) "
                          "or --gpu-mem with a unit (16GiB).")  # fmt: skip
    precision = args.precision
    if gpu and precision == "bf16" and not gpu.bf16:
        raise ConfigError(
            f"the {gpu.name} has no native bf16 (it is emulated, slowly): use --precision fp16 "
            "or fp32."
        )
    if not precision:
        precision = "bf16" if gpu is None or gpu.bf16 else "fp16"
        notes.append(
            f"precision {precision} ("
            + (f"the {gpu.name} {'has' if gpu.bf16 else 'lacks'} native bf16" if gpu
               else "no --gpu given")
            + "; --precision to change)"
        )  # fmt: skip
    if model.has_shape and not args.seq_len:
        notes.append(f"{model.default_seq_len} tokens per sequence, the model's context "
                     "(--seq-len to change)")  # fmt: skip
    if args.attention == "sdpa" and model.has_shape:
        notes.append("fused attention (SDPA/flash: no score matrix stored; --attention eager "
                     "if the model materializes it)")  # fmt: skip
    link = args.link or (gpu.link if gpu else "nvlink")
    if not args.link and not gpu and per_node > 1 and model.has_shape:
        notes.append("NVLink between a node's GPUs, for TP (no --gpu given; --link pcie to change)")
    settings = Settings(
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_mem=gpu_mem,
        headroom=parse_headroom(args.headroom, gpu_mem) if gpu_mem else 0,
        micro_batch=args.micro_batch or 1,
        seq_len=args.seq_len or model.default_seq_len,
        precision=PRECISIONS[precision],
        recompute=args.recompute or "none",
        tp=resolve_tp(args.tp, model, gpus, per_node) if model.has_shape else 1,
        attention=args.attention,
        link=link,
    )
    return settings, notes


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
        settings, notes = settings_from_args(args, model)
        search = Search(args.micro_batch or None, args.recompute, args.global_batch or None)
        gpu = GPUS[args.gpu].describe() if args.gpu and not args.gpu_mem else ""
        plan = make_plan(model, settings, search, gpu, notes)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out(json.dumps(to_json(plan), indent=2) if args.json else render_table(plan))
    return 0
