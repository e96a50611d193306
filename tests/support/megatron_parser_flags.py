"""Print {snapshot: [option strings]} of Megatron-LM's own parser at each source snapshot given, as
JSON.

Run by tests/test_megatron_flags_upstream.py and tools/regress.py in a subprocess (``python -m
tests.support.megatron_parser_flags ROOT...``): each snapshot's parser is built one after another in
one process (tests/support/snapshot_parser.py).
"""

import json
import sys
import warnings

from tests.support.snapshot_parser import install_stubs, option_strings, parser_of

warnings.filterwarnings("ignore")
install_stubs()
print(json.dumps({root: option_strings(parser_of(root)) for root in sys.argv[1:]}))
