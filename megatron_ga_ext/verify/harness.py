"""What each rank of a verify launch does: references, then every layout in both modes.

For each layout of the launch (all of one world size) and each mode, a rank initialises megatron's
parallel state and num-microbatches calculator, calls ``megatron_ga_ext.install()`` with that mode
(the path a user takes), builds the tiny model (dense, MoE, MTP; one chunk per virtual pipeline
stage), wraps it in the layout's data-parallel wrapper (Megatron's DDP with overlapped grad reduce
and the distributed optimizer where the layout says so, torch FSDP2 or Megatron-FSDP:
data_parallel.py, which wires ``no_sync`` as Megatron-LM does), runs megatron's own schedule
(``get_forward_backward_func``) over its micro-batches with megatron's ``finalize_model_grads``
(install()'s) as the finalize hook, and compares its reduced gradients (grads.py) with the
unpartitioned references (references.py):

    rel_err(g, ref) = max over the parameters p this rank holds of  max |g_p - ref_p| / max |ref_p|

The loss function is the extension's :func:`masked_loss` helper; install() checks it in mode
``token`` and leaves upstream's arithmetic in mode ``microbatch``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.integration.finalize import make_finalize_model_grads
from megatron_ga_ext.integration.loss_contract import LossContract, masked_loss
from megatron_ga_ext.verify import upstream
from megatron_ga_ext.verify.data_parallel import ddp_config_of, wrap_chunk
from megatron_ga_ext.verify.grads import gradients
from megatron_ga_ext.verify.layouts import GlobalBatch, Layout, make_global_batch
from megatron_ga_ext.verify.models import (
    POSITIONWISE_GPT,
    UNTIED_GPT,
    ModelConfig,
    build_gpt,
    build_positionwise,
    init_model_parallel,
    transformer_config,
)
from megatron_ga_ext.verify.references import reference_grads
from megatron_ga_ext.verify.run_config import VerifyConfig
from megatron_ga_ext.verify.step import forward_step, train_step
from megatron_ga_ext.verify.upstream import check_unhooked

__all__ = [
    "LayoutResult",
    "build_chunks",
    "build_ddp",
    "gradients",
    "layout_config",
    "reduction_hooks",
    "relative_error",
    "run_layout",
    "run_rank",
]


@dataclass(frozen=True)
class LayoutResult:
    """One rank's result for one layout and mode."""

    layout: str
    mode: str
    rel_err_token: float
    rel_err_mean_of_means: float
    num_tokens: int | None
    seconds: float


def run_rank(cfg: VerifyConfig) -> list[LayoutResult]:
    """Run every layout and mode of ``cfg`` on this rank (the launcher has set up the process
    group)."""
    if cfg.device == "cpu":
        from megatron_ga_ext.testing.shims import cpu_shims

        with cpu_shims():
            return _run_all(cfg)
    torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    return _run_all(cfg)


def _run_all(cfg: VerifyConfig) -> list[LayoutResult]:
    """Every layout in every mode, in order; each global batch (the launch's, a layout's own) and
    its references made once."""
    batches, refs = {}, {}
    for lengths in dict.fromkeys(layout.lengths or cfg.lengths for layout in cfg.layouts):
        batches[lengths] = make_global_batch(lengths, cfg.model.seq_length, cfg.model.vocab_size)
        refs.update(
            reference_grads(
                cfg.model,
                [lay for lay in cfg.layouts if (lay.lengths or cfg.lengths) == lengths],
                batches[lengths],
                device=cfg.device,
            )
        )
    results = []
    for layout in cfg.layouts:
        batch = batches[layout.lengths or cfg.lengths]
        for mode in cfg.modes:
            start = time.perf_counter()
            if cfg.upstream:
                check_unhooked()
            grads, num_tokens = run_layout(layout, mode, cfg, batch, extension=not cfg.upstream)
            result = LayoutResult(
                layout.name,
                mode,
                relative_error(grads, refs[(layout.name, "token")]),
                relative_error(grads, refs[(layout.name, "mean_of_means")]),
                num_tokens,
                time.perf_counter() - start,
            )
            _progress(cfg, result)
            results.append(result)
    return results


def _progress(cfg: VerifyConfig, result: LayoutResult) -> None:
    if cfg.progress and torch.distributed.get_rank() == 0:
        print(
            f"  {result.layout:<32} {result.mode:<10} done in {result.seconds:5.2f} s",
            file=sys.stderr,
            flush=True,
        )


def relative_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The worst parameter's relative error; NaN if any gradient or reference is NaN.

        max over parameters p of  max |g_p - ref_p| / max |ref_p|   (max |g_p - ref_p| where ref_p == 0)

    Each parameter is judged against its own scale, so an error in a parameter with small gradients
    (a norm weight) is not hidden by the largest gradient of the model. Reduced in torch:
    ``torch.max`` propagates NaN, Python's ``max`` drops a NaN that is not first.
    """
    errors = []
    for name, grad in grads.items():
        diff = (grad - ref[name]).abs().max()
        scale = ref[name].abs().max()
        errors.append(torch.where(scale == 0, diff, diff / scale))
    return float(torch.stack(errors).max())


def run_layout(
    layout: Layout,
    mode: str,
    cfg: VerifyConfig,
    batch: GlobalBatch,
    *,
    loss_func: Callable = masked_loss,
    extension: bool = True,
) -> tuple[dict[str, torch.Tensor], int | None]:
    """One step of ``layout`` in ``mode`` through ``install()``, as a user runs it; this rank's
    gradients by global name, and the N its finalize divided by (token mode).

    The parallel state, megatron's own num-microbatches calculator (GBS = MBS x DP x GA) and the
    extension (:class:`GAConfig` with the mode and the pipeline sizes) are set up for the step and
    torn down after it. ``extension=False`` runs upstream alone (its own
    ``--calculate-per-token-loss`` in mode token), for a before/after comparison; N is then None.
    """
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state

    import megatron_ga_ext

    vpp = layout.virtual_pipeline_model_parallel_size
    init_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
    )
    state = (
        megatron_ga_ext.install(
            GAConfig(
                loss_reduction=mode,
                pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            )
        )
        if extension
        else None
    )
    calculators.init_num_microbatches_calculator(
        0, None, layout.global_batch_size, layout.micro_batch_size, layout.data_parallel_size
    )
    try:
        chunks, names, config = build_chunks(
            layout, cfg, calculate_per_token_loss=(mode == "token")
        )
        from megatron.core.distributed import (
            finalize_model_grads,
        )  # the extension's, after install()

        step = None
        if cfg.upstream and not extension:  # as a user of patches/upstream runs megatron-core alone
            upstream.configure(config, mode)
            step = partial(forward_step, with_loss_mask=layout.model != "positionwise", mode=mode)
        train_step(
            chunks,
            config,
            layout,
            cfg,
            batch,
            finalize=finalize_model_grads,
            loss_func=partial(loss_func, mode=mode),
            forward_step_func=step,
        )
        tokens = (
            state.verdict.num_tokens if state is not None and state.verdict is not None else None
        )
        return gradients(chunks, names), tokens
    finally:
        megatron_ga_ext.uninstall()
        calculators.unset_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()


def reduction_hooks(mode: str, loss_func: Callable) -> tuple[Any, Callable]:
    """The extension's finalize and loss function wired by hand, without install(): for the unit
    tests that break one check of the finalize on purpose. ``verify`` itself goes through
    install()."""
    from megatron.core.distributed import finalize_model_grads

    contract = LossContract()
    finalize = make_finalize_model_grads(
        finalize_model_grads, contract, config=GAConfig(loss_reduction=mode)
    )
    return finalize, contract.wrap(loss_func) if mode == "token" else loss_func


def build_ddp(
    layout: Layout,
    cfg: VerifyConfig,
    *,
    calculate_per_token_loss: bool,
    ddp_config: Any = None,
    build_module: Callable | None = None,
) -> tuple[Any, dict[str, str], Any]:
    """This rank's (single) chunk of the layout's model, wrapped in megatron's DDP: (ddp, names,
    config).

    ``names`` maps each local parameter name to its global one. ``build_module(config)`` returning
    ``(module, names)`` replaces the layout's model (it may set fields of the config first).
    """
    chunks, names, config = build_chunks(
        layout,
        cfg,
        calculate_per_token_loss=calculate_per_token_loss,
        ddp_config=ddp_config,
        build_module=build_module,
    )
    return chunks[0], names, config


def build_chunks(
    layout: Layout,
    cfg: VerifyConfig,
    *,
    calculate_per_token_loss: bool,
    ddp_config: Any = None,
    build_module: Callable | None = None,
) -> tuple[list[Any], dict[str, str], Any]:
    """This rank's model chunks (one per virtual pipeline stage), each wrapped in the layout's
    data-parallel wrapper as its training does (bucketing only on the first chunk;
    data_parallel.py): (chunks, names of all chunks, config)."""
    vpp = layout.virtual_pipeline_model_parallel_size
    config = layout_config(layout, cfg.model, calculate_per_token_loss=calculate_per_token_loss)
    ddp_config = ddp_config or ddp_config_of(layout)
    chunks, names = [], {}
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        module, chunk_names = (build_module or partial(_build_module, layout, cfg, vp_stage=stage))(
            config
        )
        module.to(cfg.device)
        chunks.append(
            wrap_chunk(
                layout,
                config,
                module,
                ddp_config,
                disable_bucketing=vp_stage > 0,
                device=cfg.device,
            )
        )
        names.update(chunk_names)
    return chunks, names, config


def layout_config(layout: Layout, model: ModelConfig, *, calculate_per_token_loss: bool) -> Any:
    """The megatron TransformerConfig of ``layout``'s model (its ``__post_init__`` validates the
    layout); on an FSDP path with the local transformer implementation, as its launch needs (torch
    FSDP2 wraps TE's output layer)."""
    config = transformer_config(
        model,
        kind=layout.model,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        sequence_parallel=layout.sequence_parallel,
        overlap_moe_expert_parallel_comm=layout.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=layout.delay_wgrad_compute,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    if layout.data_parallel != "ddp":
        config.transformer_impl = "local"
    return config


def _build_module(
    layout: Layout, cfg: VerifyConfig, config: Any, *, vp_stage: int | None = None
) -> Any:
    from megatron.core import parallel_state

    if layout.model == "positionwise":
        return build_positionwise(cfg.model, config)
    return build_gpt(
        cfg.model,
        config,
        vp_stage=vp_stage,
        positionwise=layout.model in POSITIONWISE_GPT,
        untied=layout.model in UNTIED_GPT,
        pre_process=parallel_state.is_pipeline_first_stage(
            ignore_virtual=vp_stage is None, vp_stage=vp_stage
        ),
        post_process=parallel_state.is_pipeline_last_stage(
            ignore_virtual=vp_stage is None, vp_stage=vp_stage
        ),
    )
