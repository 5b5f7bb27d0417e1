"""What a dry run traces on the fake process group: the job's model on the meta device and its
strategy's wrapping, one optimizer step on meta gradients, and one real block's activations."""

from __future__ import annotations

import contextlib

import torch


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
