"""``python -m megatron_ga_ext.cli.main``: the same as ``megatron-ga``."""

import sys

from megatron_ga_ext.cli.main import main

sys.exit(main())
