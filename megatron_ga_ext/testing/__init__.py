"""Test support, reached only from tests and ``verify``: the CPU shims megatron-core needs, the gloo launcher,
and the server that forks Megatron-LM's own training loop for the end-to-end tier. Never imported by install()."""
