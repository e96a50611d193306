"""The batch-size science's commands: ``schedule --suggest`` and ``critical-batch`` (loaded on
demand by cli/)."""
