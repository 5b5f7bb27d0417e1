"""The GPT-2 + AG News profiles that ddp, fsdp and zero share, so the strategies train the
same model on the same data and can be compared step for step."""

# Held-out evaluation: the test split, never trained on.
AG_NEWS_TEST = "hf://datasets/fancyzhx/ag_news/data/test-00000-of-00001.parquet"

GPT2_AG_NEWS = {
    # Seconds on a laptop: ~0.1M-parameter GPT-2, 1000 generated news rows, 2 CPU workers with
    # half a CPU each (Ray Data needs the rest), accumulation on so the no-sync path runs.
    "smoke": dict(
        model="gpt2-tiny", seq_len=64, micro_batch_size=8, grad_accum=2, max_steps=30,
        lr=3e-3, warmup_steps=3, checkpoint_every=10, log_every=5, num_workers=2,
        cpus_per_worker=0.5, smoke_rows=1000,
    ),
    # GPT-2 124M fine-tuned on AG News (120k rows) from the hub: 4 GPUs, 32k tokens per step.
    "full": dict(
        model="gpt2", pretrained="gpt2", tokenizer="gpt2",
        dataset="hf://datasets/fancyzhx/ag_news/data/train-00000-of-00001.parquet",
        seq_len=1024, micro_batch_size=8, grad_accum=1, max_steps=2000, lr=6e-4,
        warmup_steps=100, checkpoint_every=500, log_every=20, num_workers=4, use_gpu=True,
        cpus_per_worker=8, max_failures=3, export_at_end=True,
        eval_every=200, eval_dataset=AG_NEWS_TEST,
    ),
}  # fmt: skip
