"""The pure-Python core, stdlib only: numbers, Megatron's flags, the batch layout and its rules,
step schedules."""
