"""The gradient-equivalence harness behind ``megatron-ga verify``: real megatron-core on gloo ranks
against unpartitioned references.

Modules: ``models`` (tiny GPT and a position-wise model), ``layouts`` (layouts and the synthetic
batch), ``references`` (single-process reference gradients), ``harness`` (what a rank runs), ``aux``
(the MoE router's auxiliary-loss coefficients). The gloo launcher and the CPU shims are in
``megatron_ga_ext.testing``. Importing this package imports neither torch nor megatron.
"""
