"""The plan (model + settings -> rows + recommendation) as a table or JSON."""

from __future__ import annotations

from dataclasses import dataclass

from shared.planner.memory import Estimate, Settings, estimate_all
from shared.planner.recommend import Recommendation, recommend
from shared.planner.specs import ModelSpec
from shared.planner.units import format_size


@dataclass
class Plan:
    model: ModelSpec
    settings: Settings
    rows: list[Estimate]
    recommendation: Recommendation


def make_plan(model: ModelSpec, settings: Settings) -> Plan:
    rows = estimate_all(model, settings)
    return Plan(model, settings, rows, recommend(model, settings, rows))


def plan_header(plan: Plan) -> list[str]:
    st = plan.settings
    return [
        f"model: {plan.model.describe()}",
        f"GPUs: {st.gpus} ({st.gpus_per_node} per node) x {format_size(st.gpu_mem)}, budget "
        f"{format_size(st.budget)} after {format_size(st.headroom)} headroom",
        f"micro-batch {st.micro_batch} x {st.seq_len} tokens | {st.precision.describe()} | "
        f"recompute {st.recompute} | tp {st.tp}",
    ]


COLUMNS = ("params", "grads", "optimizer", "activations", "buffers", "total")


def render_table(plan: Plan) -> str:
    budget = plan.settings.budget
    header = ["strategy", "layout", *COLUMNS, "fits"]
    body = []
    for row in plan.rows:
        if not row.applicable:
            body.append([row.name, "n/a", *([""] * len(COLUMNS)), "n/a"])
            continue
        cols = row.columns
        verdict = "yes" if row.fits(budget) else "no"
        body.append([row.name, row.layout, *(format_size(cols[c]) for c in COLUMNS), verdict])
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header) - 1)]

    def line(cells: list[str]) -> str:
        left = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        right = [c.rjust(w) for c, w in zip(cells[2:-1], widths[2:], strict=True)]
        return "  ".join([*left, *right, cells[-1]]).rstrip()

    rec = plan.recommendation
    names = {r.key: r.name for r in plan.rows}
    out = [*plan_header(plan), "", line(header), *(line(r) for r in body), ""]
    for note in dict.fromkeys(r.note for r in plan.rows if not r.applicable):
        out.append(f"n/a: {note}")
    offload = next(r for r in plan.rows if r.key == "zero3_offload")
    out.append(
        f"ZeRO-3 + CPU offload keeps {format_size(offload.cpu_bytes)} per GPU "
        f"({format_size(offload.cpu_bytes * plan.settings.gpus_per_node)} per node) in CPU RAM."
    )
    out.append(f"recommended: {names.get(rec.key, 'nothing fits')} - {rec.reason}")
    out += [f"advice: {a}" for a in rec.advice]
    return "\n".join(out)


def to_json(plan: Plan) -> dict:
    st, model = plan.settings, plan.model
    return {
        "model": {
            "name": model.name, "params": model.n_params, "layers": model.layers,
            "hidden": model.hidden, "heads": model.heads, "kv_heads": model.kv_heads,
            "ffn": model.ffn, "vocab": model.vocab, "experts": model.experts,
        },
        "settings": {
            "gpus": st.gpus, "gpus_per_node": st.gpus_per_node, "gpu_mem_bytes": st.gpu_mem,
            "headroom_bytes": st.headroom, "budget_bytes": st.budget,
            "micro_batch": st.micro_batch, "seq_len": st.seq_len,
            "precision": st.precision.name, "recompute": st.recompute, "tp": st.tp,
        },
        "strategies": [
            {
                "key": r.key, "name": r.name, "layout": r.layout, "applicable": r.applicable,
                "bytes_per_gpu": r.columns if r.applicable else None,
                "model_state_bytes_per_rank": r.state, "cpu_offloaded_bytes": r.cpu_bytes,
                "fits": r.fits(st.budget), "note": r.note,
            }
            for r in plan.rows
        ],
        "recommendation": {
            "strategy": plan.recommendation.key, "reason": plan.recommendation.reason,
            "advice": plan.recommendation.advice, "changes": plan.recommendation.changes,
        },
    }  # fmt: skip
