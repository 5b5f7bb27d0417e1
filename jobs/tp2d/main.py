"""A Llama-style model on Wikitext with 2D parallelism: tensor parallel x FSDP data parallel.

Each layer's matrices are split across the ``tp`` ranks of a TP group (one node); the TP-sharded
model is then sharded again with FSDP across the ``dp`` groups. ``num_workers = dp x tp``.

    make run-local JOB=tp2d                         # smoke: dp=2 x tp=2 on 4 CPU workers
    make run-local JOB=tp2d ARGS="dp=1 tp=2 num_workers=2"
    make run-local JOB=tp2d PROFILE=full            # ~500M Llama, wikitext-103, 2 nodes x 4 GPUs
"""

from __future__ import annotations

import ray

from shared.config import TP2DConfig, parse_args
from shared.loop import train
from shared.models.llama import build_llama
from shared.parallel.fsdp import apply_fsdp
from shared.parallel.tp import TP2DStrategy, TPGroupSession, apply_tp, device_mesh_2d, placement
from shared.precision import resolve_dtype
from shared.runtime.driver import train_on_text
from shared.runtime.worker import RaySession, seed_everything

# The train split only: the directory also holds validation-* and test-* parquet files.
WIKITEXT_103_TRAIN = "hf://datasets/Salesforce/wikitext/wikitext-103-raw-v1/train-*.parquet"

PROFILES = {
    # 4 workers on 2 cores: a quarter CPU each leaves one for Ray Data's tokenisation.
    "smoke": dict(
        model="llama-tiny", dp=2, tp=2, num_workers=4, cpus_per_worker=0.25, seq_len=64,
        micro_batch_size=8, grad_accum=1, max_steps=30, lr=3e-3, warmup_steps=3,
        checkpoint_every=10, log_every=5, smoke_rows=1000,
    ),
    # ~500M parameters on 2 nodes x 4 GPUs: TP inside each node, FSDP across the two.
    "full": dict(
        model="llama-500m", dp=2, tp=4, num_workers=8, use_gpu=True, cpus_per_worker=8,
        dataset=WIKITEXT_103_TRAIN, tokenizer="gpt2", seq_len=2048, micro_batch_size=8,
        grad_accum=4, max_steps=5000, lr=3e-4, warmup_steps=200, checkpoint_every=500,
        log_every=20, max_failures=3, export_at_end=True, eval_every=500,
        eval_dataset=WIKITEXT_103_TRAIN.replace("train-", "validation-"),
    ),
}  # fmt: skip


def train_loop_per_worker(config: dict) -> None:
    cfg: TP2DConfig = config["cfg"]
    # Each rank reads 1/tp of its dp rank's micro-batch, then TP peers all-gather it
    # (TPGroupSession): the unit of the data order is the dp rank.
    session = RaySession(cfg, config["packed"], batch_size=cfg.micro_batch_size // cfg.tp)
    mesh = device_mesh_2d(session.device, cfg.dp, cfg.tp)
    table = placement(mesh, ray.get_runtime_context().get_node_id()[:12])
    if session.rank == 0:
        print("rank -> node, (dp, tp):", flush=True)
        for row in table:
            print(
                f"  rank {row['rank']}: node {row['node']}  (dp={row['dp']}, tp={row['tp']})",
                flush=True,
            )

    seed_everything(cfg.seed)  # identical initial weights on every rank before sharding
    model = build_llama(cfg.model, config["vocab_size"]).to(session.device)
    # The strategy: TP inside each TP group, then FSDP over the dp axis of the same mesh.
    model = apply_tp(model, mesh["tp"])
    dtype = resolve_dtype(cfg.dtype, session.device)
    model = apply_fsdp(
        model,
        mesh["dp"],
        param_dtype=dtype,
        reduce_dtype=resolve_dtype(cfg.reduce_dtype, session.device),
        reshard_after_forward=cfg.reshard_after_forward,
        cpu_offload=cfg.cpu_offload,
        blocks_per_group=cfg.blocks_per_group,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    train(cfg, TP2DStrategy(model, cfg, session.device, dtype), TPGroupSession(session, mesh["tp"]))


def main() -> None:
    cfg = parse_args("tp2d", TP2DConfig, PROFILES, description=__doc__)
    train_on_text(cfg, train_loop_per_worker)


if __name__ == "__main__":
    main()
