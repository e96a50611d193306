"""Megatron's sequence-packing scheduler (#6742, main after d98e8a64): the micro-batch guard follows
the count the scheduler passes, the sample accounting still holds.

With ``--sequence-packing-scheduler dp_balanced`` (``--use-varlen-dataset`` selects it), upstream's
``train_step`` calls ``wrap_data_iterator(data_iterator, config, get_num_microbatches())``: the
step's GBS samples, fetched as num_microbatches = GBS / (MBS x DP) micro-batches per rank, are
rerouted over the DP ranks and repacked into the scheduler's own number of THD micro-batches, and
the schedule is called with that number. Consumed samples still advance by DP x MBS x
get_num_microbatches() = GBS.

pretrain_gpt.py cannot run packed sequences on the CPU: TransformerConfig refuses
``sequence_packing_scheduler`` without Transformer Engine >= 2.9 ("SFT sequence packing requires
Transformer Engine >= 2.9.0"), and the local attention refuses ``packed_seq_params``. So the
distributed test here drives upstream's own ``train_step`` (the source's
``megatron.training.training``, with upstream's ``wrap_data_iterator`` and schedule, through
install()) on 2 gloo ranks, with a position-wise model (no attention, so a packed micro-batch's
token losses are the unpacked samples' own), the scheduler's fields set on the model config after it
is built, and the lines of ``train()`` around each step (the calculator update before, consumed
samples after). It holds that:

* the packed count varies per step and differs from GBS / (MBS x DP), and the guard accepts it:
  every step runs exactly the scheduler's count;
* consumed samples advance by exactly GBS per step (the calculator guard), and so does the
  learning-rate increment;
* the token contract per packed step: N in finalize is the step's loss tokens over all GBS samples,
  and the finalized gradient equals the unpartitioned token-level gradient of those samples;
* a schedule call with another count than the scheduler's is stopped before it reads the packed
  iterator.

A source without the scheduler skips it; the unit tests run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from megatron_ga_ext.cli.main import main
from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.guards import MicrobatchCounter, check_microbatch_counts

ROOT = Path(__file__).resolve().parent.parent
GBS, MBS, DP = 16, 1, 2
NUM_MICROBATCHES = GBS // (MBS * DP)
MAX_SEQLEN = 32  # --max-seqlen-per-dp-cp-rank: a packed micro-batch holds up to 32 tokens
#: The samples' lengths, per step: short samples pack many to a micro-batch, long ones few.
LENGTH_RANGES = ((2, 6), (12, 16), (4, 16), (2, 16), (8, 12))


class _Calculator:
    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches

    def get(self) -> int:
        return self.num_microbatches


# -- the guard's count under the scheduler (no megatron)
# ----------------------------------------------------


def _ran(counter: MicrobatchCounter, num_microbatches: int, chunks: int = 1) -> None:
    counter.reset()
    for chunk in range(chunks):
        for _ in range(num_microbatches):
            counter.count(f"chunk{chunk}")


def test_the_guard_follows_the_schedulers_count_then_the_calculators_again():
    counter, calculator = MicrobatchCounter(), _Calculator(NUM_MICROBATCHES)
    for packed in (3, 5, 1, NUM_MICROBATCHES + 4):
        counter.schedule(packed, NUM_MICROBATCHES)
        counter.check_scheduled(packed)
        _ran(counter, packed, chunks=2)
        counter.check(packed, calculator)
    assert counter.scheduled is None  # taken by its call
    _ran(counter, NUM_MICROBATCHES)
    counter.check(
        NUM_MICROBATCHES, calculator
    )  # no scheduler for this call: GBS / (MBS x DP) again
    with pytest.raises(
        GuardError, match="the calculator's num_microbatches = GBS / \\(MBS x DP\\) is 8"
    ):
        _ran(counter, 3)
        counter.check(3, calculator)


def test_an_evaluation_call_checks_the_schedulers_count_too():
    counter = MicrobatchCounter()
    counter.schedule(2, 4)
    _ran(counter, 2)
    counter.check(2, None)  # forward_only: no calculator count, the scheduler's is known
    _ran(counter, 3)
    counter.check(3, None)  # nothing scheduled: not known, each chunk ran the call's count


@pytest.mark.parametrize("wrong", [NUM_MICROBATCHES, 2, 4])
def test_a_call_with_another_count_than_the_schedulers_is_stopped_before_it_runs(wrong):
    counter = MicrobatchCounter()
    counter.schedule(3, NUM_MICROBATCHES)
    with pytest.raises(
        GuardError,
        match=r"num_microbatches=\d+, but the sequence-packing scheduler "
        r"\(--sequence-packing-scheduler\) packed this step's samples into 3 ",
    ):
        counter.check_scheduled(wrong)
    assert counter.scheduled is None  # the refused call took it: the next step's count is its own


def test_a_count_that_ran_short_after_the_scheduler_is_stopped_after_the_call():
    counter = MicrobatchCounter()
    counter.schedule(3)
    _ran(counter, 2)  # a schedule that ran fewer forward steps than it was called with
    with pytest.raises(GuardError, match="chunk 0: 2"):
        counter.check(3, _Calculator(NUM_MICROBATCHES))


@pytest.mark.parametrize("count", [0, -1, True, 2.0, None, "3"])
def test_the_schedulers_count_must_be_an_integer_of_at_least_one(count):
    with pytest.raises(
        GuardError, match=r"returned num_microbatches=.* from 8 fetched micro-batches per rank"
    ):
        MicrobatchCounter().schedule(count, NUM_MICROBATCHES)


def test_a_pp_multiplied_count_is_still_named_without_the_scheduler():
    with pytest.raises(GuardError, match="16 = 8 x PP 2"):
        check_microbatch_counts({"chunk": 16}, 16, 8, 2)


# -- megatron-ga check reads both flags
# -----------------------------------------------------------------------

PACKED_LINE = [
    "torchrun",
    "--nproc-per-node",
    "2",
    "-m",
    "megatron_ga_ext",
    "pretrain_gpt.py",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "16",
    "--seq-length",
    "4096",
    "--max-seqlen-per-dp-cp-rank",
    "8192",
    "--calculate-per-token-loss",
]


@pytest.mark.parametrize(
    "flags",
    [
        ["--use-varlen-dataset"],
        ["--sequence-packing-scheduler", "dp_balanced"],
        ["--use-varlen-dataset", "--sequence-packing-scheduler", "dp_balanced"],
    ],
    ids=["varlen", "scheduler", "both"],
)
def test_check_reads_the_packing_flags(flags, capsys):
    status = main(["check", "--json", "--", *PACKED_LINE, *flags])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["problems"] == [], report["problems"]
    notes = [
        n for n in report["notes"] if n["link"] == "docs/coverage.md#sequence-packing-scheduler"
    ]
    assert len(notes) == 1, report["notes"]


def test_check_without_the_extension_says_nothing_of_the_scheduler(capsys):
    line = [w for w in PACKED_LINE if w not in ("-m", "megatron_ga_ext")] + ["--use-varlen-dataset"]
    assert main(["check", "--json", "--", *line]) == 0
    assert not [
        n for n in json.loads(capsys.readouterr().out)["notes"] if "packing" in str(n["link"])
    ]


# -- upstream's train_step with the scheduler, through install() (2 gloo ranks)
# ---------------------------------


def _has_scheduler_in_train_step() -> bool:
    """The source's train_step runs the packing scheduler (Megatron-LM main after d98e8a64). Read,
    not imported: this process runs other tests, which must not find megatron.training loaded (the
    ranks import it)."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or spec.origin is None:
        return False
    training = (
        Path(spec.origin).parents[1] / "training" / "training.py"
    )  # none beside a megatron-core wheel
    return training.exists() and "wrap_data_iterator(data_iterator, config" in training.read_text()


def _samples(step: int) -> list[dict]:
    """Step ``step``'s GBS samples as plain lists, the same on every rank: lengths drawn from the
    step's range, about a fifth of the tokens masked out of the loss."""
    low, high = LENGTH_RANGES[step % len(LENGTH_RANGES)]
    rng = random.Random(1000 + step)
    samples = []
    for _ in range(GBS):
        length = rng.randint(low, high)
        tokens = [rng.randrange(64) for _ in range(length + 1)]
        mask = [0 if rng.random() < 0.2 else 1 for _ in range(length)]
        samples.append({"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": mask})
    return samples


def _megatron_argv() -> list[str]:
    return [
        "pretrain_gpt.py",
        "--micro-batch-size",
        str(MBS),
        "--global-batch-size",
        str(GBS),
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--vocab-size",
        "64",
        "--tokenizer-type",
        "NullTokenizer",
        "--mock-data",
        "--calculate-per-token-loss",
        "--use-varlen-dataset",
        "--max-seqlen-per-dp-cp-rank",
        str(MAX_SEQLEN),
        "--train-iters",
        str(len(LENGTH_RANGES)),
        "--lr",
        "0.01",
        "--distributed-backend",
        "gloo",
        "--transformer-impl",
        "local",
        "--no-gradient-accumulation-fusion",
        "--clip-grad",
        "0",
    ]


def packed_rank_main() -> dict:
    """One rank: Megatron-LM's args (its own parser and validate_args), install() from them,
    upstream's train_step for every step of :data:`LENGTH_RANGES`, then the calls with a wrong
    count."""
    from megatron_ga_ext.testing.shims import cpu_shims

    with cpu_shims(device_count=1):
        return _packed_rank_main()


def _packed_rank_main() -> dict:
    from functools import partial

    import torch
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.rerun_state_machine import (
        RerunDataIterator,
        RerunState,
        get_rerun_state_machine,
    )
    from megatron.training import arguments, global_vars, training

    import megatron_ga_ext
    from megatron_ga_ext.integration.features.guards import Guards
    from megatron_ga_ext.integration.lifecycle import installed
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import build_ddp
    from megatron_ga_ext.verify.layouts import Layout
    from megatron_ga_ext.verify.models import ModelConfig, build_positionwise, init_model_parallel
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from tests.support.step_values import recording_step_values

    saved_argv, sys.argv = sys.argv, _megatron_argv()
    try:
        args = arguments.parse_args(extra_args_provider=megatron_ga_ext.add_args)
    finally:
        sys.argv = saved_argv
    arguments.validate_args(args)
    assert args.sequence_packing_scheduler == "dp_balanced"  # --use-varlen-dataset chose it
    with recording_step_values():  # N of each step, as finalize hands it on
        state = megatron_ga_ext.install(args)
    global_vars.set_global_variables(args, build_tokenizer=False)
    init_model_parallel()
    dp_rank = parallel_state.get_data_parallel_rank()

    layout = Layout(data_parallel_size=DP, num_microbatches=NUM_MICROBATCHES, model="positionwise")
    ddp, _, config = build_ddp(
        layout, VerifyConfig(model=ModelConfig(seq_length=16)), calculate_per_token_loss=True
    )
    # TransformerConfig refuses the scheduler without Transformer Engine >= 2.9: set after it is
    # built, as the loop reads them (train_step: config.sequence_packing_scheduler;
    # wrap_data_iterator: max_seqlen_per_dp_cp_rank).
    config.sequence_packing_scheduler = args.sequence_packing_scheduler
    config.max_seqlen_per_dp_cp_rank = args.max_seqlen_per_dp_cp_rank
    config.variable_seq_lengths = True
    ddp.module.pg_collection = (
        ProcessGroupCollection.use_mpu_process_groups()
    )  # what a GPTModel carries
    from megatron.core.distributed import (
        finalize_model_grads,
    )  # the extension's, bound after install()

    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.01, clip_grad=0.0), [ddp]
    )
    increments: list[int] = []

    class LearningRate:  # stands in for OptimizerParamScheduler: the increments train_step gives it
        def step(self, increment: int) -> None:
            increments.append(increment)

    def rank_samples(step: int) -> list[dict]:
        """This rank's micro-batches of the step, as VarlenDataset gives them (one unpacked sample
        each)."""
        out = []
        for sample in _samples(step)[dp_rank * NUM_MICROBATCHES : (dp_rank + 1) * NUM_MICROBATCHES]:
            length = len(sample["tokens"])
            out.append(
                {
                    "tokens": torch.tensor(sample["tokens"]),
                    "labels": torch.tensor(sample["labels"]),
                    "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.float),
                    "position_ids": torch.arange(length),
                    "original_seq_len": torch.tensor([length]),
                    "padded_seq_len": torch.tensor([length]),
                }
            )
        return out

    def forward_step(data_iterator, model):
        packed = next(
            data_iterator
        )  # one THD micro-batch: the scheduler's concatenation of whole samples
        losses = model(
            packed["tokens"][None],
            packed["position_ids"][None],
            None,
            labels=packed["labels"][None],
        )
        return losses, partial(masked_loss, loss_mask=packed["loss_mask"][None])

    called: list[int] = []

    def recording(forward_backward_func, count=None):
        def call(**kwargs):
            called.append(kwargs["num_microbatches"])
            if count is not None:
                kwargs["num_microbatches"] = count(kwargs["num_microbatches"])
            return forward_backward_func(**kwargs)

        return call

    schedule = get_forward_backward_func()
    hooked = (
        getattr(training.wrap_data_iterator, "__wrapped__", None) is not None
    )  # install() wrapped it there
    rows, args.consumed_train_samples = [], 0
    calculators.update_num_microbatches(0, consistency_check=True)
    for step in range(
        len(LENGTH_RANGES)
    ):  # train()'s lines around each step (training.py, e8fef4ebb23e)
        calculators.update_num_microbatches(
            args.consumed_train_samples, consistency_check=False, verbose=True
        )
        calculators.update_num_microbatches(
            args.consumed_train_samples, consistency_check=True, verbose=True
        )
        args.curr_iteration = step
        before = build_positionwise(ModelConfig(seq_length=16), config)[0]
        before.load_state_dict(ddp.module.state_dict())
        iterator = RerunDataIterator(iter(rank_samples(step)))
        training.train_step(
            forward_step,
            iterator,
            [ddp],
            optimizer,
            LearningRate(),
            config,
            recording(schedule),
            iteration=step,
        )
        args.consumed_train_samples += (
            parallel_state.get_data_parallel_world_size()
            * args.micro_batch_size
            * calculators.get_num_microbatches()
        )
        grads = {name: param.main_grad.clone() for name, param in ddp.module.named_parameters()}
        rows.append(
            {
                "packed": called[-1],
                "forward_steps": sorted(state.feature(Guards).counter.counts.values()),
                "num_microbatches": calculators.get_num_microbatches(),
                "consumed": args.consumed_train_samples,
                "N": _step_tokens(state),
                "rel_err": _relative_error(grads, _reference_grads(before, _samples(step))),
            }
        )
    errors = []
    for name, count in (
        ("calculator's count", lambda packed: calculators.get_num_microbatches()),
        ("one fewer", lambda packed: packed - 1),
    ):
        iterator = RerunDataIterator(iter(rank_samples(0)))
        try:
            training.train_step(
                forward_step,
                iterator,
                [ddp],
                optimizer,
                LearningRate(),
                config,
                recording(schedule, count),
                iteration=len(rows),
            )
        except GuardError as error:
            errors.append((name, str(error)))
            get_rerun_state_machine().state = (
                RerunState.NOT_RUNNING_YET
            )  # Megatron would have stopped here
        else:
            errors.append((name, None))
    result = {
        "rows": rows,
        "increments": increments,
        "errors": errors,
        "hooked": hooked,
        "installed": installed() is state,
    }
    megatron_ga_ext.uninstall()
    result["restored"] = getattr(training.wrap_data_iterator, "__wrapped__", None) is None
    return result


def _reference_grads(module, samples: list[dict]) -> dict:
    """The unpartitioned token-level gradient of the step's samples: sum of every sample's masked
    token losses over the step's loss tokens N, through the model as it was before the step (each
    sample alone: no packing)."""
    import torch

    total = sum(sum(sample["loss_mask"]) for sample in samples)
    loss = 0.0
    for sample in samples:
        tokens = torch.tensor(sample["tokens"])[None]
        losses = module(
            tokens,
            torch.arange(tokens.shape[1])[None],
            None,
            labels=torch.tensor(sample["labels"])[None],
        )
        loss = (
            loss + (losses.reshape(-1) * torch.tensor(sample["loss_mask"], dtype=torch.float)).sum()
        )
    (loss / total).backward()
    return {name: param.grad for name, param in module.named_parameters()}


def _step_tokens(state) -> int | None:
    """N of the step: as the hooked optimizer was handed it, else finalize's verdict kept for a
    loop whose optimizer step install() did not see."""
    from tests.support.step_values import last_num_tokens

    tokens = last_num_tokens(state)
    if tokens is None and (verdict := state.take_verdict()) is not None:
        tokens = verdict.num_tokens
    return tokens


def _relative_error(grads: dict, reference: dict) -> float:
    import torch

    num = sum(float(torch.sum((grads[n] - reference[n]) ** 2)) for n in reference)
    den = sum(float(torch.sum(reference[n] ** 2)) for n in reference)
    return (num / den) ** 0.5


@pytest.mark.slow
def test_upstream_train_step_with_the_packing_scheduler_through_install():
    if not _has_scheduler_in_train_step():
        pytest.skip(
            "this source's train_step does not run the sequence-packing scheduler (Megatron-LM "
            "main after d98e8a64, #6742)"
        )
    from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

    result = run_on_ranks(packed_rank_main, world_size=DP, config=LaunchConfig(timeout_s=240))[0]
    rows = result["rows"]
    packed = [row["packed"] for row in rows]
    assert len(set(packed)) >= 3 and NUM_MICROBATCHES not in packed, (
        packed
    )  # the scheduler's own counts
    for step, row in enumerate(rows):
        assert row["forward_steps"] == [row["packed"]], (
            row
        )  # the guard accepted it: the call ran exactly that
        assert row["num_microbatches"] == NUM_MICROBATCHES and row["consumed"] == GBS * (
            step + 1
        ), row
        expected_tokens = sum(sum(sample["loss_mask"]) for sample in _samples(step))
        assert row["N"] == expected_tokens, (
            row
        )  # N over the packed step = the loss tokens of its GBS samples
        assert row["rel_err"] < 1e-6, (
            row
        )  # the packed step's gradient is the unpartitioned token-level one
    assert result["increments"] == [GBS] * len(
        rows
    )  # the learning rate advances by GBS samples per step
    assert result["hooked"] and result["installed"] and result["restored"], result
    (_, first_error), (_, second_error) = result["errors"]
    assert first_error and "packed this step's samples into" in first_error, result["errors"]
    assert second_error and "packed this step's samples into" in second_error, result["errors"]
