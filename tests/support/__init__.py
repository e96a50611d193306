"""What the tests use but do not test: input generators, Megatron-LM parser readers run in
subprocesses, and the end-to-end tier's launcher and plans. Nothing here is collected by pytest."""
