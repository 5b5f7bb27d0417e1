"""The plan (model + settings -> rows + recommendation) as a table or JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.planner.memory import Estimate, Settings, estimate_all
from shared.planner.recommend import (
    MICRO_BATCHES,
    Recommendation,
    Search,
    describe_choice,
    recommend,
    search_rows,
)
from shared.planner.specs import ModelSpec
from shared.planner.units import format_size


@dataclass
class Plan:
    model: ModelSpec
    settings: Settings
    rows: list[Estimate]
    recommendation: Recommendation | None  # None: model states only (no shape, or no GPU)
    search: Search = field(default_factory=Search)
    gpu: str = ""  # the --gpu preset's description, when one was given
    notes: list[str] = field(default_factory=list)  # where the unstated settings came from


def make_plan(model: ModelSpec, settings: Settings, search: Search | None = None,
              gpu: str = "", notes: list[str] | None = None) -> Plan:  # fmt: skip
    """Without a search, the settings as given (what the tests and bench compare with)."""
    if not model.has_shape or not settings.gpu_mem:
        return Plan(model, settings, estimate_all(model, settings), None, search or Search(),
                    gpu, notes or [])  # fmt: skip
    if search is None:
        search = Search(settings.micro_batch, settings.recompute)
    rows = search_rows(model, settings, search)
    return Plan(model, settings, rows, recommend(model, settings, rows, search), search, gpu,
                notes or [])  # fmt: skip


def plan_header(plan: Plan) -> list[str]:
    st, search = plan.settings, plan.search
    gpus = f"GPUs: {st.gpus} ({st.gpus_per_node} per node)"
    if st.gpu_mem:
        gpus += (
            f" x {plan.gpu or format_size(st.gpu_mem)}, budget {format_size(st.budget)} after "
            f"{format_size(st.headroom)} headroom"
        )
    lines = [f"model: {plan.model.describe()}", gpus, f"precision: {st.precision.describe()}"]
    if plan.model.has_shape:
        micro = (
            f"micro-batch {search.micro_batch}"
            if search.micro_batch
            else f"micro-batch searched ({', '.join(map(str, MICRO_BATCHES))}: largest that fits)"
        )
        recompute = (
            f"recompute {search.recompute}" if search.recompute
            else "recompute searched (none before full)"
        )  # fmt: skip
        batch = f" | global batch {search.global_batch}" if search.global_batch else ""
        lines.append(
            f"{micro} | {recompute} | {st.seq_len} tokens per sequence | attention "
            f"{st.attention} | tp {st.tp}{batch}"
        )
    return lines + [f"assumed: {n}" for n in plan.notes]


COLUMNS = ("params", "grads", "optimizer", "activations", "buffers", "total")
STATE_COLUMNS = ("params", "grads", "optimizer")


def render_table(plan: Plan) -> str:
    if plan.recommendation is None:
        return render_states(plan)
    budget = plan.settings.budget
    header = ["strategy", "layout", "micro-batch", "recompute", *COLUMNS, "fits"]
    body = []
    for row in plan.rows:
        if not row.applicable:
            body.append([row.name, "n/a", "", "", *([""] * len(COLUMNS)), "n/a"])
            continue
        cols = row.columns
        verdict = "yes" if row.fits(budget) else "no"
        body.append([row.name, row.layout, str(row.micro_batch), row.recompute,
                     *(format_size(cols[c]) for c in COLUMNS), verdict])  # fmt: skip
    out = [*plan_header(plan), "", *_align(header, body), ""]
    for note in dict.fromkeys(r.note for r in plan.rows if not r.applicable):
        out.append(f"n/a: {note}")
    offload = next(r for r in plan.rows if r.key == "zero3_offload")
    out.append(
        f"ZeRO-3 + CPU offload keeps {format_size(offload.cpu_bytes)} per GPU "
        f"({format_size(offload.cpu_bytes * plan.settings.gpus_per_node)} per node) in CPU RAM."
    )
    rec = plan.recommendation
    names = {r.key: r.name for r in plan.rows}
    if rec.key == "none":
        out.append(f"recommended: nothing fits - {rec.reason}")
    else:
        out.append(f"recommended: {names[rec.key]} with {describe_choice(rec)} - {rec.reason}")
    out += [f"advice: {a}" for a in rec.advice]
    return "\n".join(out)


def render_states(plan: Plan) -> str:
    """Model states only: the parameter count (or no GPU size) is all that was given."""
    st = plan.settings
    header = ["strategy", "layout", *STATE_COLUMNS, "model states"]
    if st.gpu_mem:
        header.append("states fit")
    body = []
    for row in plan.rows:
        if not row.applicable:
            continue
        cols = row.columns
        states = sum(cols[c] for c in STATE_COLUMNS)
        # Decimal GB too: the ZeRO paper's unit (7.5B on 64 GPUs: 120 / 31.4 / 16.6 / 1.88 GB).
        cells = [row.name, row.layout, *(format_size(cols[c]) for c in STATE_COLUMNS),
                 f"{format_size(states)} ({states / 1e9:.3g} GB)"]  # fmt: skip
        if st.gpu_mem:
            cells.append("yes" if states <= st.budget else "no")
        body.append(cells)
    missing = plan.model.missing_shape()
    why = (
        f"activations need {', '.join(missing)}" if missing
        else "a verdict and a recommendation need --gpu or --gpu-mem"
    )  # fmt: skip
    return "\n".join(
        [*plan_header(plan), "", *_align(header, body), "",
         f"model states only (parameters, gradients, optimizer states per GPU); {why}."]
    )  # fmt: skip


def _align(header: list[str], body: list[list[str]]) -> list[str]:
    """Name and layout left-aligned, numbers right-aligned, the verdict last."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = []
    for cells in [header, *body]:
        left = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        right = [c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
        lines.append("  ".join([*left, *right]).rstrip())
    return lines


def to_json(plan: Plan) -> dict:
    st, model, rec = plan.settings, plan.model, plan.recommendation
    states_only = rec is None
    return {
        "model": {
            "name": model.name, "params": model.n_params, "layers": model.layers,
            "hidden": model.hidden, "heads": model.heads, "kv_heads": model.kv_heads,
            "ffn": model.ffn, "vocab": model.vocab, "experts": model.experts,
        },
        "settings": {
            "gpus": st.gpus, "gpus_per_node": st.gpus_per_node,
            "gpu_mem_bytes": st.gpu_mem or None, "headroom_bytes": st.headroom,
            "budget_bytes": st.budget if st.gpu_mem else None,
            "micro_batch": plan.search.micro_batch, "recompute": plan.search.recompute,
            "global_batch": plan.search.global_batch, "seq_len": st.seq_len,
            "precision": st.precision.name, "attention": st.attention, "tp": st.tp,
            "intra_node_link": st.link, "assumed": plan.notes,
        },
        "strategies": [
            {
                "key": r.key, "name": r.name, "layout": r.layout, "applicable": r.applicable,
                "micro_batch": None if states_only else r.micro_batch,
                "recompute": None if states_only else r.recompute,
                "bytes_per_gpu": r.columns if r.applicable and not states_only else None,
                "model_state_bytes_per_rank": r.state,
                "model_state_bytes_per_gpu": sum(r.columns[c] for c in STATE_COLUMNS),
                "cpu_offloaded_bytes": r.cpu_bytes,
                "fits": None if states_only else r.fits(st.budget), "note": r.note,
            }
            for r in plan.rows
        ],
        "recommendation": None if states_only else {
            "strategy": rec.key, "reason": rec.reason, "advice": rec.advice,
            "settings": rec.chosen,
        },
        "activations": None if not states_only else (
            f"need {', '.join(model.missing_shape())}" if model.missing_shape()
            else "computed, but a verdict needs --gpu or --gpu-mem"),
    }  # fmt: skip
