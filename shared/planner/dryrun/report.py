"""The dry run itself: the job's config, the planner's prediction and the traced bytes side
by side, and whether they fit the compute config's GPU."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from shared.config import ConfigError, build_config, split_overrides
from shared.models.structure import transformer_blocks
from shared.planner.activations import output_activation_bytes
from shared.planner.dryrun.jobs import JOBS, ComputeConfig, choose_compute, load_job, vocab_size
from shared.planner.dryrun.trace import (
    build_model,
    cfg_recompute,
    ddp_bucket_bytes,
    fake_world,
    traced_activations,
    traced_model_states,
    wrap,
)
from shared.planner.hardware import GPUS, PRECISIONS
from shared.planner.memory import Settings, estimate_all
from shared.planner.specs import from_preset
from shared.planner.units import format_size

HEADROOM = 0.10
ROWS = ("params", "grads", "optimizer", "activations", "buffers")


def deepspeed_estimate(cfg, n_params: int, largest_layer: int, compute: ComputeConfig) -> str:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU here; says so once, quietly
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    per_node = min(compute.gpus_per_node, cfg.num_workers)
    nodes = max(1, cfg.num_workers // per_node)
    if cfg.zero_stage == 3:
        _, gpu, _largest_layer_memory = estimate_zero3_model_states_mem_needs(
            n_params, largest_layer, per_node, nodes, cpu_offload=cfg.offload_optimizer,
            cpu_offload_params=cfg.offload_params,
        )  # fmt: skip
    else:
        _, gpu = estimate_zero2_model_states_mem_needs(
            n_params, per_node, nodes, cpu_offload=cfg.offload_optimizer
        )
    return format_size(gpu)


def dry_run(job: str, profile: str, overrides: list[str], out=print,
            compute_name: str | None = None) -> int:  # fmt: skip
    module, cls = load_job(job)
    cfg = build_config(cls, module.PROFILES, profile, split_overrides(overrides))
    compute, moved = choose_compute(job, getattr(cfg, "tp", 1), compute_name)
    gpu = GPUS[compute.gpu]
    world = cfg.num_workers
    bf16 = gpu.bf16 and cfg.dtype != "fp32"
    dtype = torch.bfloat16 if bf16 else torch.float32
    precision = PRECISIONS["bf16" if bf16 else "fp32"]
    vocab = vocab_size(cfg)
    spec = from_preset(cfg.model, vocab=vocab, seq_len=cfg.seq_len)
    tp = getattr(cfg, "tp", 1)
    key = JOBS[job][1] if job != "zero" else f"zero{cfg.zero_stage}"
    if key == "zero0":
        key = "ddp"
    per_node = min(compute.gpus_per_node, world)
    settings = Settings(
        gpus=world, gpus_per_node=per_node, gpu_mem=gpu.memory,
        headroom=int(gpu.memory * HEADROOM), micro_batch=cfg.micro_batch_size,
        seq_len=cfg.seq_len, precision=precision,
        recompute="full" if cfg_recompute(cfg) else "none", tp=tp, link=gpu.link,
    )  # fmt: skip
    planned = next(r for r in estimate_all(spec, settings) if r.key == key).columns
    if job in ("fsdp", "tp2d"):
        # FSDP2's MixedPrecisionPolicy keeps fp32 shards (4 + 4 + 8 bytes/param) and casts at
        # each all-gather: the same 16 bytes as the paper's 2 + 2 + 12, split as FSDP2 does.
        fp32 = dataclasses.replace(settings, precision=PRECISIONS["fp32"])
        states = next(r for r in estimate_all(spec, fp32) if r.key == key).columns
        planned = {**planned, **{k: states[k] for k in ("params", "grads", "optimizer")}}
        planned["total"] = sum(planned[k] for k in ROWS)
    out(f"dry run: jobs/{job} --profile {profile} {' '.join(overrides)}".rstrip())
    out(f"model: {spec.describe()}")
    layout = f"dp={cfg.dp} x tp={tp}" if job == "tp2d" else f"dp={world}"
    out(f"world: {world} ranks ({layout}) on a fake process group | micro-batch "
        f"{cfg.micro_batch_size} x {cfg.seq_len} tokens | {precision.name} | recompute "
        f"{settings.recompute}")  # fmt: skip
    if moved:
        out(moved)
    out(f"compute config ({compute.source}): {compute.nodes} x {compute.gpus_per_node} "
        f"{gpu.describe()}")  # fmt: skip
    if world > compute.gpus:
        out(f"note: {world} workers need {world} GPUs; the compute config has {compute.gpus} "
            "(raise max_nodes, or Ray waits for GPUs that never come).")  # fmt: skip
    traced: dict[str, int | None] = dict.fromkeys(ROWS)
    note = ""
    with fake_world(world):
        with torch.device("meta"):
            model = build_model(job, cfg, vocab)
        if job == "zero":
            largest = max(sum(p.numel() for p in b.parameters()) for b in transformer_blocks(model))
            note = (
                f"ZeRO-{cfg.zero_stage}: not traced (DeepSpeed needs real tensors); DeepSpeed's "
                f"estimate_zero{3 if cfg.zero_stage == 3 else 2}_model_states_mem_needs gives "
                f"{deepspeed_estimate(cfg, spec.n_params, largest, compute)} of model states "
                "per GPU (its own 18-byte rule), next to the planner's layout above."
            )
        else:
            model, tp_mesh = wrap(job, cfg, model, dtype)
            traced.update(traced_model_states(model, cfg))
            traced["buffers"] = ddp_bucket_bytes(model)
            acts = traced_activations(job, cfg, vocab, dtype, tp_mesh)
            output = output_activation_bytes(
                cfg.seq_len, cfg.micro_batch_size, spec.hidden, spec.vocab, t=tp, sp=tp > 1,
                scale=precision.activation / 2,
            )  # fmt: skip
            # Dropout masks (GPT-2 presets; 1 byte each on the GPU) are the planner's too.
            masks = 2 * cfg.seq_len * cfg.micro_batch_size * spec.hidden * spec.layers
            traced["activations"] = int(acts["layers"] + output + (masks if spec.dropout else 0))
    rows = []
    for name in ROWS:
        value = traced[name]
        shown = "(planner)" if value is None else format_size(value)
        rows.append((name, format_size(planned[name]), shown))
    total_traced = sum(planned[n] if traced[n] is None else traced[n] for n in ROWS)
    rows.append(("total", format_size(planned["total"]), format_size(total_traced)))
    out("")
    out("per rank (rank 0; FSDP pads shards so rank 0 holds the most)")
    widths = [max(len(r[i]) for r in [("", "planner", "traced"), *rows]) for i in range(3)]
    for r in [("", "planner", "traced"), *rows]:
        out(f"  {r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2].rjust(widths[2])}")
    if note:
        out(note)
    else:
        out("traced: parameters from each rank's shards, gradients and AdamW state from one step "
            "on meta tensors, activations from one real block (x layers) + the planner's output "
            "layer and dropout masks; buffers: "
            + ("DDP's gradient buckets." if traced["buffers"] is not None
               else "the planner's."))  # fmt: skip
    budget = settings.budget
    if total_traced > budget:
        print(
            f"error: {cfg.model} with {layout} does not fit the {gpu.name}: "
            f"{format_size(total_traced)} per GPU against a {format_size(budget)} budget "
            f"({format_size(gpu.memory)} less {HEADROOM:.0%} headroom).",
            file=sys.stderr,
        )
        return 1
    out(f"fits: {format_size(total_traced)} of the {gpu.name}'s {format_size(budget)} budget.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.planner.dryrun")
    parser.add_argument("--job", required=True)
    parser.add_argument("--profile", default="full")
    parser.add_argument("--compute", default=None,
                        help="a compute_configs/ name (default: the job.yaml's)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        return dry_run(args.job, args.profile, args.overrides, compute_name=args.compute)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
