"""``--ga-noise-scale`` on real megatron-core, through install(), against per-example gradients of
the tiny GPT.

At a fixed point (the verify model's weights, no optimizer step), a population of sequences and each
one's exact summed gradient S_i = d/dw sum of its loss tokens' losses (one backward per sequence on
the unpartitioned model: the per-example gradients torch.func would give; megatron's fused cross
entropy has no vmap rule). Each step draws a global batch from the population with replacement and
runs megatron's own schedule and DDP, with the extension's finalize and bucket hook, on every rank
of the layout.

1. Every measured step equals its reference exactly (the plumbing): with replica r's samples and b_r
   loss tokens,
   |g_r|^2 = |sum_{i in r} S_i / b_r|^2 and |g|^2 = |sum_i S_i / N|^2 give the estimate science/core/noise_scale.py
   computes (relative 1e-5 on the two norms). Unequal lengths, so the b_r differ: DP 2, DP 4, PP 2 x
   DP 2 (the tied embedding left out, as the meter leaves it out), TP 2 x DP 2 (a shard of the same
   weights per rank: verify's models initialise a TP shard as its chunk of the whole parameter;
   duplicates counted once), DP 2 with the distributed optimizer and overlapped grad reduce.
2. Its cost in host reads and collectives: a measured step adds one all-reduce and one host read
   (the meter's), a step it does not measure adds none.
3. The estimate is unbiased against the truth: with full-length sequences of T tokens, per-sample
   means s_i = S_i / T, the truth is |G|^2 = |mean s_i|^2 and tr(Sigma) = T tr(Cov s) per token (Cov
   over the population, 1/P); the mean of the per-step estimates over many steps is within 4
   standard errors of both.

"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

pytestmark = pytest.mark.slow

SEQ = 16
POPULATION = 24
EXACT_STEPS = 3
UNBIASED_STEPS = 300


def meter(state):
    """The installation's noise-scale meter (its NoiseScale feature's), or None without
    --ga-noise-scale."""
    from megatron_ga_ext.science.integration.noise_scale_feature import NoiseScale

    feature = state.feature(NoiseScale)
    return None if feature is None else feature.meter


def _layouts(world: int):
    from megatron_ga_ext.verify.layouts import Layout

    if world == 2:
        return [
            Layout(data_parallel_size=2, num_microbatches=2),
            Layout(
                data_parallel_size=2,
                num_microbatches=2,
                overlap_grad_reduce=True,
                distributed_optimizer=True,
            ),
        ]
    return [
        Layout(data_parallel_size=4, num_microbatches=2),
        Layout(pipeline_model_parallel_size=2, data_parallel_size=2, num_microbatches=2),
        Layout(tensor_model_parallel_size=2, data_parallel_size=2, num_microbatches=2),
    ]


def _population(lengths):
    from megatron_ga_ext.verify.layouts import make_global_batch
    from megatron_ga_ext.verify.models import ModelConfig

    model = ModelConfig(seq_length=SEQ)
    return model, make_global_batch(tuple(lengths), SEQ, model.vocab_size, seed=7)


def _per_sample_sums(model, population, *, tied: bool):
    """[P, n] summed gradients S_i and [P] loss tokens b_i, on the unpartitioned model (every rank
    alike)."""
    import torch
    from megatron.core import parallel_state

    from megatron_ga_ext.verify.models import build_gpt, init_model_parallel, transformer_config

    init_model_parallel()
    try:
        module, names = build_gpt(
            model,
            transformer_config(model, calculate_per_token_loss=False),
            pre_process=True,
            post_process=True,
        )
        params = [
            p
            for n, p in module.named_parameters()
            if tied or names[n] != "embedding.word_embeddings.weight"
        ]
        rows = []
        for i in range(population.tokens.shape[0]):
            losses = module(
                population.tokens[i : i + 1],
                population.position_ids[i : i + 1],
                None,
                labels=population.labels[i : i + 1],
                loss_mask=population.loss_mask[i : i + 1],
            )
            grads = torch.autograd.grad((losses * population.loss_mask[i : i + 1]).sum(), params)
            rows.append(torch.cat([g.reshape(-1) for g in grads]).double())
        return torch.stack(rows), population.loss_mask.sum(dim=1).double()
    finally:
        parallel_state.destroy_model_parallel()


def _draw(generator, size: int):
    import torch

    return torch.randint(0, POPULATION, (size,), generator=generator)


HOST_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")


class _Counting:
    """Host reads (Tensor methods) and torch.distributed.all_reduce calls while on, a call inside
    another not twice."""

    def __init__(self) -> None:
        import torch

        self.counts = {"host_reads": 0, "all_reduces": 0}
        self.patched = [(torch.Tensor, name, "host_reads") for name in HOST_READS]
        self.patched.append((torch.distributed, "all_reduce", "all_reduces"))
        self.depth = 0

    def __enter__(self):
        self.originals = [(owner, name, getattr(owner, name)) for owner, name, _ in self.patched]
        for (owner, name, key), (_, _, original) in zip(self.patched, self.originals):
            setattr(owner, name, self._counter(original, key))
        return self.counts

    def __exit__(self, *exc) -> None:
        for owner, name, original in self.originals:
            setattr(owner, name, original)

    def _counter(self, original, key):
        def counted(*args, **kwargs):
            self.counts[key] += self.depth == 0
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted


def _run(
    layout,
    model,
    population,
    draws,
    noise_scale: int = 1,
    counts: list | None = None,
    ddp_config=None,
):
    """The layout's measurements, one per draw (the global batch's population indices), through
    install(); with ``counts``, each step's host reads and all-reduces (the step and the meter's
    read) appended to it."""
    from functools import partial

    import torch
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state

    import megatron_ga_ext
    from megatron_ga_ext import GAConfig
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import build_chunks
    from megatron_ga_ext.verify.layouts import GlobalBatch
    from megatron_ga_ext.verify.models import init_model_parallel
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from megatron_ga_ext.verify.step import train_step

    cfg = VerifyConfig(layouts=(layout,), model=model)
    init_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
    )
    state = megatron_ga_ext.install(
        GAConfig(
            noise_scale=noise_scale,
            noise_scale_decay=0.0,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        )
    )
    calculators.init_num_microbatches_calculator(
        0, None, layout.global_batch_size, layout.micro_batch_size, layout.data_parallel_size
    )
    try:
        chunks, _, config = build_chunks(
            layout, cfg, calculate_per_token_loss=True, ddp_config=ddp_config
        )
        from megatron.core.distributed import (
            finalize_model_grads,
        )  # the extension's, after install()

        measured = []
        for rows in draws:
            batch = GlobalBatch(
                *(
                    getattr(population, f)[rows]
                    for f in ("tokens", "labels", "loss_mask", "position_ids")
                )
            )
            with _Counting() as counted:
                train_step(
                    chunks,
                    config,
                    layout,
                    cfg,
                    batch,
                    finalize=finalize_model_grads,
                    loss_func=partial(masked_loss, mode="token"),
                )
                measurement = meter(state).read() if meter(state) is not None else None
            if counts is not None:
                counts.append(dict(counted))
            measured.append(
                None
                if measurement is None
                else (
                    measurement.estimate.trace_sigma,
                    measurement.estimate.grad_sq,
                    measurement.replicas,
                )
            )
        return measured
    finally:
        megatron_ga_ext.uninstall()
        calculators.unset_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
        torch.distributed.barrier()


def _refusals(world: int, model, population, generator) -> dict[str, str | None]:
    """A megatron-core loop (no Megatron-LM args) where the meter cannot measure: the OptionError of
    its first forward/backward call, by case (None: it ran)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ga_ext.errors import OptionError
    from megatron_ga_ext.verify.layouts import Layout

    cases = {}
    if world == 2:
        cases["tp2-dp1"] = (
            Layout(tensor_model_parallel_size=2, data_parallel_size=1, num_microbatches=2),
            None,
        )
        if "param_name_patterns_for_fp32_local_accumulation" in {
            f.name for f in dataclasses.fields(DistributedDataParallelConfig)
        }:
            cases["fp32-all"] = (
                Layout(data_parallel_size=2, num_microbatches=2),
                DistributedDataParallelConfig(
                    param_name_patterns_for_fp32_local_accumulation=("all",)
                ),
            )
    else:
        cases["cp2-dp2"] = (
            Layout(
                context_parallel_size=2,
                data_parallel_size=2,
                num_microbatches=2,
                model="positionwise",
            ),
            None,
        )  # CP on the CPU: the local impl has no CP attention
    out = {}
    for name, (layout, ddp_config) in cases.items():
        try:
            _run(
                layout,
                model,
                population,
                [_draw(generator, layout.global_batch_size)],
                ddp_config=ddp_config,
            )
            out[name] = None
        except OptionError as error:
            out[name] = str(error)
    return out


def _rank(world: int):
    """Every layout of this world size: exact steps on unequal lengths, then (DP 2) the unbiasedness
    run, and the refused layouts."""
    import torch

    from megatron_ga_ext.testing.shims import cpu_shims

    lengths = [1 + (7 * i) % SEQ for i in range(POPULATION)]
    with cpu_shims():
        model, population = _population(lengths)
        sums = {tied: _per_sample_sums(model, population, tied=tied) for tied in (True, False)}
        out = {}
        generator = torch.Generator().manual_seed(11)
        for layout in _layouts(world):
            draws = [_draw(generator, layout.global_batch_size) for _ in range(EXACT_STEPS)]
            out[layout.name] = {
                "draws": [d.tolist() for d in draws],
                "measured": _run(layout, model, population, draws),
                "tied": layout.pipeline_model_parallel_size == 1,
            }
        out["refused"] = _refusals(world, model, population, generator)
        if world == 2:
            layout = _layouts(2)[0]
            draws = [_draw(generator, layout.global_batch_size) for _ in range(4)]
            out["counts"] = {}
            for noise_scale in (0, 2):
                out["counts"][noise_scale] = []
                _run(layout, model, population, draws, noise_scale, out["counts"][noise_scale])
            full_model, full = _population([SEQ] * POPULATION)
            full_sums = _per_sample_sums(full_model, full, tied=True)
            layout = _layouts(2)[0]
            draws = [_draw(generator, layout.global_batch_size) for _ in range(UNBIASED_STEPS)]
            out["unbiased"] = {
                "measured": _run(layout, full_model, full, draws),
                "sums": full_sums[0],
            }
        return out, {tied: (s.numpy(), b.numpy()) for tied, (s, b) in sums.items()}


@pytest.fixture(scope="module")
def runs():
    return {
        world: run_on_ranks(_rank, world, (world,), LaunchConfig(timeout_s=900))[0]
        for world in (2, 4)
    }


def _reference(sums, counts, rows, layout):
    """(A, |g|^2, b_r) of the draw ``rows``: replica r holds micro-batch m's samples (m DP + r) MBS
    + j."""
    import numpy as np

    replica_sums, replica_counts = [], []
    for r in range(layout.data_parallel_size):
        mine = [
            rows[layout.sample(m, r, j)]
            for m in range(layout.num_microbatches)
            for j in range(layout.micro_batch_size)
        ]
        replica_sums.append(sums[mine].sum(axis=0))
        replica_counts.append(int(counts[mine].sum()))
    total = sum(replica_counts)
    local = [float(np.dot(s, s)) / b**2 for s, b in zip(replica_sums, replica_counts)]
    reduced = sum(replica_sums)
    return local, float(np.dot(reduced, reduced)) / total**2, replica_counts


def _version() -> str:
    from megatron_ga_ext.integration.compat import megatron_core_version

    return megatron_core_version()


@pytest.mark.parametrize("world", [2, 4])
def test_every_measured_step_equals_its_per_example_reference(runs, world):
    from megatron_ga_ext.science.core.noise_scale import replica_estimate
    from tools.results import record

    out, sums = runs[world]
    for layout in _layouts(world):
        result = out[layout.name]
        assert len(result["measured"]) == EXACT_STEPS and None not in result["measured"], (
            layout.name
        )
        errors: dict[str, list[float]] = {"reduced": [], "local": []}
        for rows, (trace, grad_sq, replicas) in zip(result["draws"], result["measured"]):
            local, reduced, counts = _reference(*sums[result["tied"]], rows, layout)
            assert len(set(counts)) > 1, "the draw should give the replicas unequal token counts"
            expected = replica_estimate(local, reduced, counts)
            total = sum(counts)
            excess = sum(1 / b for b in counts) / len(counts) - 1 / total
            # the two measured norms, recovered from the estimate: |g|^2 = |G|^2 + tr/N, A = |g|^2 +
            # tr (h - 1/N)
            measured_reduced = grad_sq + trace / total
            measured_local = measured_reduced + trace * excess
            assert replicas == layout.data_parallel_size
            assert measured_reduced == pytest.approx(reduced, rel=1e-5), layout.name
            assert measured_local == pytest.approx(sum(local) / len(local), rel=1e-5), layout.name
            assert trace == pytest.approx(
                expected.trace_sigma, rel=1e-3, abs=1e-6 * abs(expected.trace_sigma)
            ), layout.name
            errors["reduced"].append(abs(measured_reduced / reduced - 1))
            errors["local"].append(abs(measured_local / (sum(local) / len(local)) - 1))
        record(
            "noise-scale-gpt",
            [
                {
                    "megatron-core": _version(),
                    "Layout": layout.name,
                    "Measured steps": f"{EXACT_STEPS}, unequal b_r",
                    "norm(g)^2: worst relative error": f"{max(errors['reduced']):.1e}",
                    "mean norm(g_r)^2: worst relative error": f"{max(errors['local']):.1e}",
                }
            ],
        )


def test_the_estimates_are_unbiased_against_the_truth_of_the_population(runs):
    import numpy as np

    unbiased = runs[2][0]["unbiased"]
    samples = unbiased["sums"].numpy() / SEQ  # s_i, the per-sample mean gradients
    mean = samples.mean(axis=0)
    true_grad_sq = float(mean @ mean)
    true_trace = SEQ * float(((samples - mean) ** 2).sum(axis=1).mean())
    estimates = np.array([m[:2] for m in unbiased["measured"]])
    assert len(estimates) == UNBIASED_STEPS
    shown = []
    for column, truth, name in ((0, true_trace, "tr(Sigma)"), (1, true_grad_sq, "norm(G)^2")):
        values = estimates[:, column]
        error = values.std(ddof=1) / np.sqrt(len(values))
        assert abs(values.mean() - truth) < 4 * error, (name, values.mean(), truth, error)
        assert error < 0.25 * abs(truth), (
            name,
            error,
            truth,
        )  # the run is long enough to say something
        shown.append(
            f"{name}: truth {truth:.4g}, mean estimate {values.mean():.4g} +- {error:.2g} "
            f"({(values.mean() - truth) / error:+.1f} SE)"
        )
    from tools.results import record

    record(
        "noise-scale-gpt",
        [
            {
                "megatron-core": _version(),
                "Layout": f"{_layouts(2)[0].name}, full-length population",
                "Measured steps": f"{UNBIASED_STEPS}",
                "Against the truth": "; ".join(shown),
            }
        ],
    )


def test_a_measured_step_adds_one_all_reduce_and_one_host_read_the_others_nothing(runs):
    """--ga-noise-scale 2 against the same steps without it: steps 1 and 3 are not measured, 2 and 4
    are."""
    counts = runs[2][0]["counts"]
    off, every_other = counts[0], counts[2]
    assert len(off) == len(every_other) == 4
    for step, (without, measured) in enumerate(zip(off, every_other), 1):
        extra = 1 if step % 2 == 0 else 0
        assert measured == {
            "host_reads": without["host_reads"] + extra,
            "all_reduces": without["all_reduces"] + extra,
        }, (step, without, measured)


REFUSED = {
    "tp2-dp1": "--ga-noise-scale 1 with data-parallel size 1: the estimate compares each "
    "replica's gradient",
    "fp32-all": "--ga-noise-scale with --ddp-param-name-patterns-for-fp32-local-accumulation "
    "all: the parameters it "
    "names accumulate",
    "cp2-dp2": "--ga-noise-scale with --context-parallel-size 2: the CP shards of one sequence",
}
CORE_LOOP = (
    "(A megatron-core loop: the setting as parallel_state and the model's DDP and Transformer "
    "configs hold it"
)


def test_a_megatron_core_loop_is_refused_where_the_meter_cannot_measure(runs):
    """Without Megatron-LM's args install() has no flags to refuse: the first forward/backward call
    reads the same settings from megatron-core (DP 1, CP 2, fp32 local accumulation where the
    release has it)."""
    refused = {
        name: message for world in (2, 4) for name, message in runs[world][0]["refused"].items()
    }
    assert {"tp2-dp1", "cp2-dp2"} <= set(refused), refused
    for name, message in refused.items():
        assert message is not None and message.startswith(REFUSED[name]) and CORE_LOOP in message, (
            name,
            message,
        )
