"""Activation bytes measured on the CPU: what each transformer layer keeps alive for its backward.

The bytes a forward leaves for the backward do not depend on the device, so a CPU run at small
shapes checks the planner's activation formulas. A ``TorchDispatchMode`` sees every tensor an
op creates during the forward, notes the storage (deduplicated: views and in-place results
share one) and which block was running; after the forward, the storages still alive are what
autograd saved (the model's outputs are dropped first). Parameters never count. This covers
full recomputation too, where ``torch.utils.checkpoint`` keeps only each block's input.

Used by tests/unit/test_planner.py and docs/planner.md's table
(``python -m shared.planner.measure``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (TP), unwrapped from a pending collective, else the
    tensor itself."""
    t = getattr(t, "_local_tensor", t)
    return getattr(t, "elem", t)  # AsyncCollectiveTensor: the collective's output


_MATMULS = frozenset(
    getattr(torch.ops.aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm")
)


def _allocated_like_result(func, args, kwargs) -> torch.Tensor | None:
    """The output a matmul would allocate (shape, strides, dtype and, for a DTensor, its
    placements, from the meta kernels), zeroed instead of computed; None for tensors other
    than plain and DTensors on the CPU."""
    from torch.distributed.tensor import DTensor

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = t.to_local().to("meta")
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())  # fmt: skip
        return t.to("meta")

    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    plain = (torch.Tensor, torch.nn.Parameter, DTensor)  # not other wrappers
    if not all(type(t) in plain and t.device.type == "cpu" for t in tensors):
        return None
    metas = {id(t): to_meta(t) for t in tensors}
    meta_args, meta_kwargs = tree_map(
        lambda x: metas.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    out = func(*meta_args, **meta_kwargs)
    if isinstance(out, DTensor):
        local = out.to_local()
        zeros = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype).zero_()
        return DTensor.from_local(zeros, out.device_mesh, out.placements, run_check=False,
                                  shape=out.shape, stride=out.stride())  # fmt: skip
    return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype).zero_()


class LiveStorageTracker(TorchDispatchMode):
    """Records each new storage an op creates, tagged with the block running at the time.

    ``skip_matmuls``: matmul outputs are allocated (zeroed), not computed. The bytes kept do not
    depend on the values, and a CPU without bf16 units multiplies bf16 at well under a GFLOP/s:
    one GPT-2 124M block at 2 x 1024 tokens took ~100 s computed, ~1 s allocated. Only for a
    forward whose values nobody reads (the dry run's; its backward is never run).
    """

    def __init__(self, skip_matmuls: bool = False):
        super().__init__()
        self.owner = "other"
        self.skip_matmuls = skip_matmuls
        self.allocated_matmuls = 0  # matmuls whose output was allocated, not computed
        self.storages: dict[int, tuple[str, StorageWeakRef, int]] = {}

    def note(self, t: torch.Tensor, owner: str) -> None:
        storage = _local(t).untyped_storage()
        if storage._cdata not in self.storages:
            self.storages[storage._cdata] = (owner, StorageWeakRef(storage), storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if self.skip_matmuls and func in _MATMULS:
            out = _allocated_like_result(func, args, kwargs)
            self.allocated_matmuls += out is not None
        if out is None:
            out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.note(t, self.owner)
        return out

    def alive_bytes(self, exclude: set[int]) -> dict[str, int]:
        totals: dict[str, int] = {}
        for key, (owner, ref, nbytes) in self.storages.items():
            if key not in exclude and not ref.expired():
                totals[owner] = totals.get(owner, 0) + nbytes
        return totals


def saved_bytes_per_block(model: torch.nn.Module, blocks, input_ids: torch.Tensor, loss_fn):
    """Forward ``input_ids``, keep only the loss, return (bytes each block left alive, bytes
    of everything else: embeddings, final norm, output layer and loss)."""
    exclude = {_local(p).untyped_storage()._cdata for p in model.parameters()}
    exclude |= {_local(b).untyped_storage()._cdata for b in model.buffers()}
    tracker = LiveStorageTracker()
    handles = []
    for i, block in enumerate(blocks):

        def enter(_module, args, i=i):
            # The block's input belongs to what produced it (the previous block, or the
            # embedding, whose TP reduce-scatter only materializes here).
            tracker.note(args[0], "other")
            tracker.owner = f"layer{i}"

        def leave(_module, _args, _out):
            tracker.owner = "other"

        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    try:
        with tracker:
            loss = loss_fn(model(input_ids))
        totals = tracker.alive_bytes(exclude)
        loss.backward()  # the graph really is complete: every saved tensor was needed
    finally:
        for h in handles:
            h.remove()
    return [totals.get(f"layer{i}", 0) for i in range(len(blocks))], totals.get("other", 0)


@dataclass(frozen=True)
class Point:
    """One measured configuration."""

    model: str  # "gpt2" (transformers GPT-2, SDPA) or "llama" (shared.models.llama)
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int = 0
    layers: int = 2
    tp: int = 1
    recompute: str = "none"  # none | full (the models' gradient checkpointing)
    vocab: int = 256
    attention: str = "sdpa"  # sdpa | eager (GPT-2 only)
    dtype: str = "fp32"  # fp32 | bf16 (the whole model in bf16, as FSDP2's param_dtype runs it)
    dropout: float = 0.0  # GPT-2 only

    def label(self) -> str:
        kv = f", kv {self.kv_heads}" if self.kv_heads and self.kv_heads != self.heads else ""
        return (
            f"{self.model} b={self.batch} s={self.seq} h={self.hidden} a={self.heads}{kv} "
            f"tp={self.tp} recompute={self.recompute}"
            + (f" attention={self.attention}" if self.attention != "sdpa" else "")
            + (f" {self.dtype}" if self.dtype != "fp32" else "")
            + (f" dropout={self.dropout}" if self.dropout else "")
        )


def planned_spec(point: Point):
    """The planner's ModelSpec for the model ``_build`` makes."""
    from shared.planner.specs import ModelSpec, _llama_spec, gpt2_tensors

    if point.model == "llama":
        return _llama_spec(f"{point.model}", point.hidden, point.layers, point.heads,
                           point.kv_heads or point.heads, _llama_ffn(point.hidden), point.vocab,
                           point.seq, layout="llama")  # fmt: skip
    return ModelSpec(point.model, point.layers, point.hidden, point.heads, point.heads,
                     4 * point.hidden, point.vocab, point.seq,
                     gpt2_tensors(point.layers, point.hidden, point.vocab, point.seq),
                     dropout=point.dropout > 0, layout="gpt2")  # fmt: skip


def planned_layer_bytes(point: Point) -> float:
    """What the planner says one layer keeps, for this configuration."""
    from shared.planner.activations import layer_bytes
    from shared.planner.hardware import PRECISIONS

    return layer_bytes(planned_spec(point), point.seq, point.batch, PRECISIONS[point.dtype],
                       point.recompute, t=point.tp, sp=point.tp > 1)  # fmt: skip


def _llama_ffn(hidden: int) -> int:
    return int(8 * hidden / 3) // 8 * 8  # Llama's 2/3 x 4h, rounded to a multiple of 8


def _build(point: Point) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    if point.model == "llama":
        from shared.models.llama import Llama, LlamaPreset

        preset = LlamaPreset(
            dim=point.hidden, n_layers=point.layers, n_heads=point.heads,
            n_kv_heads=point.kv_heads or point.heads, ffn_dim=_llama_ffn(point.hidden),
            max_seq_len=point.seq,
        )  # fmt: skip
        model = Llama(preset, point.vocab)
        return model, model.layers
    from transformers import GPT2Config, GPT2LMHeadModel

    # As shared.models.gpt2.build_gpt2 configures it (use_cache at its default, as in the jobs).
    config = GPT2Config(
        vocab_size=point.vocab, n_positions=point.seq, n_embd=point.hidden,
        n_layer=point.layers, n_head=point.heads, resid_pdrop=point.dropout,
        embd_pdrop=point.dropout, attn_pdrop=point.dropout,
    )  # fmt: skip
    model = GPT2LMHeadModel._from_config(config, attn_implementation=point.attention)
    return model, model.transformer.h


@contextlib.contextmanager
def _tp_group(tp: int):
    """A fake process group of ``tp`` ranks (this process is rank 0): DTensor shards as on
    real hardware while the collectives move nothing, which is all the byte count needs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield init_device_mesh("cpu", (tp,))
    finally:
        dist.destroy_process_group()


def measure(point: Point) -> tuple[list[int], int]:
    """Bytes per layer (fp32 activations) and the rest, for one configuration."""
    torch.manual_seed(0)
    model, blocks = _build(point)
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[point.dtype])
    if point.recompute == "full":
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    ids = torch.randint(0, point.vocab, (point.batch, point.seq))
    if point.model == "gpt2":

        def run(m, x):
            return m(x).logits

    else:

        def run(m, x):
            return m(x)

    def loss_fn(logits):
        logits = logits.to_local() if hasattr(logits, "to_local") else logits
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten() % logits.shape[-1])

    if point.tp == 1:
        return saved_bytes_per_block(_ForwardOnly(model, run), blocks, ids, loss_fn)
    if point.model != "llama":
        raise ValueError("tp is measured on the Llama model (shared/parallel/tp.py's plan).")
    from shared.parallel.tp import apply_tp

    with _tp_group(point.tp) as mesh:
        apply_tp(model, mesh)
        wrapped = _ForwardOnly(model, run)
        return saved_bytes_per_block(wrapped, blocks, ids, loss_fn)


class _ForwardOnly(torch.nn.Module):
    def __init__(self, model, run):
        super().__init__()
        self.model, self.run = model, run

    def forward(self, x):
        return self.run(self.model, x)


# docs/planner.md's table and tests/unit/test_planner.py's cases: both models, both dtypes, GQA,
# tp 2 and 4 with sequence parallelism, full recomputation, several (b, s, h, a).
POINTS = (
    Point("gpt2", 2, 32, 64, 4),
    Point("gpt2", 1, 64, 96, 6, layers=3),
    Point("gpt2", 2, 32, 64, 4, dtype="bf16"),
    Point("gpt2", 2, 32, 64, 4, recompute="full"),
    Point("llama", 2, 32, 64, 4, kv_heads=2),
    Point("llama", 2, 32, 64, 4, kv_heads=2, dtype="bf16"),
    Point("llama", 2, 32, 64, 4, kv_heads=2, tp=2, layers=3),
    Point("llama", 1, 64, 128, 8, kv_heads=4, tp=4, layers=3),
    Point("llama", 2, 32, 64, 4, kv_heads=2, recompute="full"),
    Point("llama", 2, 32, 64, 4, kv_heads=2, tp=2, recompute="full", layers=3),
)


def markdown_table(points=POINTS) -> str:
    rows = ["| configuration | measured per layer (bytes) | planned (bytes) | difference |",
            "|---|---|---|---|"]  # fmt: skip
    for point in points:
        per_layer, _ = measure(point)
        planned = planned_layer_bytes(point)
        worst = max(abs(m / planned - 1) for m in per_layer)
        measured = ", ".join(str(m) for m in dict.fromkeys(per_layer))
        rows.append(f"| {point.label()} | {measured} | {planned:.0f} | {worst:.2%} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
