"""The Megatron integration (torch and megatron-core): install(), the calculator, the guards, the
loss contract, finalize, the training-loop hooks, auxiliary losses, and the compatibility
fingerprints."""

# Megatron-LM's host (host.py) answers wherever its args are parsed, whichever module asks first.
from megatron_ga_ext.integration import megatron_lm  # noqa: F401
