"""The models the jobs train: GPT-2 presets from transformers (``gpt2``) and a Llama-style model
written here for tensor parallelism (``llama``). Import the module you need: each pulls in
torch, and ``gpt2`` also transformers, which a Llama run never needs."""
