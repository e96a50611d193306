"""Issue 51's branched runs and warmup arms (benchmarks/critical_batch_plan.py plans and costs them),
trained by benchmarks/critical_batch.py's ``Sweep`` into its cache: ``--phase branch`` and
``--phase arms``.

* ``branch`` (Merrill et al.'s local critical batch): per seed of BRANCH_SEEDS a constant GBS 8
  trunk to max(BRANCH_AT) + BRANCH_SAMPLES samples, saved every BRANCH_SAVE_EVERY samples; from
  each BRANCH_AT point a branch to each larger size of BRANCH_SIZES for BRANCH_SAMPLES more, loaded
  from the trunk's checkpoint there (``--ckpt-step``, the trunk's optimizer and LR schedule) with the
  warmup's own mechanism: a
  ``--step-batch-size-schedule`` that switches 8 -> GBS at the branch point and ``--ga-lr-scaling
  sqrt``. The trunk after a branch point is that point's GBS 8 branch. Every run evaluates every
  EVAL_SAMPLES samples.
* ``arms``: constant GBS 8, ``--ga-batch-size-warmup auto`` (trust 1, up to GBS 64, sqrt LR) and a
  fixed step schedule at the adaptive arm's median doubling points (read from their traces, so
  it runs after them), at ARM_SEEDS, every one with a linear decay to 0 over the last DECAY_SHARE
  of the samples (Megatron's WSD style), evaluated every WARMUP_EVAL_STEPS steps.
"""

from __future__ import annotations

from benchmarks.critical_batch_plan import (
    ARM_SEEDS,
    BRANCH_AT,
    BRANCH_SAMPLES,
    BRANCH_SEEDS,
    BRANCH_SIZES,
    DECAY_SHARE,
    doubling_points,
)

#: The trunk's checkpoint interval in samples (every branch point is a multiple).
BRANCH_SAVE_EVERY = 1024
#: The evaluation interval of trunks and branches, in samples.
EVAL_SAMPLES = 128
#: The start size of trunks and arms, and its micro-batch (DP 2: every stage divides by 2 x 4).
START, MICRO_BATCH = 8, 4
ARM_MAX = 64


def schedule(stages: list[tuple[int, int]], seq_length: int) -> str:
    """``--step-batch-size-schedule`` from (samples, GBS) stages: thresholds in tokens."""
    return " ".join(f"{samples * seq_length}:{gbs}" for samples, gbs in stages)


def decay(samples: int) -> tuple[str, ...]:
    """Constant, then linear to 0 over the last DECAY_SHARE of ``samples`` (later flags win)."""
    return (
        "--lr-decay-style",
        "WSD",
        "--lr-wsd-decay-style",
        "linear",
        "--lr-decay-samples",
        str(samples),
        "--lr-wsd-decay-samples",
        str(round(samples * DECAY_SHARE)),
        "--min-lr",
        "0",
    )


def branches(sweep, lr: float, seq_length: int) -> None:
    """The trunks and their branches (module docstring), at the start size's best ``lr``."""
    end = max(BRANCH_AT) + BRANCH_SAMPLES
    for seed in BRANCH_SEEDS:
        checkpoints = sweep.out / f"trunk-gbs{START}-seed{seed}-checkpoints"
        sweep.train(
            f"trunk-gbs{START}-seed{seed}",
            START,
            lr,
            seed,
            "trunk",
            ("--ckpt-format", "torch", "--save", str(checkpoints), "--save-interval",
             str(BRANCH_SAVE_EVERY // START)),
            samples=end,
            interval=EVAL_SAMPLES // START,
        )  # fmt: skip
        for at in BRANCH_AT:
            for gbs in BRANCH_SIZES:
                if gbs == START:
                    continue  # the trunk itself
                stages = schedule([(0, START), (at, gbs)], seq_length)
                sweep.train(
                    f"branch{at}-gbs{gbs}-seed{seed}",
                    gbs,
                    lr,
                    seed,
                    "branch",
                    ("--step-batch-size-schedule", stages, "--ga-lr-scaling", "sqrt",
                     "--micro-batch-size", str(MICRO_BATCH), "--ckpt-format", "torch",
                     "--load", str(checkpoints), "--ckpt-step", str(at // START),
                     # the trunk's LR schedule (Megatron checks its sample counts on load)
                     "--use-checkpoint-opt_param-scheduler"),
                    samples=at + BRANCH_SAMPLES,
                    interval=max(1, EVAL_SAMPLES // gbs),
                )  # fmt: skip


def arms(sweep, lr: float, samples: int, seq_length: int, eval_steps: int) -> None:
    """The three arms (module docstring) at the start size's best ``lr``: the adaptive arm at every
    seed first, then the fixed schedule from its doubling points."""
    warmup = (
        "--ga-batch-size-warmup", "auto", "--ga-batch-size-warmup-max", str(ARM_MAX),
        "--ga-batch-size-warmup-trust", "1", "--ga-lr-scaling", "sqrt",
    )  # fmt: skip
    for seed in ARM_SEEDS:
        for arm, extra in (("constant", ()), ("adaptive", warmup)):
            name = f"{arm}-gbs{START}-decay-seed{seed}"
            sweep.train(
                name, START, lr, seed, "arms", (*extra, *decay(samples)), interval=eval_steps
            )
    runs = [sweep.cached(f"adaptive-gbs{START}-decay-seed{s}") for s in ARM_SEEDS]
    points = doubling_points({"runs": runs}, prefix="adaptive-")
    fixed = (
        "--step-batch-size-schedule", schedule([(0, START), *points], seq_length),
        "--ga-lr-scaling", "sqrt",
    )  # fmt: skip
    for seed in ARM_SEEDS:
        sweep.train(
            f"fixed-gbs{START}-decay-seed{seed}",
            START,
            lr,
            seed,
            "arms",
            (*fixed, *decay(samples)),
            interval=eval_steps,
        )
