"""The end-to-end tier: Megatron-LM's own pretrain_gpt.py through install() (make e2e)."""
