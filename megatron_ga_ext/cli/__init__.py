"""The ``megatron-ga`` command: ledger | check | schedule | verify."""
