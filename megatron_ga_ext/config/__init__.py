"""Configuration: every flag we add or read, GAConfig, add_args, and the one resolver of a launch's batch
schedule. Pure Python: imports core, never torch or megatron."""
