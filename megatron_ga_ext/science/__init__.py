"""The batch-size science: the gradient noise scale (``--ga-noise-scale``), the critical batch fit
(``megatron-ga critical-batch``), the schedule it suggests (``schedule --suggest``), the batch-size
warmup and the learning-rate windows it respects. Loaded only by what uses it: an install without
these flags, and the ``ledger``, ``check`` and ``schedule`` commands without ``--suggest``, never
import it (tests/test_architecture.py).

    core/   pure Python, stdlib only: the estimator and its EMAs, the trace rows, the windows, the fit, the rule
    cli/    ``schedule --suggest`` and ``critical-batch``
"""
