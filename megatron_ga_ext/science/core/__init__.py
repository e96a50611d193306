"""The batch-size science's pure part: no torch, no megatron (tests/test_architecture.py)."""
