"""``make bench``: every strategy on the same model, data and steps, on the local Ray cluster.

    make bench                                   # LOOPBACK_ONLY=1 on CI-like machines
    python benchmarks/bench.py --repeats 3 --steps 30 --only ddp,fsdp
    python benchmarks/bench.py --only ddp,torchrun --repeats 3 --json out.json  # Ray vs torchrun

Runs each job's ``main.py`` as a subprocess, exactly as a user does (``make run-local``), with
the smoke profile and a few overrides, and reads its ``SUMMARY`` line and ``metrics.jsonl``:

* DDP, FSDP2 and ZeRO-1/2/3 train gpt2-tiny on the generated news corpus (the shared
  ``GPT2_AG_NEWS`` smoke profile: 2 workers, 8 sequences x 64 tokens, 2 accumulation steps).
* TP x DP is jobs/tp2d, which trains llama-tiny (the TP plan is written for the Llama model):
  dp=2 x tp=2 on 4 workers with the global batch matched (32 sequences x 64 tokens per step),
  on the same corpus and the same 2 cores. A similar-sized but different model, so its row
  compares throughput per token, not identical arithmetic.
* The same DDP loop under plain torchrun (benchmarks/torchrun_ddp.py) gives the Ray Train vs
  torchrun step-time ratio and Ray's start-up overhead (time to first step).

Runs go repeat by repeat (every strategy once, then again), and a run that would overshoot
``--budget-s`` is skipped, so a slow machine still gets every strategy at least once. Step
times exclude each run's first step (warm-up). Numbers are reported, not asserted: it writes
docs/benchmarks.md and docs/benchmarks.png. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python benchmarks/bench.py` from anywhere

from shared.observability.plots import save_bar_chart  # noqa: E402
from shared.planner import format_size, from_preset, model_state_per_rank  # noqa: E402

SMOKE_VOCAB = 512  # shared.data.generate_news_corpus trains a 512-token tokenizer


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    job: str  # jobs/<job>/main.py, or "torchrun" for benchmarks/torchrun_ddp.py
    overrides: tuple[str, ...] = ()
    model: str = "gpt2-tiny"
    planner_key: str = ""  # shared.planner's strategy, for the predicted model-state bytes
    gpus: int = 2
    tp: int = 1


VARIANTS = (
    Variant("ddp", "DDP", "ddp", planner_key="ddp"),
    Variant("torchrun", "DDP (torchrun)", "torchrun", planner_key="ddp"),
    Variant("fsdp", "FSDP2", "fsdp", planner_key="fsdp2"),
    Variant("zero1", "ZeRO-1", "zero", ("zero_stage=1",), planner_key="zero1"),
    Variant("zero2", "ZeRO-2", "zero", ("zero_stage=2",), planner_key="zero2"),
    Variant("zero3", "ZeRO-3", "zero", ("zero_stage=3",), planner_key="zero3"),
    # Same global batch as the others: micro-batch 8 per TP group x 2 accumulation x dp 2.
    Variant("tp2d", "TP x DP (tp2d)", "tp2d", ("grad_accum=2",), model="llama-tiny",
            planner_key="tp_fsdp", gpus=4, tp=2),
)  # fmt: skip


@dataclass
class RunResult:
    variant: Variant
    summary: dict
    step_times: list[float]  # steady state: step 2 onwards
    wall_s: float


@dataclass
class Bench:
    storage: Path
    steps: int
    # A private Ray temp dir (RAY_TMPDIR) for the runs. Ray finds "the latest cluster" through
    # <tmp>/ray/ray_current_cluster; with several local clusters on one machine (other users,
    # test runs in other loopback namespaces) Ray's state API and Train's placement-group
    # cleaner then connect to someone else's cluster and time out, ~55 s per run.
    ray_tmpdir: str = ""
    results: list[RunResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    total_s: float = 0.0

    def command(self, variant: Variant, run_name: str) -> list[str]:
        overrides = [f"storage_path={self.storage}", f"run_name={run_name}",
                     f"max_steps={self.steps}", f"checkpoint_every={self.steps}",
                     *variant.overrides]  # fmt: skip
        if variant.job == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(variant.gpus),
                    str(REPO / "benchmarks" / "torchrun_ddp.py"), *overrides]  # fmt: skip
        return [sys.executable, str(REPO / "jobs" / variant.job / "main.py"), *overrides]

    def run(self, variant: Variant, repeat: int) -> RunResult | None:
        run_name = f"{variant.key}-r{repeat}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "BENCH_LAUNCH_TIME": repr(time.time())}
        if self.ray_tmpdir:
            env["RAY_TMPDIR"] = self.ray_tmpdir
        start = time.time()
        try:
            proc = subprocess.run(self.command(variant, run_name), cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
        except subprocess.TimeoutExpired:
            self.failures.append(f"{run_name}: no result within 600 s")
            print(f"  {run_name} TIMED OUT", flush=True)
            return None
        wall = time.time() - start
        summary = next((json.loads(line[len("SUMMARY "):]) for line in proc.stdout.splitlines()
                        if line.startswith("SUMMARY ")), None)  # fmt: skip
        if proc.returncode != 0 or not summary or summary.get("status") != "succeeded":
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            self.failures.append(f"{run_name}: exit {proc.returncode}: {' | '.join(tail)}")
            print(f"  {run_name} FAILED after {wall:.0f}s", flush=True)
            return None
        rows = Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
        step_times = [r["step_time_s"] for r in map(json.loads, rows) if r["step"] >= 2]
        result = RunResult(variant, summary, step_times, wall)
        self.results.append(result)
        median_ms = 1e3 * statistics.median(step_times)
        print(f"  {run_name}: {summary['tokens_per_s']:,.0f} tok/s, median step {median_ms:.1f} "
              f"ms, {wall:.0f}s wall", flush=True)  # fmt: skip
        return result


def run_all(bench: Bench, variants: list[Variant], repeats: int, budget_s: float) -> None:
    started = time.time()
    longest: dict[str, float] = {}
    for repeat in range(1, repeats + 1):
        print(f"repeat {repeat}/{repeats}", flush=True)
        for variant in variants:
            expected = longest.get(variant.key, max(longest.values(), default=0.0))
            if time.time() - started + expected > budget_s:
                bench.skipped.append(f"{variant.key}-r{repeat}")
                print(f"  {variant.key}-r{repeat} skipped: would pass the {budget_s:.0f}s budget")
                continue
            result = bench.run(variant, repeat)
            if result is not None:
                longest[variant.key] = max(longest.get(variant.key, 0.0), result.wall_s)


# ------------------------------------------------------------------------------------------
# aggregation and the report


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def aggregate(results: list[RunResult], variant: Variant) -> dict | None:
    """Medians over repeats; the step-time spread is the IQR of all steady steps pooled."""
    runs = [r for r in results if r.variant.key == variant.key]
    if not runs:
        return None
    steps = [t for r in runs for t in r.step_times]
    q1, median, q3 = quartiles(steps)
    measured = runs[0].summary.get("model_state_bytes_per_rank") or {}
    model = from_preset(variant.model, vocab=SMOKE_VOCAB, seq_len=64)
    planned = model_state_per_rank(model, variant.planner_key, variant.gpus, tp=variant.tp)
    return {
        "label": variant.label,
        "model": variant.model,
        "world_size": runs[0].summary.get("world_size"),
        "repeats": len(runs),
        "tokens_per_s": statistics.median(r.summary["tokens_per_s"] for r in runs),
        "step_median_s": median,
        "step_q1_s": q1,
        "step_q3_s": q3,
        "step_min_s": min(steps),
        "step_max_s": max(steps),
        "time_to_first_step_s": statistics.median(r.summary["time_to_first_step_s"] for r in runs),
        "wall_s": statistics.median(r.wall_s for r in runs),
        "model_state_measured": sum(measured.values()),
        "model_state_planned": sum(planned.values()),
        "planner_exact": planned == measured,
        "peak_rss": statistics.median(r.summary.get("peak_rss", 0) for r in runs),
        "startup_s": startup_medians(runs),
        # Rows read / rows trained, cluster-wide (the torchrun baseline reads from memory).
        "data_read_amplification": max(
            (r.summary.get("data_read_amplification") or 0 for r in runs), default=0
        )
        or None,
    }


def machine() -> dict:
    from importlib.metadata import version  # no need to import (and initialise) the stack

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "torch": version("torch"),
        "ray": version("ray"),
        "deepspeed": version("deepspeed"),
        "os": platform.platform(),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    }


def paired_ratios(results: list[RunResult]) -> list[dict]:
    """Ray Train / torchrun median step time for each repeat's back-to-back pair of runs."""
    by_run = {r.summary["run_dir"].rsplit("/", 1)[-1]: r for r in results}
    pairs = []
    for name, ray_run in sorted(by_run.items()):
        if not name.startswith("ddp-"):
            continue
        torchrun = by_run.get(name.replace("ddp-", "torchrun-", 1))
        if torchrun:
            a, b = (statistics.median(r.step_times) for r in (ray_run, torchrun))
            pairs.append({"repeat": name[5:], "ray_step_s": a, "torchrun_step_s": b,
                          "ratio": a / b})  # fmt: skip
    return pairs


def startup_medians(runs: list[RunResult]) -> dict[str, float]:
    """SUMMARY's ``startup_s`` phase by phase, the median over the runs that have it."""
    phases = [r.summary.get("startup_s") or {} for r in runs]
    names = dict.fromkeys(name for p in phases for name in p)
    return {name: round(statistics.median(p[name] for p in phases if name in p), 3)
            for name in names}  # fmt: skip


def ray_vs_torchrun(rows: list[dict], results: list[RunResult]) -> dict | None:
    """The acceptance numbers of the Ray Train overhead: step-time ratio and start-up."""
    by_label = {r["label"]: r for r in rows}
    ray_row, torchrun_row = by_label.get("DDP"), by_label.get("DDP (torchrun)")
    if not (ray_row and torchrun_row):
        return None
    pairs = paired_ratios(results)
    return {
        "step_median_s": {"ray": ray_row["step_median_s"],
                          "torchrun": torchrun_row["step_median_s"]},
        "step_ratio": ray_row["step_median_s"] / torchrun_row["step_median_s"],
        "paired_ratios": pairs,
        "paired_ratio_median": statistics.median(p["ratio"] for p in pairs) if pairs else None,
        "time_to_first_step_s": {"ray": ray_row["time_to_first_step_s"],
                                 "torchrun": torchrun_row["time_to_first_step_s"]},
        "startup_s": {"ray": ray_row["startup_s"], "torchrun": torchrun_row["startup_s"]},
    }  # fmt: skip


def startup_table(ray: dict[str, float], torchrun: dict[str, float]) -> list[str]:
    """Markdown: where the time to the first step goes (SUMMARY's ``startup_s``, medians)."""
    lines = ["### Start-up, phase by phase (`startup_s`, seconds, medians)", "",
             "| phase | Ray Train | torchrun |", "|---|---|---|"]  # fmt: skip
    for phase in dict.fromkeys([*ray, *torchrun]):
        cells = [f"{d[phase]:.2f}" if phase in d else "-" for d in (ray, torchrun)]
        lines.append(f"| {phase} | {cells[0]} | {cells[1]} |")
    return [
        *lines,
        "",
        "Phases (shared/observability/startup.py): *cluster_start* preflight checks and the "
        "local Ray cluster; *data_preparation* packing the dataset or finding it cached; "
        "*worker_group_start* Ray Train's controller, the worker actors and the torch "
        "process group (torchrun: its processes and process group); *model_build* the "
        "model, the strategy's wrap and any checkpoint load; *first_batch* the data "
        "pipeline's first micro-batch; *first_step* step 1's compute.",
        "",
    ]


def amplification(value: float | None) -> str:
    """Worst run's rows read / rows trained; '-' where the data is not read through the layer."""
    return "-" if value is None else f"{value:.2f}"


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


# Everything after this line in docs/benchmarks.md is written by people (what the numbers
# mean, which levers helped and which did not) and survives a regeneration.
NOTES_MARKER = "<!-- Hand-written below this line: bench.py keeps it when it rewrites the file. -->"


def with_kept_notes(generated: str, previous: str) -> str:
    """The generated report, followed by the previous file's hand-written part (if any)."""
    if NOTES_MARKER not in previous:
        return generated
    return generated + "\n" + NOTES_MARKER + previous.split(NOTES_MARKER, 1)[1]


def render_markdown(rows: list[dict], info: dict, bench: Bench, args, chart: str) -> str:
    by_label = {r["label"]: r for r in rows}
    lines = [
        "# Strategy benchmark (`make bench`)",
        "",
        "Generated by `benchmarks/bench.py`; rerun `make bench` (with `LOOPBACK_ONLY=1` on "
        "machines that need the loopback namespace) to refresh it. Numbers are reported, not "
        "asserted: on 2 shared CPU cores they move by tens of percent between runs.",
        "",
        f"**Machine:** {info['cpu']}, {info['cores']} cores, {info['os']}; load average "
        f"{info['load_average']} at the start, {info.get('load_average_end', '?')} at the end. "
        f"Python {info['python']}, torch {info['torch']}, "
        f"Ray {info['ray']}, DeepSpeed {info['deepspeed']}. Run {info['date']}, "
        f"{bench.total_s:.0f} s in all.",
        "",
        f"**Workload:** the smoke profile on a fresh local Ray cluster per run, fp32 on CPU "
        f"(gloo), {args.steps} optimizer steps per run, {args.repeats} repeats; 32 sequences x "
        "64 tokens = 2,048 tokens per step for every row. DDP, FSDP2 and ZeRO train gpt2-tiny "
        "on 2 workers; TP x DP is jobs/tp2d, llama-tiny on dp=2 x tp=2 = 4 workers sharing the "
        "same 2 cores (the TP plan is written for the Llama model; a similar size, 0.14M vs "
        "0.15M parameters, but not the same arithmetic).",
        "",
        "| strategy | model | workers | runs | tokens/s | step median (ms) | step IQR (ms) | "
        "step min-max (ms) | model state / rank (measured) | planner | peak RSS rank 0 | "
        "time to first step (s) | data read amplification |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        planner = "= exact" if r["planner_exact"] else format_size(r["model_state_planned"])
        lines.append(
            f"| {r['label']} | {r['model']} | {r['world_size']} | {r['repeats']} | "
            f"{r['tokens_per_s']:,.0f} | {ms(r['step_median_s'])} | "
            f"{ms(r['step_q1_s'])}-{ms(r['step_q3_s'])} | "
            f"{ms(r['step_min_s'])}-{ms(r['step_max_s'])} | "
            f"{format_size(r['model_state_measured'])} | {planner} | "
            f"{format_size(r['peak_rss'])} | {r['time_to_first_step_s']:.1f} | "
            f"{amplification(r['data_read_amplification'])} |"
        )
    lines += ["", f"![tokens/s per strategy]({chart})", ""]
    ray_row, torchrun_row = by_label.get("DDP"), by_label.get("DDP (torchrun)")
    if ray_row and torchrun_row:
        ratio = ray_row["step_median_s"] / torchrun_row["step_median_s"]
        overhead = ray_row["time_to_first_step_s"] - torchrun_row["time_to_first_step_s"]
        pairs = [f"repeat {p['repeat']}: {ms(p['ray_step_s'])} vs {ms(p['torchrun_step_s'])} "
                 f"ms = {p['ratio']:.2f}" for p in paired_ratios(bench.results)]  # fmt: skip
        lines += [
            "## Ray Train vs torchrun, same DDP loop",
            "",
            f"- Step time: {ms(ray_row['step_median_s'])} ms under Ray Train vs "
            f"{ms(torchrun_row['step_median_s'])} ms under torchrun (medians): ratio "
            f"**{ratio:.2f}**. The step time includes waiting for the next batch (each rank's Ray "
            "Data read vs the same reader over tensors already in memory).",
            f"- Start-up: {ray_row['time_to_first_step_s']:.1f} s from launch to the end of the "
            f"first step under Ray Train (start a local cluster, generate/read the data, "
            f"schedule the worker group) vs {torchrun_row['time_to_first_step_s']:.1f} s under "
            f"torchrun: Ray's start-up overhead is **{overhead:.1f} s** per run here.",
            "- Each torchrun run starts right after the Ray Train run of the same repeat, so the "
            "pairs saw similar machine load: " + "; ".join(pairs) + ". On a shared 2-core "
            "machine the spread between pairs is the noise floor of this ratio.",
            "",
            *startup_table(ray_row["startup_s"], torchrun_row["startup_s"]),
        ]
    lines += [
        "## Reading it",
        "",
        "- *model state / rank*: `model_state_bytes_per_rank` from the run's SUMMARY (params + "
        "grads + optimizer states, + DeepSpeed's fp32 master partition), the tensor bytes each "
        "rank holds. *planner* is `shared.planner`'s prediction for the same configuration "
        "(`= exact` when every byte matches).",
        "- *data read amplification*: rows the data layer read / rows trained, all ranks "
        "(`data_read_amplification` in SUMMARY; the worst repeat). 1.00 means every sample "
        "was read exactly once (the torchrun baseline reads its in-memory tensors through the "
        "same layer).",
        "- *peak RSS* is rank 0's process high-water mark: on CPU it is dominated by the "
        "Python/torch runtime, so the sharded strategies' savings show in the tensor bytes, "
        "not here (see shared/STACK-FACTS.md in the team notes).",
        "- On 2 CPU cores the collectives are gloo over loopback and the model is tiny, so "
        "this ranks the strategies' overheads (more collectives per step for FSDP2/ZeRO-3, "
        "DeepSpeed's engine, 4 processes for TP x DP), not their speed on GPUs.",
        "- GPU check of the activation estimate (GPT-2 124M, CUDA peak vs "
        "`shared.planner`): not run yet; this task had no GPU machine.",
    ]
    if bench.skipped:
        lines.append(f"- Skipped to stay within the {args.budget_s:.0f} s budget: "
                     f"{', '.join(bench.skipped)}.")  # fmt: skip
    if bench.failures:
        lines += ["- Failed runs:", *(f"  - `{f[:300]}`" for f in bench.failures)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--budget-s", type=float, default=840, help="stop starting runs after")
    parser.add_argument("--only", default="", help="comma-separated keys: " +
                        ",".join(v.key for v in VARIANTS))  # fmt: skip
    parser.add_argument("--storage", default=str(REPO / "runs" / "bench"))
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--json", default="", help="also write the numbers as JSON to this file")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 4:
        parser.error("--repeats must be >= 1 and --steps >= 4 (warm-up 3 steps + 1).")
    only = set(filter(None, args.only.split(",")))
    unknown = only - {v.key for v in VARIANTS}
    if unknown:
        parser.error(f"unknown --only keys: {', '.join(sorted(unknown))}")
    variants = [v for v in VARIANTS if not only or v.key in only]

    info = machine()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    # Short, in /tmp: Ray's unix socket paths under it must stay below ~107 characters.
    ray_tmpdir = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")
    bench = Bench(Path(args.storage) / stamp, args.steps, ray_tmpdir=ray_tmpdir)
    started = time.time()
    try:
        run_all(bench, variants, args.repeats, args.budget_s)
    finally:
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    bench.total_s = time.time() - started
    info["load_average_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = [row for v in variants if (row := aggregate(bench.results, v)) is not None]
    if not rows:
        print("error: every run failed:\n" + "\n".join(bench.failures), file=sys.stderr)
        return 1
    out = Path(args.out)
    chart = out.with_suffix(".png")
    save_bar_chart(str(chart), [r["label"] for r in rows], [r["tokens_per_s"] for r in rows],
                   title=f"tokens/s per strategy ({info['cores']} CPU cores, fp32, gloo)",
                   ylabel="tokens/s (median of runs)")  # fmt: skip
    previous = out.read_text() if out.exists() else ""
    out.write_text(with_kept_notes(render_markdown(rows, info, bench, args, chart.name), previous))
    numbers = {"machine": info, "rows": rows,
               "ray_vs_torchrun": ray_vs_torchrun(rows, bench.results),
               "failures": bench.failures, "skipped": bench.skipped}  # fmt: skip
    bench.storage.mkdir(parents=True, exist_ok=True)
    for path in filter(None, (bench.storage / "bench.json", args.json)):
        Path(path).write_text(json.dumps(numbers, indent=2))
    print(f"wrote {out} and {chart} in {bench.total_s:.0f}s (raw: {bench.storage}/bench.json)")
    return 0 if not bench.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
