"""The oracle: Megatron-LM's own ``parse_args`` + ``validate_args`` + num-microbatches calculator +
``TransformerConfig`` run on launch lines, with CPU stand-ins, to hold ``megatron-ga check`` to
upstream's verdicts (``make oracle``) and to answer ``megatron-ga check --megatron PATH``.

``runner`` and ``agreement`` are pure Python; ``worker`` (with ``standins`` and ``stubs``) runs only
in the subprocess ``runner`` starts, where torch and the Megatron-LM tree are imported.
"""
