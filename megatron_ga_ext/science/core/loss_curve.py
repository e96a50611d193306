"""A run's loss curve, read from Megatron-LM's log, and the step and sample at which it first
reaches a loss. Pure Python: ``megatron-ga critical-batch`` reads its runs with it
(science/core/critical_batch.py fits them).

Megatron-LM's ``training_log`` prints, every ``--log-interval`` iterations,

    [2026-01-01 10:00:00.000000] iteration      200/    1000 | consumed samples:         3200 | ... |
    learning rate: 1.000000E-03 | global batch size:    16 | lm loss: 3.214567E+00 | loss scale: 1.0 | ...

(the loss averaged over the interval's iterations), and ``evaluate_and_print_results``, every
``--eval-interval``,

    validation loss at iteration 200 | lm loss value: 3.301234E+00 | lm loss PPL: 2.714586E+01 |

(``... at iteration N on validation set`` after training; ``validation-0 loss at iteration N`` where
the run has ``--multiple-validation-sets``, which 0.19's ``--full-validation`` needs: its first set;
a second set's ``validation-1`` line and the test set's line are not read). A run's samples at an
iteration are the consumed samples of Megatron's line of that iteration, else of the last one before
it plus the global batch size per step since.

**Reaching a target** (:func:`first_reach`): the first logged point whose loss is at or below it, at
that point's step and samples; with ``interpolate``, the step and samples linearly interpolated in
the loss between that point and the one logged before it. **Smoothing** the training loss
(:func:`smooth`): an exponential moving average over the logged points in order, ema_k = d x
ema_(k-1) + (1 - d) x loss_k, started at the first point's loss; d is per logged point (per
``--log-interval``), not per step.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from megatron_ga_ext.errors import CriticalBatchError
from megatron_ga_ext.science.core.noise_trace import MEGATRON_LINE

__all__ = ["LossCurve", "LossPoint", "first_reach", "read_megatron_log", "smooth"]

GLOBAL_BATCH = re.compile(r"\| global batch size:\s+(\d+) \|")
VALIDATION_LINE = re.compile(
    r"\bvalidation(?:-0)? loss at iteration (\d+)(?: on validation set)?(?= \|)"
)


@dataclass(frozen=True, kw_only=True)
class LossPoint:
    """One logged loss: at ``iteration`` steps and ``consumed_samples`` samples."""

    iteration: int
    consumed_samples: int
    loss: float


@dataclass(frozen=True, kw_only=True)
class LossCurve:
    """One run at one global batch size: its logged training and validation losses, in iteration
    order."""

    source: str
    global_batch_size: int
    train: tuple[LossPoint, ...]
    validation: tuple[LossPoint, ...]
    skipped: int = 0
    """Logged losses that were not finite numbers (Megatron's nan iterations), left out."""


def read_megatron_log(lines: Iterable[str], source: str, loss_name: str = "lm loss") -> LossCurve:
    """The curve of a Megatron-LM run's stdout log (module docstring). A resumed run's log repeats
    iterations: the later copy is kept. Refused: a log with no iteration line giving the global
    batch size, a run whose global batch size changes (a rampup or a schedule: the fit needs one
    batch size per run)."""
    train_loss = re.compile(r"\| " + re.escape(loss_name) + r": (\S+) \|")
    value_loss = re.compile(r"\| " + re.escape(loss_name) + r" value: (\S+) \|")
    consumed: dict[int, int] = {}
    train: dict[int, float] = {}
    validation: dict[int, float] = {}
    sizes: dict[int, int] = {}
    for line in lines:
        if (megatron := MEGATRON_LINE.search(line)) is not None:
            iteration = int(megatron.group(1))
            consumed[iteration] = int(megatron.group(2))
            if (size := GLOBAL_BATCH.search(line)) is not None:
                sizes[iteration] = int(size.group(1))
            if (loss := train_loss.search(line)) is not None:
                train[iteration] = _number(loss.group(1))
        elif (valid := VALIDATION_LINE.search(line)) and (
            loss := value_loss.search(line, valid.end())
        ):
            validation[int(valid.group(1))] = _number(loss.group(1))
    if not sizes:
        raise CriticalBatchError(
            f"RUN {source} is neither a Megatron-LM log (it has no iteration line with a global "
            "batch size, "
            '"iteration N/ M | consumed samples: ... | global batch size: B |") nor a '
            "TensorBoard directory; give the run's stdout log or its --tensorboard-dir."
        )
    batch = _one_batch_size(source, sizes)
    return curve(source, batch, consumed, train, validation)


def curve(
    source: str,
    batch: int,
    consumed: dict[int, int],
    train: dict[int, float],
    validation: dict[int, float],
) -> LossCurve:
    """The curve from losses by iteration and the consumed samples Megatron logged by iteration
    (module docstring: samples between logged iterations count ``batch`` per step)."""
    logged = sorted(consumed)

    def samples(iteration: int) -> int:
        if iteration in consumed:
            return consumed[iteration]
        k = bisect.bisect_left(logged, iteration)
        return (
            consumed[logged[k - 1]] + (iteration - logged[k - 1]) * batch
            if k
            else iteration * batch
        )

    def points(losses: dict[int, float]) -> tuple[LossPoint, ...]:
        return tuple(
            LossPoint(iteration=i, consumed_samples=samples(i), loss=losses[i])
            for i in sorted(losses)
            if math.isfinite(losses[i])
        )

    skipped = sum(not math.isfinite(v) for v in (*train.values(), *validation.values()))
    return LossCurve(
        source=source,
        global_batch_size=batch,
        train=points(train),
        validation=points(validation),
        skipped=skipped,
    )


def _one_batch_size(source: str, sizes: dict[int, int]) -> int:
    values = sorted(set(sizes.values()))
    if len(values) > 1:
        first = {size: min(i for i, s in sizes.items() if s == size) for size in values}
        shown = ", ".join(f"{size:,} from iteration {first[size]:,}" for size in values[:4])
        raise CriticalBatchError(
            f"RUN {source}: its global batch size changes ({shown}); the fit of S and E against "
            "B needs each run at one global batch size (no --rampup-batch-size or step "
            "schedule): give runs at a fixed batch size."
        )
    return values[0]


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def smooth(points: tuple[LossPoint, ...], decay: float) -> tuple[LossPoint, ...]:
    """The exponential moving average of the module docstring, at each logged point."""
    if not 0 <= decay < 1:
        raise CriticalBatchError(
            f"--train-loss-smoothing {decay!r} must be an EMA decay in [0, 1), e.g. 0.9 (0: "
            "the logged losses as they are)."
        )
    out, ema = [], math.nan
    for k, point in enumerate(points):
        ema = point.loss if k == 0 else decay * ema + (1 - decay) * point.loss
        out.append(
            LossPoint(iteration=point.iteration, consumed_samples=point.consumed_samples, loss=ema)
        )
    return tuple(out)


def first_reach(
    points: tuple[LossPoint, ...], target: float, interpolate: bool = False
) -> tuple[float, float] | None:
    """(steps, samples) at which the curve first reaches ``target`` (module docstring), or None if
    it never does."""
    for k, point in enumerate(points):
        if point.loss <= target:
            if not interpolate or k == 0 or points[k - 1].loss == point.loss:
                return float(point.iteration), float(point.consumed_samples)
            before = points[k - 1]
            share = (before.loss - target) / (before.loss - point.loss)
            return (
                before.iteration + share * (point.iteration - before.iteration),
                before.consumed_samples
                + share * (point.consumed_samples - before.consumed_samples),
            )
    return None
