"""What ``megatron-ga verify`` (a user's own proof) needs to run megatron-core on the CPU: the CPU
shims (shims.py) and the gloo launcher (distributed.py). Reached only from verify and the tests;
never imported by install(). The test-only support (fault injection, the end-to-end fork server, its
recorder) is tests/support/."""
