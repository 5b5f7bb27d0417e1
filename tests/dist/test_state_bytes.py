"""The planner's model-state bytes against what the real strategies hold, on 3 gloo ranks
(3 does not divide gpt2-tiny's 64-wide tensors, so FSDP2's dim-0 padding and DeepSpeed's
2 x N alignment both show). tests/dist/test_strategies.py checks the same on 2 ranks for
every strategy, through the shared loop."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared import planner
from shared.planner import from_preset

WORLD, VOCAB, SEQ = 3, 512, 64


def _measure_worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      DS_ACCELERATOR="cpu")  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from shared.config import FSDPConfig, ZeroConfig
        from shared.models.gpt2 import build_gpt2
        from shared.parallel.fsdp import FSDPStrategy, apply_fsdp, data_parallel_mesh
        from shared.parallel.zero import ZeroStrategy
        from shared.runtime.worker import seed_everything

        device, measured = torch.device("cpu"), {}
        batch = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(rank))
        for name in ("fsdp2", "zero1", "zero2", "zero3"):
            seed_everything(0)
            model = build_gpt2("gpt2-tiny", VOCAB, SEQ, eos_token_id=0)
            common = dict(model="gpt2-tiny", seq_len=SEQ, grad_accum=2, num_workers=WORLD)
            if name == "fsdp2":
                cfg = FSDPConfig(**common)
                model = apply_fsdp(model, data_parallel_mesh(device))
                strategy = FSDPStrategy(model, cfg, device, torch.float32)
            else:
                cfg = ZeroConfig(**common, zero_stage=int(name[-1]))
                strategy = ZeroStrategy(model, cfg, device, torch.float32)
            for micro in range(cfg.grad_accum):  # one accumulation window, as the smoke runs
                strategy.forward_backward(batch, sync=micro == cfg.grad_accum - 1)
            strategy.optimizer_step()
            measured[name] = strategy.measured_state_bytes
        if rank == 0:
            with open(os.path.join(out_dir, "measured.json"), "w") as f:
                json.dump(measured, f)
    finally:
        dist.destroy_process_group()


def test_planner_equals_measured_state_bytes_on_three_gloo_ranks(tmp_path):
    mp.spawn(_measure_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD)
    measured = json.loads((tmp_path / "measured.json").read_text())
    model = from_preset("gpt2-tiny", vocab=VOCAB, seq_len=SEQ)
    for name, state in measured.items():
        assert planner.model_state_per_rank(model, name, WORLD) == state, name
    # The padding is really there: 3 does not divide the state evenly.
    assert measured["fsdp2"]["params"] > 4 * model.n_params / WORLD
