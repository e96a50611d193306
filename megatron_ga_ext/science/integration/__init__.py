"""The batch-size science in the run (torch + megatron-core): the NoiseScale and BatchSchedule
features, the meter, the warmup and the scaled rates. install() imports these only where a
``--ga-*`` flag of theirs asks (FEATURES)."""
