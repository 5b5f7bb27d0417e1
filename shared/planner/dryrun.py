"""Dry-run a job at its real world size on one CPU: ``make dry-run JOB=<job> [PROFILE=full]``.

    python -m shared.planner.dryrun --job tp2d --profile full
    python -m shared.planner.dryrun --job tp2d model=llama-7b dp=8 tp=8 num_workers=64

One process plays rank 0 of the job's world (``num_workers``) on PyTorch's fake process group
(``FakeStore``, backend ``fake``): collectives move nothing, so nothing is allocated at real
size. It runs the job's own code path where that is possible without memory:

* the job's config (profile + overrides, validated as the job validates them: a TP size that
  does not divide the heads fails here, with the job's own sentence);
* the job's model builder on the ``meta`` device, then the job's wrapping (``apply_tp`` on the
  (dp, tp) mesh, ``apply_fsdp`` per block and root; ``apply_ddp``, with the constructor's
  cross-rank shape check skipped: it reads values, which meta tensors refuse, and the fake
  group has no other ranks to compare with); the parameter bytes are read from each rank's
  local shards, DDP's gradient buckets from its reducer;
* the job's optimizer (``shared.optim.build_adamw``) takes one step on meta gradients of the
  same layout, so the optimizer state is what AdamW really allocates;
* activations: one real transformer block (TP-sharded for tp2d) runs forward on the CPU at the
  real sequence length and hidden size with micro-batch 1 and 2, and the bytes it keeps for the
  backward (``shared.planner.measure``) are extrapolated to the micro-batch (they are linear in
  it) and multiplied by the layers; the output layer and loss come from the planner formula.
  Its matmuls' outputs are allocated, not computed: the bytes do not depend on the values, and
  bf16 matmuls on a CPU without bf16 units took minutes (a 7B block: 47 s, now 12 s).

FSDP refuses a forward with meta parameters and ``FakeTensorMode`` breaks ``fully_shard`` on
TP-sharded parameters (STACK-FACTS), hence the block-wise route. For the ZeRO job nothing is
traced: DeepSpeed's own offline estimator (``estimate_zero2/3_model_states_mem_needs``) and the
planner are printed side by side, and the table says so. The other framework buffers
(FSDP's gathered blocks, TP's reduce buckets) are the planner's. The verdict compares the
per-rank total with the GPU of the job's compute config (job.yaml) minus 10% headroom; not
fitting exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import torch
import yaml

from shared.config import ConfigError, build_config, split_overrides
from shared.planner.activations import output_activation_bytes
from shared.planner.hardware import GPUS, PRECISIONS
from shared.planner.memory import Settings, estimate_all
from shared.planner.specs import GPT2_VOCAB, from_preset
from shared.planner.units import format_size

REPO = Path(__file__).resolve().parents[2]

# Which config class each job parses, and the planner row its strategy is.
JOBS = {
    "ddp": ("TrainConfig", "ddp"),
    "fault_tolerance": ("FaultToleranceConfig", "ddp"),
    "fsdp": ("FSDPConfig", "fsdp2"),
    "zero": ("ZeroConfig", "zero"),
    "tp2d": ("TP2DConfig", "tp_fsdp"),
}
# Instance types of the compute configs -> (the planner's GPU preset, GPUs per node).
INSTANCES = {
    "g4dn.xlarge": ("t4", 1), "g4dn.12xlarge": ("t4", 4), "g4dn.metal": ("t4", 8),
    "g6.xlarge": ("l4", 1), "g6.12xlarge": ("l4", 4), "g6.48xlarge": ("l4", 8),
    "g5.xlarge": ("a10g", 1), "g5.12xlarge": ("a10g", 4), "g5.48xlarge": ("a10g", 8),
    "p4d.24xlarge": ("a100-40g", 8), "p4de.24xlarge": ("a100-80g", 8),
    "p5.48xlarge": ("h100", 8), "p5e.48xlarge": ("h200", 8),
}  # fmt: skip
HEADROOM = 0.10
ROWS = ("params", "grads", "optimizer", "activations", "buffers")


@dataclasses.dataclass
class ComputeConfig:
    gpu: str  # a key of GPUS
    gpus_per_node: int
    nodes: int
    source: str  # the file it comes from

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def hosts_tp(self, tp: int) -> bool:
        """A TP group talks in every layer: it must sit inside one node."""
        return self.gpus_per_node >= tp and self.gpus_per_node % tp == 0


def load_job(job: str):
    """The job's main module (its PROFILES) and its config class."""
    if job not in JOBS:
        trains = ", ".join(JOBS)
        raise ConfigError(f"job '{job}' cannot be dry-run (it trains no model); jobs: {trains}.")
    path = REPO / "jobs" / job / "main.py"
    spec = importlib.util.spec_from_file_location(f"dryrun_{job}_main", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, getattr(module, JOBS[job][0])


def _gpu_workers(spec: dict, source: str) -> ComputeConfig:
    workers = [w for w in spec.get("worker_nodes", []) if w["instance_type"] in INSTANCES]
    if not workers:
        raise ConfigError(f"{source} has no GPU worker node the dry run knows.")
    worker = workers[0]
    gpu, per_node = INSTANCES[worker["instance_type"]]
    return ComputeConfig(gpu, per_node, int(worker.get("max_nodes", 1)), source)


def compute_config(job: str) -> ComputeConfig:
    """The GPU workers of the job.yaml's inline compute config."""
    spec = yaml.safe_load((REPO / "jobs" / job / "job.yaml").read_text())
    return _gpu_workers(spec["compute_config"], f"jobs/{job}/job.yaml")


def named_compute_config(name: str) -> ComputeConfig:
    """The GPU workers of ``compute_configs/<name>.yaml``."""
    path = REPO / "compute_configs" / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"no compute config '{name}' in compute_configs/ (there are: {known}).")
    return _gpu_workers(yaml.safe_load(path.read_text()), f"compute_configs/{path.name}")


def gpu_compute_configs() -> list[ComputeConfig]:
    """The compute configs in compute_configs/ with GPU workers, by file name."""
    found = []
    for path in sorted((REPO / "compute_configs").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        if any(w["instance_type"] in INSTANCES for w in spec.get("worker_nodes", [])):
            found.append(_gpu_workers(spec, f"compute_configs/{path.name}"))
    return found


def choose_compute(job: str, tp: int, requested: str | None) -> tuple[ComputeConfig, str]:
    """(the compute config to dry-run on, a note when it is not the job.yaml's). A TP size the
    job's nodes cannot hold in one node (tp=8 on 4-GPU nodes) moves to the project's compute
    config whose node can: the job.yaml could not run that layout at all."""
    if requested:
        compute = named_compute_config(requested)
        if not compute.hosts_tp(tp):
            raise ConfigError(f"tp={tp} needs a TP group inside one node; {compute.source} has "
                              f"{compute.gpus_per_node} GPUs per node.")  # fmt: skip
        return compute, ""
    compute = compute_config(job)
    if compute.hosts_tp(tp):
        return compute, ""
    hosts = [c for c in gpu_compute_configs() if c.hosts_tp(tp)]
    if not hosts:
        raise ConfigError(f"tp={tp} needs a TP group inside one node, and no compute config in "
                          "compute_configs/ has that many GPUs per node.")  # fmt: skip
    hosts.sort(key=lambda c: c.gpus_per_node)  # the smallest node that holds the group
    note = (f"note: {compute.source}'s nodes have {compute.gpus_per_node} GPUs, too few for a "
            f"TP group of {tp}; dry-running on {hosts[0].source}'s node instead (COMPUTE= picks "
            "another).")  # fmt: skip
    return hosts[0], note


def vocab_size(cfg) -> int:
    """The GPT-2 tokenizer's 50257 for the full profiles; the smoke runs train a 512-token one."""
    return GPT2_VOCAB if cfg.tokenizer else 512


# ------------------------------------------------------------------------------------------
# the job's model and wrapping on the fake process group


@contextlib.contextmanager
def fake_world(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_model(job: str, cfg, vocab: int) -> torch.nn.Module:
    if job == "tp2d":
        from shared.models.llama import build_llama

        return build_llama(cfg.model, vocab)
    from shared.models.gpt2 import build_gpt2

    return build_gpt2(cfg.model, vocab, cfg.seq_len)  # pretrained weights: the same shapes


def wrap(job: str, cfg, model: torch.nn.Module, dtype: torch.dtype):
    """The job's strategy wrapping; returns the model and the TP mesh (or None)."""
    if job == "zero":
        return model, None  # DeepSpeed needs real tensors: see the estimate
    if job in ("ddp", "fault_tolerance"):
        return meta_ddp(model), None
    from shared.parallel.fsdp import apply_fsdp, data_parallel_mesh

    cpu = torch.device("cpu")
    options = dict(
        param_dtype=dtype,
        reduce_dtype=torch.bfloat16 if cfg.reduce_dtype == "bf16" else torch.float32,
        reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload,
        blocks_per_group=cfg.blocks_per_group,
        activation_checkpointing=False,  # the block trace below recomputes on its own
    )  # fmt: skip
    if job == "fsdp":
        return apply_fsdp(model, data_parallel_mesh(cpu), **options), None
    from shared.parallel.tp import apply_tp, device_mesh_2d

    mesh = device_mesh_2d(cpu, cfg.dp, cfg.tp)
    model = apply_tp(model, mesh["tp"])
    return apply_fsdp(model, mesh["dp"], **options), mesh["tp"]


def meta_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """``apply_ddp`` (what ``prepare_model`` builds, less the CUDA device id) on meta tensors.
    The constructor's first act is an all-gather comparing every rank's parameter shapes,
    which reads values; on the fake group it compares nothing, so it is skipped."""
    from unittest import mock

    import torch.nn.parallel.distributed as ddp_module

    from shared.parallel.ddp import apply_ddp

    check = "_verify_param_shape_across_processes"
    with mock.patch.object(ddp_module, check, return_value=None):
        return apply_ddp(model, torch.device("meta"))


def ddp_bucket_bytes(model: torch.nn.Module) -> int | None:
    """The gradient buckets DDP's reducer allocated (its own logging data), None if not DDP."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    sizes = model._get_ddp_logging_data()["bucket_sizes"]
    return sum(int(size) for size in str(sizes).split(",") if size.strip())


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def traced_model_states(model: torch.nn.Module, cfg) -> dict[str, int]:
    """Parameters as sharded, and one AdamW step (the job's optimizer) on meta gradients."""
    from shared.optim import build_adamw

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = build_adamw(model, cfg.lr, cfg.weight_decay)
    for group in optimizer.param_groups:
        group["foreach"], group["fused"] = False, False  # meta tensors: the plain loop
    optimizer.step()
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params),
        "optimizer": local_bytes(states),
    }


# ------------------------------------------------------------------------------------------
# activations: one real block at the real shape


def traced_activations(job: str, cfg, vocab: int, dtype: torch.dtype, tp_mesh) -> dict:
    """Bytes one block keeps for its backward at micro-batch 1 and 2 (real CPU tensors, TP-
    sharded for tp2d; matmul outputs allocated, not computed), extrapolated to the
    micro-batch, times the layers."""
    from shared.planner.measure import LiveStorageTracker, _local

    torch.manual_seed(0)
    if job == "tp2d":
        from torch.distributed.tensor.parallel import parallelize_module

        from shared.models.llama import LLAMA_PRESETS, Block
        from shared.parallel.tp import BLOCK_PLAN

        preset = LLAMA_PRESETS[cfg.model]
        block, layers = Block(preset).to(dtype), preset.n_layers
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
        hidden = preset.dim
    else:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        from shared.models.gpt2 import PRESETS

        p = PRESETS[cfg.model]
        # Dropout off: on the CPU, SDPA with dropout falls back to the kernel that stores the
        # scores; the GPU's does not. The planner adds the two 1-byte masks.
        config = GPT2Config(n_embd=p.n_embd, n_head=p.n_head, n_layer=p.n_layer,
                            n_positions=max(p.n_positions, cfg.seq_len), resid_pdrop=0.0,
                            attn_pdrop=0.0, embd_pdrop=0.0, vocab_size=vocab)  # fmt: skip
        config._attn_implementation = "sdpa"
        block, layers, hidden = GPT2Block(config, layer_idx=0).to(dtype), p.n_layer, p.n_embd
    block.train()

    def run(batch: int, recompute: bool) -> int:
        """The block twice in a row, as consecutive layers: the second call's kept storages
        plus the first call's output if the second keeps it (fp32: its norm saves its input;
        bf16 Llama: it saves an fp32 copy instead and the 16-bit output is freed)."""
        # Under TP the blocks see the local, sequence-sharded activations (the embedding's
        # RowwiseParallel hands out local tensors of s / tp tokens).
        seq = cfg.seq_len // (cfg.tp if tp_mesh is not None else 1)
        x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
        exclude = {_local(t).untyped_storage()._cdata for t in block.parameters()}
        tracker = LiveStorageTracker(skip_matmuls=True)

        def layer(inp):
            if recompute:
                return torch.utils.checkpoint.checkpoint(_call(block), inp, use_reentrant=False)
            return _call(block)(inp)

        with tracker:
            tracker.owner = "first"
            y = layer(x)
            tracker.owner = "second"
            z = layer(y)
            loss = z.float().sum()
        y_key = y.untyped_storage()._cdata
        del y, z
        alive = tracker.alive_bytes(exclude)
        first_output = tracker.storages[y_key]
        kept = alive.get("second", 0)
        if not first_output[1].expired():
            kept += first_output[2]
        del loss
        return kept

    # Linear in the micro-batch (a TP group's ranks all see its whole micro-batch).
    one, two = run(1, False), run(2, False)
    per_layer = one + (two - one) * (cfg.micro_batch_size - 1)
    if cfg_recompute(cfg):  # each block keeps its input; the one being recomputed, everything
        kept_one, kept_two = run(1, True), run(2, True)
        kept = kept_one + (kept_two - kept_one) * (cfg.micro_batch_size - 1)
        return {"layers": layers * kept + per_layer}
    return {"layers": layers * per_layer}


def _call(block):
    """Call a block as its model does: GPT2LMHeadModel passes a KV cache (``use_cache`` is on
    by default, and the cache's k/v copies are kept for the backward); the Llama block takes x."""
    if type(block).__name__ != "GPT2Block":
        return block
    from transformers import DynamicCache

    def forward(x):
        out = block(x, cache=DynamicCache(), use_cache=True)
        return out[0] if isinstance(out, tuple) else out

    return forward


def cfg_recompute(cfg) -> bool:
    return bool(getattr(cfg, "activation_checkpointing", False))


# ------------------------------------------------------------------------------------------
# the report


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
            largest = max(sum(p.numel() for p in b.parameters()) for b in _blocks(model))
            note = (
                f"ZeRO-{cfg.zero_stage}: not traced (DeepSpeed needs real tensors); DeepSpeed's "
                f"estimate_zero{3 if cfg.zero_stage == 3 else 2}_model_states_mem_needs gives "
                f"{deepspeed_estimate(cfg, spec.n_params, largest, compute)} of model states "
                "per GPU (its own 18-byte rule), next to the planner's layout above."
            )
            traced = dict.fromkeys(ROWS)
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


def _blocks(model):
    from shared.models.structure import transformer_blocks

    return list(transformer_blocks(model))


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


if __name__ == "__main__":
    raise SystemExit(main())
