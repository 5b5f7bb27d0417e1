"""The decision framework: which strategy to use, and advice beyond the table."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from shared.planner.activations import RECOMPUTE, activation_bytes
from shared.planner.memory import Estimate, Settings, estimate_all
from shared.planner.specs import ModelSpec
from shared.planner.units import format_size


@dataclass
class Recommendation:
    key: str  # the strategy key, or "none"
    reason: str
    advice: list[str] = field(default_factory=list)  # PP / CP / EP and other hints
    # Settings the recommendation needs that differ from the ones asked about.
    changes: dict[str, object] = field(default_factory=dict)


def choose(model: ModelSpec, settings: Settings, rows: list[Estimate]) -> tuple[str, str] | None:
    """The seed's framework, in order: everything fits -> DDP; the model states are what
    overflow -> ZeRO-1, ZeRO-2, FSDP2 (least communication first); a layer too wide for data
    parallelism (its activations or gathered parameters) -> TP + SP, then TP x FSDP; only
    offload fits -> ZeRO-3 + CPU offload. None when nothing fits."""
    budget = settings.budget
    by_key = {r.key: r for r in rows}
    fits = {r.key: r.fits(budget) for r in rows}
    ddp = by_key["ddp"].columns
    states = ddp["params"] + ddp["grads"] + ddp["optimizer"]
    if fits["ddp"]:
        return "ddp", (
            f"everything fits on one GPU ({format_size(ddp['total'])} of "
            f"{format_size(budget)}): replicate the model; DDP's one gradient all-reduce per "
            "step overlaps with the backward and nothing is gathered."
        )
    if ddp["activations"] + ddp["buffers"] < budget:
        for key, why in (
            ("zero1", "sharding the optimizer states alone is enough, and ZeRO-1 moves as many "
                      "bytes as DDP (reduce-scatter + all-gather = all-reduce)"),
            ("zero2", "sharding optimizer states and gradients is enough, and ZeRO-2 still "
                      "moves as many bytes as DDP"),
            ("fsdp2", "the parameters must be sharded too: FSDP2 (ZeRO-3) gathers each block "
                      "before use, 1.5x DDP's communication"),
        ):  # fmt: skip
            if fits[key]:
                biggest = max(("optimizer", "grads", "params"), key=lambda k: ddp[k])
                return key, (
                    f"optimizer/gradient-bound: DDP needs {format_size(ddp['total'])} per GPU, "
                    f"{format_size(states)} of it model states ({biggest} the largest), over "
                    f"the {format_size(budget)} budget; {why}."
                )
    for key, why in (
        ("tp_sp", "tensor parallelism splits every layer's matrices and, with sequence "
                  "parallelism, its activations over the TP group (keep it inside a node)"),
        ("tp_fsdp", "TP inside a node splits each layer, FSDP over the TP groups shards the "
                    "remaining model states (jobs/tp2d)"),
    ):  # fmt: skip
        if fits[key]:
            fsdp = by_key["fsdp2"].columns
            return key, (
                f"a layer is too wide for data parallelism alone: even FSDP2 needs "
                f"{format_size(fsdp['total'])} per GPU ({format_size(fsdp['activations'])} of "
                f"activations, {format_size(fsdp['buffers'])} of gathered parameters); {why}."
            )
    if fits["zero3_offload"]:
        row = by_key["zero3_offload"]
        return "zero3_offload", (
            f"only CPU offload fits: the GPUs keep activations and gathered blocks "
            f"({format_size(row.columns['total'])}) while "
            f"{format_size(row.cpu_bytes * settings.gpus_per_node)} of model states per node "
            "live in CPU RAM and the optimizer step runs on the CPU: expect it to be slow."
        )
    return None


def relaxations(settings: Settings) -> list[Settings]:
    """The settings as given, then with more recomputation, then with halved micro-batches.

    Recomputation first: selective costs a few percent (Korthikanti et al. report 2.7% for
    GPT-3), full one extra forward; a smaller micro-batch makes every matmul less efficient
    and needs gradient accumulation to keep the global batch."""
    levels = RECOMPUTE[RECOMPUTE.index(settings.recompute) :]
    batches, b = [], settings.micro_batch
    while b >= 1:
        batches.append(b)
        b //= 2
    return [dataclasses.replace(settings, recompute=r, micro_batch=b)
            for b in batches for r in levels]  # fmt: skip


def recommend(model: ModelSpec, settings: Settings, rows: list[Estimate]) -> Recommendation:
    """Apply the framework to the settings as given; if nothing fits, to the first relaxation
    that fits (saying which flags change); then add the advised-only parts (PP, CP, EP)."""
    advice = general_advice(model, settings, rows)
    for relaxed in relaxations(settings):
        relaxed_rows = rows if relaxed == settings else estimate_all(model, relaxed)
        choice = choose(model, relaxed, relaxed_rows)
        if choice is None:
            continue
        key, reason = choice
        changes = {k: getattr(relaxed, k) for k in ("recompute", "micro_batch")
                   if getattr(relaxed, k) != getattr(settings, k)}  # fmt: skip
        if changes:
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in changes.items())
            reason = (
                f"nothing fits as asked; with {flags}"
                + (" (accumulate gradients to keep the global batch)" if "micro_batch" in changes
                   else "")
                + f": {reason}"
            )  # fmt: skip
        return Recommendation(key, reason, advice, changes)
    most_relaxed = relaxations(settings)[-1]
    advice = [*deep_model_advice(model, most_relaxed), *advice]
    return Recommendation("none", (
        f"no strategy fits {settings.gpus} x {format_size(settings.gpu_mem)}, not even with "
        "full recomputation and micro-batch 1; see the advice."), advice)  # fmt: skip


def deep_model_advice(model: ModelSpec, settings: Settings) -> list[str]:
    """When nothing fits: how many GPUs FSDP2 would need, and pipeline parallelism."""
    fsdp = next(r for r in estimate_all(model, settings) if r.key == "fsdp2")
    cols = fsdp.columns
    fixed = cols["activations"] + cols["buffers"]  # what sharding over more GPUs cannot shrink
    sharded = (cols["params"] + cols["grads"] + cols["optimizer"]) * settings.gpus
    advice = []
    if fixed < settings.budget:
        gpus = math.ceil(sharded / (settings.budget - fixed))
        advice.append(
            f"FSDP2 with full recomputation and micro-batch 1 needs about {gpus} GPUs of this "
            "size (the model states shard, the activations and gathered blocks do not)."
        )
    per_layer = cols["total"] / model.layers
    if per_layer < settings.budget:
        stages = min(max(2, math.ceil(cols["total"] / settings.budget)), model.layers)
        advice.append(
            f"too deep: pipeline parallelism (PP) in ~{stages} stages gives each GPU "
            f"{math.ceil(model.layers / stages)} of the {model.layers} layers with their states "
            "and activations (advised, not implemented in these templates)."
        )
    else:
        advice.append(
            f"one layer alone needs about {format_size(per_layer)}: split inside the layer "
            "(TP + SP, and context parallelism for long sequences) rather than across layers."
        )
    return advice


def general_advice(model: ModelSpec, settings: Settings, rows: list[Estimate]) -> list[str]:
    """Hints beyond the table: what recomputation would save, context parallelism for very
    long sequences and expert parallelism for MoE (the last two advised, not implemented)."""
    advice = []
    s, h, a, b = settings.seq_len, model.hidden, model.heads, settings.micro_batch
    scores = 5 * a * s / h  # Korthikanti et al.: the attention-score share of a layer
    if settings.recompute == "none":
        stored = next(r for r in rows if r.key == "ddp").activations
        selective = activation_bytes(model, s, b, settings.precision, "selective")
        if stored > 1.5 * selective:
            advice.append(
                f"attention scores dominate the activations (5as/h = {scores:.0f} against 34 "
                f"for the rest of a layer): selective recomputation or flash attention cuts "
                f"the data-parallel activations from {format_size(stored)} to "
                f"{format_size(selective)} per GPU."
            )
    # The most the templates do for one sequence: TP + SP over a whole node, full recompute.
    node = max(settings.gpus_per_node, 1)
    one_sequence = activation_bytes(model, s, 1, settings.precision, "full", t=node, sp=True)
    if s >= 32768 or one_sequence > settings.budget / 2:
        advice.append(
            f"very long sequences ({s} tokens): context parallelism (ring attention; advised, "
            "not implemented) splits each sequence over GPUs beyond the TP group; one sequence "
            f"needs {format_size(one_sequence)} of activations per GPU even with TP + SP over "
            f"{node} GPUs and full recomputation."
        )
    if model.experts > 1:
        advice.append(
            f"MoE: {model.experts} experts per layer; expert parallelism (EP) places different "
            "experts on different GPUs and all-to-alls the tokens (advised, not implemented)."
        )
    return advice
