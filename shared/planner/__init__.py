"""Memory planner and decision framework: which parallelism strategy fits, and why.

    python -m shared.planner --preset gpt2-xl --gpus 8 --gpu-mem 16GiB
    python -m shared.planner --config path/to/config.json --gpus 16 --gpus-per-node 8 --tp 8
    python -m shared.planner --params 7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --json

For every strategy the templates implement (DDP, ZeRO-1/2/3, ZeRO-3 + CPU offload, FSDP2, TP,
TP + sequence parallel, TP x FSDP) it estimates the bytes one GPU holds, split into parameters,
gradients, optimizer states, activations and framework buffers, says whether that fits the GPU
memory minus headroom, and recommends a strategy with the reason.

Sources of the formulas
-----------------------
Model states - Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (arXiv:1910.02054), section 3.1 and 5: mixed-precision Adam keeps 2 bytes of
fp16/bf16 parameters, 2 bytes of gradients and K = 12 bytes of optimizer state (fp32 master
weights, momentum, variance) per parameter, 16 bytes in all. With N_d data-parallel ranks:

    baseline (DDP)        (2 + 2 + K) * Psi
    P_os   (ZeRO-1)       2 * Psi + 2 * Psi + K * Psi / N_d
    P_os+g (ZeRO-2)       2 * Psi + (2 + K) * Psi / N_d
    P_os+g+p (ZeRO-3)     (2 + 2 + K) * Psi / N_d

The planner applies these per tensor, the way the frameworks lay the tensors out, so that its
numbers equal what the strategies in ``shared/parallel`` measure (``model_state_bytes()``):

* FSDP2 shards every parameter on dim 0 and pads the shards to equal size: a rank holds
  ``ceil(d0 / N) * (other dims)`` elements of each tensor (torch.chunk; rank 0 has the largest).
* DeepSpeed ZeRO-1/2 flattens each optimizer param group and pads it to a multiple of
  ``2 * N`` elements (``nccl_start_alignment_factor = 2`` in ``stage_1_and_2.py``); every rank
  owns ``padded / N``. ZeRO-3 partitions each parameter to ``ceil(numel / N)``
  (``partition_parameters._aligned_size``).
* DeepSpeed keeps an fp32 master copy of its partition *even in fp32 training*
  (``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat``): reported as
  ``master_params`` and counted with the optimizer states, as the ZeRO paper's K does.
* torch's AdamW keeps a 4-byte ``step`` tensor per parameter tensor; DeepSpeed one per flat
  (sub-)group. Parameters are counted as stored: a tied embedding once, position embeddings in
  (``shared.models.structure.count_params`` leaves them out because it counts FLOPs, not bytes).
* Tensor parallelism splits the matrices (Megatron / torchtitan plans, see
  ``shared/parallel/tp.py``) and replicates norms and row-parallel biases on every TP rank.

Activations - Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), section 4, bytes per transformer layer with 16-bit activations,
sequence s, micro-batch b, hidden h, heads a, tensor-parallel size t:

    no parallelism             s*b*h * (34 + 5*a*s/h)
    tensor parallel            s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel s*b*h/t * (34 + 5*a*s/h)
    selective recomputation    drops the 5*a*s/h term (attention scores, softmax, dropout)
    full recomputation         keeps only the layer input, 2*s*b*h (2*s*b*h/t with SP)

plus the output layer and loss, 4*s*b*h*(1 + v/h) (/t with SP; the paper's section 4 on the
output layer, as in ``megatron/training/theoretical_memory_usage.py``). The 34 is 18 + 4*f/h
with f = 4h the MLP width (24 = 8 + 4*f/h under TP); the planner keeps that general form and
counts a gated (SwiGLU) MLP's inner activations twice (it stores the w1 and w3 outputs, the
SiLU and the product, where GELU stores two). The formulas include dropout masks and a full
K (GQA stores less): upper bounds for Llama-style models. Flash attention (PyTorch SDPA on
GPU) does not store the a*s*s scores either: model it with ``--recompute selective``. fp32
activations double everything but the logits, which the loss keeps in fp32 anyway.

Buffers - what the frameworks hold besides the model states, stated where it matters:
torch DDP keeps its all-reduce buckets as a second copy of the gradients
(``gradient_as_bucket_view=False`` is the default); DeepSpeed ZeRO-1/2 casts each rank's
gradient partition to fp32 for the step and reduces through a bucket of
``reduce_bucket_size`` (5e8) elements; FSDP2 and ZeRO-3 gather the unsharded parameters of the
block being computed and of the one prefetched, plus that block's unsharded gradients before
the reduce-scatter, and the root module's (embeddings) for the whole step (``apply_fsdp`` does
not reshard the root after forward).

The total is a conservative sum: activations are freed during the backward while gradients
fill in, so a real peak is somewhat lower.

Modules: ``specs`` (the model: tensors, presets, config.json, counts), ``hardware`` (precision
and GPU presets), ``activations`` and ``memory`` (the math above, per strategy), ``recommend``
(the decision framework), ``render`` (table and JSON), ``cli`` (``python -m shared.planner``).
"""

from shared.planner.activations import (
    RECOMPUTE,
    activation_bytes,
    layer_activation_bytes,
    output_activation_bytes,
)
from shared.planner.cli import build_parser, main
from shared.planner.hardware import PRECISIONS, Precision
from shared.planner.memory import (
    STRATEGY_KEYS,
    Estimate,
    Settings,
    estimate_all,
    model_state_per_rank,
    zero_paper_bytes_per_gpu,
)
from shared.planner.recommend import Recommendation, recommend
from shared.planner.render import COLUMNS, Plan, make_plan, render_table, to_json
from shared.planner.specs import (
    ModelSpec,
    Tensor,
    from_counts,
    from_hf_config,
    from_preset,
    preset_names,
)
from shared.planner.units import format_size, parse_size

__all__ = [
    "COLUMNS", "PRECISIONS", "RECOMPUTE", "STRATEGY_KEYS", "Estimate", "ModelSpec", "Plan",
    "Precision", "Recommendation", "Settings", "Tensor", "activation_bytes", "build_parser",
    "estimate_all", "format_size", "from_counts", "from_hf_config", "from_preset",
    "layer_activation_bytes", "main", "make_plan", "model_state_per_rank",
    "output_activation_bytes", "parse_size", "preset_names", "recommend", "render_table",
    "to_json", "zero_paper_bytes_per_gpu",
]  # fmt: skip
