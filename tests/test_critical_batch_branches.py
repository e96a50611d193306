"""Issue 51's branched runs and warmup arms: the flags benchmarks/critical_batch_phases.py trains
them with (nothing trains here), the local critical batch benchmarks/critical_batch_local.py
measures from branches that follow a known hyperbola, and benchmarks/critical_batch_arms.py's
paired intervals."""

from __future__ import annotations

import math
import random
import statistics
from types import SimpleNamespace

import pytest

from benchmarks import critical_batch_arms as arms
from benchmarks import critical_batch_local as local
from benchmarks import critical_batch_phases as phases
from benchmarks.critical_batch_plan import BRANCH_AT, BRANCH_SAMPLES, BRANCH_SIZES

#: The local critical batch of the made-up trunk at each branch point.
LOCAL_B_CRIT = {1024: 12.0, 2048: 24.0, 4096: 48.0}


def trunk_loss(samples: float) -> float:
    return 2.0 + math.exp(-samples / 3000)


def branch_curve(at: int, gbs: int, noise: float) -> list[list[float]]:
    """Absolute (iteration, samples, loss) every 128 samples from ``at``: step s of GBS B reaches
    the trunk's loss at ``at`` + 8 s (1 + B_crit / 8) / (1 + B_crit / B) samples, so the steps to
    any loss follow the hyperbola S(B) = S_min (1 + B_crit / B) (GBS 8: the trunk itself)."""
    rate = (1 + LOCAL_B_CRIT[at] / 8) / (1 + LOCAL_B_CRIT[at] / gbs) * math.exp(noise)
    out = []
    for samples in range(at + 128, at + BRANCH_SAMPLES + 1, 128):
        steps = (samples - at) / gbs
        out.append([at // 8 + steps, samples, trunk_loss(at + 8 * steps * rate)])
    return out


def made_up() -> dict:
    """Two seeds' GBS 8 trunks, evaluated every 128 samples, and their branches to 16, 32 and 64
    (with a little noise); the trunk's trace gives B_simple = samples / 100."""
    rng, runs = random.Random(5), []
    for seed in (1, 2):
        trunk = [[i * 16, i * 128, trunk_loss(i * 128)] for i in range(1, 49)]
        for at in BRANCH_AT:
            for gbs in BRANCH_SIZES[1:]:
                curve = branch_curve(at, gbs, rng.gauss(0, 0.03))
                runs.append(
                    {"name": f"branch{at}-gbs{gbs}-seed{seed}", "curve": [*curve, curve[-1]]}
                )
        trace = [
            {"consumed_samples": s, "grad_sq": 1.0, "trace_sigma": s / 100 * 64,
             "tokens_per_sample": 64.0}
            for s in range(32, 6145, 32)
        ]  # fmt: skip
        runs.append({"name": f"trunk-gbs8-seed{seed}", "curve": trunk, "trace": trace})
    return {"runs": runs}


def test_the_branches_start_at_the_trunks_evaluation_and_count_from_there():
    found = local.branches(made_up())
    assert sorted(found) == list(BRANCH_AT) and sorted(found[2048][1]) == list(BRANCH_SIZES)
    gbs32 = found[2048][1][32]
    assert gbs32[0] == [0, 0, pytest.approx(trunk_loss(2048))]  # the trunk at 2,048 samples
    assert gbs32[-1][:2] == [BRANCH_SAMPLES / 32, BRANCH_SAMPLES]  # the repeat dropped
    assert found[2048][1][8][-1][:2] == [BRANCH_SAMPLES / 8, BRANCH_SAMPLES]  # the trunk after it


def test_the_local_critical_batch_recovers_each_points_hyperbola_and_reads_b_simple():
    points = local.local(made_up())
    assert [p["at"] for p in points] == list(BRANCH_AT)
    for point in points:
        truth = LOCAL_B_CRIT[point["at"]]
        assert len(point["fits"]) == local.LOCAL_TARGETS
        for fit in point["fits"]:
            assert fit["b_crit"] is not None, fit["reason"]
            assert fit["low"] <= truth <= fit["high"], fit
        assert local.summary(point) == pytest.approx(truth, rel=0.15)
        assert point["b_simple"] == pytest.approx(point["at"] / 100, rel=0.02)
        assert local.ratio(point) == pytest.approx(point["b_simple"] / local.summary(point))


class Recorder:
    """Stands in for benchmarks/critical_batch.py's Sweep: records what would train."""

    def __init__(self, tmp_path) -> None:
        self.out, self.calls = tmp_path, []

    def train(self, name, gbs, lr, seed, phase, extra=(), long=False, samples=None, interval=None):
        self.calls.append(SimpleNamespace(**locals()))
        return {"name": name}

    def cached(self, name):
        """An adaptive run's record: seed s doubles at 2,000 + 200 (s - 1) and 4,000 + 200 (s - 1)
        samples."""
        seed = int(name.rsplit("seed", 1)[1])
        return {"name": name, "gbs": 8, "trace": self.trace(200 * (seed - 1))}

    @staticmethod
    def trace(shift: int) -> list[dict]:
        rows, samples, iteration = [], 0, 0
        while samples < 8192:
            gbs = 8 if samples < 2000 + shift else 16 if samples < 4000 + shift else 32
            rows.append({"iteration": iteration, "consumed_samples": samples})
            samples, iteration = samples + gbs, iteration + 1
        return rows


def flag(call, name: str) -> str:
    return call.extra[call.extra.index(name) + 1]


def test_the_branches_load_the_trunk_at_the_point_and_switch_by_schedule(tmp_path):
    sweep = Recorder(tmp_path)
    phases.branches(sweep, 0.003138, 64)
    trunk, *rest = sweep.calls
    assert trunk.name == "trunk-gbs8-seed1" and trunk.samples == max(BRANCH_AT) + BRANCH_SAMPLES
    assert flag(trunk, "--save-interval") == "128" and trunk.interval == 16
    branch = next(c for c in rest if c.name == "branch2048-gbs32-seed1")
    assert flag(branch, "--step-batch-size-schedule") == f"0:8 {2048 * 64}:32"
    assert flag(branch, "--ckpt-step") == "256" and flag(branch, "--load") == flag(trunk, "--save")
    assert flag(branch, "--ga-lr-scaling") == "sqrt" and branch.lr == 0.003138  # x sqrt(32 / 8)
    assert branch.samples == 2048 + BRANCH_SAMPLES and branch.interval == 4
    assert "--use-checkpoint-opt_param-scheduler" in branch.extra  # the trunk's LR schedule
    assert len(sweep.calls) == 2 * (1 + len(BRANCH_AT) * (len(BRANCH_SIZES) - 1))


def test_the_fixed_arm_doubles_at_the_adaptive_arms_median_points_and_all_decay(tmp_path):
    sweep = Recorder(tmp_path)
    phases.arms(sweep, 0.003138, 8192, 64, 16)
    fixed = [c for c in sweep.calls if c.name.startswith("fixed-")]
    assert len(fixed) == 10 and len(sweep.calls) == 30
    at16, at32 = (statistics.median(a + 200 * s for s in range(10)) for a in (2000, 4000))
    assert (
        flag(fixed[0], "--step-batch-size-schedule") == f"0:8 {at16 * 64:.0f}:16 {at32 * 64:.0f}:32"
    )
    for call in sweep.calls:
        assert flag(call, "--lr-decay-style") == "WSD" and flag(call, "--min-lr") == "0"
        assert flag(call, "--lr-wsd-decay-samples") == str(round(8192 * 0.2))


def arm(name: str, seed: int, shift: float, final: float) -> dict:
    curve = [[i * 16, i * 128, 3.0 - 0.02 * i - shift * (i > 2)] for i in range(1, 65)]
    return {
        "name": f"{name}-gbs8-decay-seed{seed}",
        "steps": 1024,
        "curve": [*curve, [1024, 8192, final]],
    }


def test_the_arms_are_compared_in_pairs_by_seed():
    """The adaptive arm is 0.05 lower from the third evaluation on at every seed (plus noise), the
    fixed arm equals the constant one: the paired interval of adaptive - constant holds its steps
    saved and excludes 0; fixed - constant is 0."""
    rng = random.Random(1)
    runs = []
    for seed in range(1, 11):
        runs.append(arm("constant", seed, 0.0, 1.80))
        runs.append(arm("fixed", seed, 0.0, 1.80))
        runs.append(arm("adaptive", seed, 0.05 + rng.gauss(0, 0.005), 1.78 + rng.gauss(0, 0.002)))
    out = arms.analyse_arms({"plan": {"warmup_samples": 512}, "runs": runs})
    assert len(out["targets"]) == arms.ARM_TARGETS
    saved = out["pairs"]["adaptive - constant"]
    assert all(p["high"] < 0 and p["seeds"] == 10 for p in saved["steps"][:-1])
    assert saved["final"]["low"] < -0.02 < saved["final"]["high"] < 0
    same = out["pairs"]["fixed - constant"]
    assert all(p["mean"] == 0 == p["low"] == p["high"] for p in same["steps"])
    assert out["arms"]["fixed"][3]["final"] == 1.80
