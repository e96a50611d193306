"""Gradient-equivalence harness: real megatron-core on gloo ranks against unpartitioned references.

    python -m megatron_ga_ext.verify            (megatron-ga verify)

Modules: ``launch`` (run a function on N gloo ranks), ``shims`` (the only CPU shims for megatron-core),
``models`` (tiny GPT and a position-wise model), ``layouts`` (layouts and the synthetic batch),
``references`` (single-process reference gradients), ``harness`` (what a rank runs), ``command`` (CLI).
Importing this package imports neither torch nor megatron.
"""
