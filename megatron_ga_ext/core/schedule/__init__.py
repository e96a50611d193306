"""Step batch-size schedules: parsing, stages, rampup conversion, checks against a layout,
tables."""
