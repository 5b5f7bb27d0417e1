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
    # The settings the recommendation runs at: micro_batch, recompute, tp, grad_accum.
    chosen: dict[str, object] = field(default_factory=dict)


DATA_PARALLEL = ("ddp", "zero1", "zero2", "fsdp2", "zero3")  # preferred in this order
TENSOR_PARALLEL = ("tp_sp", "tp_fsdp")
MICRO_BATCHES = (8, 4, 2, 1)  # searched largest first when --micro-batch is not given


@dataclass
class Search:
    """What the search may change: None = searched, a value = fixed by the user."""

    micro_batch: int | None = None
    recompute: str | None = None
    global_batch: int | None = None  # sequences per optimizer step, when the user fixes it


def data_parallel_degree(key: str, settings: Settings) -> int:
    return settings.gpus // settings.tp if key in ("tp", *TENSOR_PARALLEL) else settings.gpus


def candidates(settings: Settings, search: Search, dp: int) -> list[Settings]:
    """The settings one strategy is tried at, most efficient first: no recomputation before
    selective before full (recomputing costs up to one extra forward; a smaller micro-batch
    costs little once a micro-batch holds a few thousand tokens), and within each, the largest
    micro-batch. Selective recomputation only helps eager attention (it drops the scores that
    SDPA never stores). With a global batch, each micro-batch must divide its per-rank share."""
    if search.recompute:
        levels = [search.recompute]
    else:
        levels = list(RECOMPUTE if settings.attention == "eager" else ("none", "full"))
    batches = [search.micro_batch] if search.micro_batch else list(MICRO_BATCHES)
    if search.global_batch:
        per_rank = search.global_batch // dp if search.global_batch % dp == 0 else 0
        batches = [m for m in batches if per_rank and per_rank % m == 0]
    return [dataclasses.replace(settings, recompute=r, micro_batch=m)
            for r in levels for m in batches]  # fmt: skip


def search_rows(model: ModelSpec, settings: Settings, search: Search) -> list[Estimate]:
    """Each strategy at the first candidate settings where it fits (or, if none does, at the
    most memory-frugal one, marked as not fitting)."""
    cache: dict[tuple, dict[str, Estimate]] = {}

    def rows_at(st: Settings) -> dict[str, Estimate]:
        key = (st.micro_batch, st.recompute)
        if key not in cache:
            cache[key] = {r.key: r for r in estimate_all(model, st)}
        return cache[key]

    chosen = []
    for base in estimate_all(model, settings):
        if not base.applicable:
            chosen.append(base)
            continue
        dp = data_parallel_degree(base.key, settings)
        options = candidates(settings, search, dp)
        if not options:
            base.applicable = False
            base.note = (
                f"a global batch of {search.global_batch} sequences does not split evenly over "
                f"dp={dp} ranks."
            )
            chosen.append(base)
            continue
        rows = [rows_at(st)[base.key] for st in options]
        fitting = [r for r in rows if r.fits(settings.budget)]
        chosen.append(fitting[0] if fitting else min(rows, key=lambda r: r.columns["total"]))
    return chosen


def choose(model: ModelSpec, settings: Settings, rows: list[Estimate],
           search: Search) -> tuple[str, str] | None:  # fmt: skip
    """The framework, in order: DDP; the model states overflow -> ZeRO-1, ZeRO-2 (as much
    communication as DDP), FSDP2, ZeRO-3 (1.5x); each already at the least recomputation and
    largest micro-batch that fits. TP only when no data-parallel layout fits at micro-batch 1
    with full recomputation (a layer is too wide) or the data-parallel degree cannot share the
    global batch; then ZeRO-3 + CPU offload. None when nothing fits."""
    budget = settings.budget
    by_key = {r.key: r for r in rows}
    fits = {r.key: bool(r.fits(budget)) for r in rows}
    ddp = by_key["ddp"].columns
    states = ddp["params"] + ddp["grads"] + ddp["optimizer"]
    if fits["ddp"]:
        return "ddp", (
            f"the whole model fits on each GPU ({format_size(ddp['total'])} of "
            f"{format_size(budget)}): replicate it; DDP's one gradient all-reduce per step "
            "overlaps with the backward and nothing is gathered."
        )
    for key, why in (
        ("zero1", "sharding the optimizer states alone is enough, and ZeRO-1 moves as many "
                  "bytes as DDP (reduce-scatter + all-gather = all-reduce)"),
        ("zero2", "sharding optimizer states and gradients is enough, and ZeRO-2 still "
                  "moves as many bytes as DDP"),
        ("fsdp2", "the parameters must be sharded too: FSDP2 (ZeRO-3) gathers each block "
                  "before use, 1.5x DDP's communication"),
        ("zero3", "the parameters must be sharded too: ZeRO-3 gathers each block before use, "
                  "1.5x DDP's communication"),
    ):  # fmt: skip
        if fits[key]:
            biggest = max(("optimizer", "grads", "params"), key=lambda k: ddp[k])
            return key, (
                f"model-state-bound: DDP would hold {format_size(states)} of model states per "
                f"GPU ({biggest} the largest), over the {format_size(budget)} budget; {why}."
            )
    link = "over PCIe, slow for TP: " if settings.link == "pcie" else ""
    dp_blocked = [r for r in rows if r.key in DATA_PARALLEL and not r.applicable]
    for key, why in (
        ("tp_sp", "tensor parallelism splits every layer's matrices and, with sequence "
                  "parallelism, its activations over the TP group (keep it inside a node)"),
        ("tp_fsdp", "TP inside a node splits each layer, FSDP over the TP groups shards the "
                    "remaining model states (jobs/tp2d)"),
    ):  # fmt: skip
        if fits[key]:
            if dp_blocked:
                because = f"data parallelism alone cannot: {dp_blocked[0].note.rstrip('.')}"
            else:
                fsdp = by_key["fsdp2"]
                cols = fsdp.columns
                because = (
                    f"{too_wide(search)}: even FSDP2 {at_settings(fsdp, search)} needs "
                    f"{format_size(cols['total'])} per GPU ({format_size(cols['activations'])} "
                    f"of activations, {format_size(cols['buffers'])} of gathered parameters)"
                )
            return key, f"{because}; {link}{why}."
    if fits["zero3_offload"]:
        row = by_key["zero3_offload"]
        return "zero3_offload", (
            f"only CPU offload fits: the GPUs keep activations and gathered blocks "
            f"({format_size(row.columns['total'])}) while "
            f"{format_size(row.cpu_bytes * settings.gpus_per_node)} of model states per node "
            "live in CPU RAM and the optimizer step runs on the CPU: expect it to be slow."
        )
    return None


def too_wide(search: Search) -> str:
    """Why data parallelism alone does not fit: a layer, or the settings the user fixed."""
    if search.micro_batch is None and search.recompute is None:
        return "a layer is too wide for data parallelism alone"
    given = [flag for flag, value in (("--micro-batch", search.micro_batch),
                                      ("--recompute", search.recompute)) if value]  # fmt: skip
    return (
        f"data parallelism does not fit at the {' and '.join(given)} given (leave it out to search)"
    )


def at_settings(row: Estimate, search: Search) -> str:
    """'at micro-batch 8 (given) with full recomputation' for the row's settings."""
    batch = f"micro-batch {row.micro_batch}{' (given)' if search.micro_batch else ''}"
    recompute = "no recomputation" if row.recompute == "none" else f"{row.recompute} recomputation"
    return f"at {batch} with {recompute}{' (given)' if search.recompute else ''}"


def searched_extremes(search: Search) -> str:
    """What the search tried last, in words: only the settings the user left open."""
    if search.micro_batch is None and search.recompute is None:
        return "not even with full recomputation and micro-batch 1"
    if search.micro_batch is None:
        return f"not even at micro-batch 1 (recompute {search.recompute}, as given)"
    if search.recompute is None:
        return f"not even with full recomputation (micro-batch {search.micro_batch}, as given)"
    return (f"at the given micro-batch {search.micro_batch} and recompute {search.recompute} "
            "(leave --micro-batch and --recompute out to search them)")  # fmt: skip


def recommend(model: ModelSpec, settings: Settings, rows: list[Estimate],
              search: Search | None = None) -> Recommendation:  # fmt: skip
    """Apply the framework to the searched rows, say the settings it chose, then add the
    advised-only parts (PP, CP, EP)."""
    search = search or Search(settings.micro_batch, settings.recompute)
    advice = general_advice(model, settings, rows)
    choice = choose(model, settings, rows, search)
    if choice is None:
        frugal = dataclasses.replace(settings, micro_batch=1, recompute="full")
        return Recommendation("none", (
            f"no strategy fits {settings.gpus} x {format_size(settings.gpu_mem)}, "
            f"{searched_extremes(search)}; see the advice."),
            [*deep_model_advice(model, frugal), *advice])  # fmt: skip
    key, reason = choice
    row = next(r for r in rows if r.key == key)
    dp = data_parallel_degree(key, settings)
    chosen: dict[str, object] = {"micro_batch": row.micro_batch, "recompute": row.recompute}
    if key in ("tp", *TENSOR_PARALLEL):
        chosen["tp"] = settings.tp
    if search.global_batch:
        chosen["grad_accum"] = search.global_batch // (dp * row.micro_batch)
    return Recommendation(key, reason, advice, chosen)


def describe_choice(rec: Recommendation) -> str:
    """'micro-batch 4, recompute full, tp 4' for the recommendation line."""
    parts = [f"micro-batch {rec.chosen['micro_batch']}", f"recompute {rec.chosen['recompute']}"]
    if "tp" in rec.chosen:
        parts.append(f"tp {rec.chosen['tp']}")
    if "grad_accum" in rec.chosen:
        parts.append(f"gradient accumulation {rec.chosen['grad_accum']}")
    return ", ".join(parts)


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
    if settings.attention == "eager" and settings.recompute == "none":
        stored = next(r for r in rows if r.key == "ddp").activations
        selective = activation_bytes(
            model, s, b, settings.precision, "selective", attention="eager"
        )
        if stored > 1.5 * selective:
            advice.append(
                f"attention scores dominate the activations (5as/h = {scores:.0f} against 34 "
                f"for the rest of a layer): selective recomputation or fused attention "
                f"(--attention sdpa) cuts the data-parallel activations from "
                f"{format_size(stored)} to {format_size(selective)} per GPU."
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
