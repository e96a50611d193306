"""Configuration: every flag we add or read (declared once, config/flags.py), GAConfig, add_args,
the one rule pass over a launch's settings (launch_rules.py), the typed view of Megatron's args
(megatron_args.py), and the one resolver of a launch's batch schedule. Pure Python: imports core,
never torch or megatron."""
