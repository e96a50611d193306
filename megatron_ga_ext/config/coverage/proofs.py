"""The tests that prove coverage rows, and the words a row uses where none does yet. Pure Python."""

from __future__ import annotations

from megatron_ga_ext.config.coverage.row import Proof

__all__ = [
    "E2E",
    "FAULTS",
    "GPU_GRAPHS",
    "MOE_LOOP",
    "MOE_MTP",
    "NOT_YET",
    "NO_GPU",
    "ON_GPU",
    "PACKING",
    "PACKING_E2E",
    "PACKING_FAULT",
    "RESUME",
    "TOKEN_LOOP",
    "VERIFY",
    "verify_layouts",
]

E2E = "tests/e2e/test_pretrain_gpt.py::"
MOE_MTP = "tests/e2e/test_moe_mtp.py::"
FAULTS = "tests/e2e/test_faults.py::"
GPU_GRAPHS = "tests/gpu/test_cuda_graphs.py::"
VERIFY = "tests/test_verify.py::test_verify_command_end_to_end"
PACKING = "tests/test_packing_scheduler.py::test_upstream_train_step_with_the_packing_scheduler_through_install"
PACKING_E2E = "tests/e2e/test_packing.py::test_pretrain_gpt_trains_the_schedulers_packed_steps"
PACKING_FAULT = "tests/e2e/test_packing.py::test_a_pp_multiplied_packed_count_is_stopped"
TOKEN_LOOP = (
    Proof(test=E2E + "test_token_mode_equals_upstream_per_token_loss[dp2]"),
    Proof(test=E2E + "test_token_mode_equals_upstream_per_token_loss[pp2dp2]"),
)
MOE_LOOP = (
    Proof(test=MOE_MTP + "test_moe_token_mode_counts_loss_tokens[EP 1 allgather]"),
    Proof(test=MOE_MTP + "test_moe_token_mode_counts_loss_tokens[EP 2 alltoall]"),
)


def verify_layouts(*layouts: str) -> tuple[Proof, ...]:
    """Rows of ``megatron-ga verify``: each layout in both modes against an unpartitioned
    reference."""
    return tuple(Proof(test=VERIFY, case=layout) for layout in layouts)


NO_GPU = "no test here runs it (it needs a GPU)"
ON_GPU = "proven by a GPU-marked test that CPU CI does not run"
NOT_YET = "no test runs it yet"
RESUME = (
    Proof(
        test="tests/e2e/test_resume.py::test_a_resume_at_every_step_boundary_runs_the_uninterrupted_steps"
    ),
    Proof(test="tests/e2e/test_noise_scale.py::test_a_resume_continues_the_emas"),
    Proof(test="tests/e2e/test_batch_warmup.py::test_a_resume_replays_the_decisions"),
)
