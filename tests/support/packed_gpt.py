"""Megatron-LM's pretrain_gpt.py (of the root the launch runs from, unchanged) with the
sequence-packing scheduler on the CPU: two stand-ins for what only Transformer Engine gives it
there, then the script as ``__main__``. Used by tests/e2e/test_packing.py, for the extension's run
and upstream's reference alike.

1. TransformerConfig refuses ``sequence_packing_scheduler`` below Transformer Engine 2.9 ("SFT
   sequence packing requires Transformer Engine >= 2.9.0", a guard against TE's THD kernels before
   2.9): here its check reads 2.9.
2. The local attention (DotProductAttention) refuses ``packed_seq_params`` (THD needs TE's
   attention): here the attention drops them, so each packed micro-batch is attended as one causal
   sequence (its samples see earlier samples of the same micro-batch). The model differs from TE's
   THD attention; the batch arithmetic (which samples a step trains on, how many micro-batches, the
   token counts) does not, and both runs of a comparison use it.

Everything else (the varlen dataset and its loader, ``wrap_data_iterator``, the packed get_batch,
the loss function, ``train()``) is upstream's own code.
"""

import functools
import os
import runpy
import sys

import megatron.core.transformer.transformer_config as transformer_config
from megatron.core.transformer.attention import Attention

TE_VERSION_FOR_PACKING = "2.9.0"


def _te_min_version(original):
    @functools.wraps(original)
    def is_te_min_version(version, *args, **kwargs):
        return version == TE_VERSION_FOR_PACKING or original(version, *args, **kwargs)

    return is_te_min_version


def _without_packed_seq_params(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        kwargs.pop("packed_seq_params", None)
        return original(self, *args, **kwargs)

    return forward


def main() -> None:
    root = os.getcwd()  # the Megatron-LM root (the launch's working directory)
    transformer_config.is_te_min_version = _te_min_version(transformer_config.is_te_min_version)
    Attention.forward = _without_packed_seq_params(Attention.forward)
    sys.path.insert(
        0, root
    )  # pretrain_gpt.py's own imports (gpt_builders, model_provider) resolve there
    script = os.path.join(root, "pretrain_gpt.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
