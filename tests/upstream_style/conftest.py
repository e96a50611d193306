"""Megatron-LM-style unit tests for patches/upstream (Megatron-LM's tests/unit_tests layout), run by
patches/upstream_check.py under torchrun on gloo, on a pristine or a patched megatron-core tree.

They test megatron-core's own code and fail on the pristine sources by design, so a plain ``pytest``
(``make test``) does not collect them: ``MEGATRON_GA_UPSTREAM_STYLE=1`` does. Megatron-LM's own
conftest (which downloads a dataset) is not used; the set-up is ``unit_tests/test_utilities.py``'s
(gloo, the CPU shims).
"""

import os

collect_ignore_glob = [] if os.environ.get("MEGATRON_GA_UPSTREAM_STYLE") else ["unit_tests/*"]
