"""jobs/ddp's training loop without Ray, for ``make bench``'s Ray Train vs torchrun comparison.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/torchrun_ddp.py storage_path=runs/bench run_name=torchrun max_steps=20

Same config parsing and profile (``shared.config.profiles.GPT2_AG_NEWS``), the same generated corpus
and tokenizer, the same model, ``DDPStrategy`` and ``shared.loop.train`` - only the session
differs: batches come from the packed blocks in memory (rank r takes every world-th
micro-batch) instead of a Ray Data shard, and there is no Ray cluster to start. Rank 0 prints
the same ``SUMMARY {json}`` line a job prints and writes metrics.jsonl to the run directory.

``BENCH_LAUNCH_TIME`` (seconds since the epoch, set by the benchmark just before it starts
torchrun) makes ``time_to_first_step_s`` count from the launch, as a job's does.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from shared.config import TrainConfig, parse_args
from shared.config.profiles import GPT2_AG_NEWS
from shared.data import resolve_text_source, tokenizer_spec
from shared.loop import train
from shared.models.gpt2 import build_gpt2
from shared.observability import startup
from shared.parallel.ddp import DDPStrategy, apply_ddp
from shared.runtime.torchrun import TorchrunSession, init_distributed, packed_blocks, rank_batches
from shared.runtime.worker import seed_everything


def smoke_corpus(cfg, rank: int, world_size: int) -> tuple[torch.Tensor, dict]:
    """The smoke corpus as [N, seq_len] token blocks. Rank 0 generates it (a no-op when a job
    already did, in the same storage path) while the others wait."""
    if rank == 0:
        source = resolve_text_source(cfg)
    if world_size > 1:
        dist.barrier()
    if rank != 0:
        source = resolve_text_source(cfg)
    blocks = packed_blocks(source.dataset, source.tokenizer, cfg.text_column, cfg.seq_len)
    return blocks, tokenizer_spec(source.tokenizer)


def main() -> None:
    cfg = parse_args("ddp", TrainConfig, GPT2_AG_NEWS, description=__doc__)
    cfg.driver_start_time = float(os.environ.get("BENCH_LAUNCH_TIME", cfg.driver_start_time))
    rank, world_size, device = init_distributed(getattr(cfg, "collective_timeout_s", 1800.0))
    startup.mark(cfg, "worker_start")  # processes and process group up (see startup.py)
    try:
        blocks, spec = smoke_corpus(cfg, rank, world_size)
        startup.mark(cfg, "data_ready")
        seed_everything(cfg.seed)  # identical initial weights on every rank, as in a job
        model = build_gpt2(cfg.model, spec["vocab_size"], cfg.seq_len, cfg.pretrained,
                           spec["eos_token_id"])  # fmt: skip
        model = apply_ddp(model, device)
        strategy = DDPStrategy(model, cfg, device, torch.float32)
        # The jobs' epoch order and global batches, read from memory instead of Ray Data.
        reader = rank_batches(blocks, cfg.micro_batch_size, rank, world_size, seed=cfg.seed,
                              global_batch=cfg.global_batch_size,
                              chunk_rows=cfg.pack_chunk_rows)  # fmt: skip
        session = TorchrunSession(reader, os.path.join(cfg.run_dir, "checkpoints"),
                                  cfg.micro_batch_size, rank, world_size, device)  # fmt: skip
        started = time.time()
        summary = train(cfg, strategy, session)
        if rank == 0:
            summary |= {"job": "ddp-torchrun", "status": "succeeded", "run_dir": cfg.run_dir,
                        "wall_s": round(time.time() - cfg.driver_start_time, 2),
                        "train_s": round(time.time() - started, 2)}  # fmt: skip
            print(f"SUMMARY {json.dumps(summary, default=str)}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
