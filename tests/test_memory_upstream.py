"""core/memory.py and core/flops.py against upstream's own numbers, run from the Megatron-LM
snapshots (``make oracle-memory``; marker ``oracle``): report_theoretical_memory's
weights-and-optimizer and activation MiB, and num_floating_point_operations per step, on every
configuration of tests/support/memory_cases.py.

Where the ledger goes beyond upstream (precisions other than bf16 + fp32 main state,
Megatron-FSDP, full recompute, CP), that quantity is compared only where upstream models it
(docs/memory.md): CP by upstream's formula at seq_length / CP, the rest not at all.
"""

import json
import os

import pytest

from megatron_ga_ext.core.flops import step_flops
from megatron_ga_ext.core.memory import MiB, memory
from tests.support.memory_cases import CASES, flops_args, upstream_args
from tests.support.memory_upstream import REFS, load, tarball

pytestmark = pytest.mark.oracle

#: Relative tolerance: the same formula, summed in another order.
RTOL = 1e-12


def _relative(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / max(abs(theirs), 1e-30)


@pytest.fixture(scope="module", params=REFS)
def upstream(request):
    if not tarball(request.param).exists():
        pytest.skip(f"no Megatron-LM snapshot {tarball(request.param)} (MEGATRON_LM_SNAPSHOTS)")
    return load(request.param)


def test_at_least_30_configurations():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


def test_equal_to_upstream(upstream, tmp_path_factory):
    """Every case, each quantity upstream models: equal to 1e-12; the count and the largest
    difference recorded (printed, and as JSON under .cache/results where MEGATRON_GA_RESULTS
    names a folder)."""
    worst = {"weights_and_optimizer": 0.0, "activations": 0.0, "flops": 0.0}
    counted = dict.fromkeys(worst, 0)
    for case in CASES:
        ga = case.num_microbatches
        ours = memory(
            case.model, case.par, case.precision, case.micro_batch_size, ga, case.recompute
        )
        weights, acts = upstream.memory_mib(upstream_args(case), ga)
        flops = upstream.num_floating_point_operations(flops_args(case), case.global_batch_size)
        pairs = {"flops": (step_flops(case.model, case.global_batch_size), flops)}
        default = case.precision.fsdp_sharding is None and not case.precision.fp8_param_gather
        if default:
            pairs["weights_and_optimizer"] = (ours.weights_and_optimizer / MiB, weights)
        if case.upstream_models_activations:
            pairs["activations"] = (ours.activations_peak / MiB, acts)
        for key, (mine, theirs) in pairs.items():
            diff = _relative(mine, theirs)
            assert diff <= RTOL, (
                f"{upstream.ref} {case.id} {key}: ours {mine!r}, upstream {theirs!r}"
            )
            worst[key] = max(worst[key], diff)
            counted[key] += 1
    summary = {
        "ref": upstream.ref,
        "configurations": len(CASES),
        "compared": counted,
        "largest_relative": worst,
    }
    print(json.dumps(summary))
    results = os.environ.get("MEGATRON_GA_RESULTS")
    if results:
        os.makedirs(results, exist_ok=True)
        with open(os.path.join(results, f"oracle_memory_{upstream.ref}.json"), "w") as out:
            json.dump(summary, out, indent=2)
    assert (
        counted["weights_and_optimizer"] >= 30
        and counted["activations"] >= 30
        and counted["flops"] >= 30
    )
