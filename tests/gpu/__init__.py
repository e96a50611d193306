"""The GPU tier: Megatron-LM's own pretrain_gpt.py on one CUDA device (pytest -m gpu tests/gpu)."""
