"""torch FSDP2 (``--use-torch-fsdp2``) under the token-level loss: sum over DP x CP, then divide
once by N.

megatron-core's ``TorchFullyShardedDataParallel`` keeps the base class's ``scale_gradients``, which
does nothing (``data_parallel_base.py``, every release from 0.16 on), and FSDP2's reduce-scatter
averages over its mesh (the DP x CP group). Upstream's ``--calculate-per-token-loss`` on FSDP2
therefore ends with

    grad = sum over (m, r, c) of grad L_m,r,c / (DP x CP)         N / (DP x CP) times the per-token mean

(17x at DP 2 with N = 34). The extension makes every FSDP2 unit of a model sum instead, and divides
by N itself:

    before a step's first reduce-scatter  unit.set_gradient_divide_factor(1.0)        (:func:`prepare_units`)
                                          unit.set_force_sum_reduction_for_comms(True)  (gloo has no PREMUL_SUM)
    in finalize, after the reduction      local grad shard * 1 / N                    (:func:`scale_gradients`)

Summing keeps the reduction exact to the last bit of an fp32 sum (as Megatron's DDP does with
per-token loss) where averaging then multiplying by DP x CP / N rounds twice. The division is ours
only while upstream's ``scale_gradients`` is still the base class's no-op: an upstream that
implements it scales, and we do not scale again. Each step (:func:`check_units`) a unit whose factor
or reduction is not what the mode needs stops the step, naming the unit: token mode needs (1.0, sum)
on every unit, microbatch mode FSDP2's own average (no factor), which is upstream's mean of means.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from megatron_ga_ext.errors import CompatError, LossContractError
from megatron_ga_ext.integration.compat import megatron_core_version
from megatron_ga_ext.integration.division import is_torch_fsdp2, scale_gradients, upstream_scales
from megatron_ga_ext.integration.features import Feature, Finalizing, Step

__all__ = [
    "TorchFSDP2",
    "check_units",
    "is_torch_fsdp2",
    "prepare_units",
    "scale_gradients",
    "upstream_scales",
]
# is_torch_fsdp2, scale_gradients and upstream_scales: the division's (division.py), named here for
# FSDP2's readers

#: What each mode needs of every FSDP2 unit: (gradient divide factor, sum-only reduction).
UNIT_STATE = {"token": (1.0, True), "microbatch": (None, False)}


def prepare_units(model: Any, mode: str) -> None:
    """Token mode: every FSDP2 unit of ``model`` (a chunk or a list of chunks) sums over DP x CP,
    set before the step's first reduce-scatter. A unit still in FSDP2's default is set; one set
    otherwise is left for
    :func:`check_units` to name. Microbatch mode, or a model without FSDP2: nothing."""
    if mode != "token":
        return
    for _, unit, group in _units(model):
        if _state(group) != UNIT_STATE["microbatch"]:
            continue
        for method in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"):
            if not hasattr(unit, method):
                raise CompatError(
                    f"torch {torch.__version__}'s FSDP2 has no {method}, which per-token loss on "
                    "--use-torch-fsdp2 needs to sum gradients over the data-parallel ranks. Use "
                    "a torch whose FSDPModule has it, or --use-megatron-fsdp, or "
                    "--ga-loss-reduction microbatch without --calculate-per-token-loss."
                )
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


class TorchFSDP2(Feature):
    """--use-torch-fsdp2: the units sum in token mode (finalize divides by N, division.py); in
    finalize, each unit reduces as the mode needs and no Megatron-FSDP buffer meets upstream's
    miscount."""

    flags = ()

    def begin_step(self, step: Step) -> None:
        """Every torch FSDP2 unit set to sum over DP x CP, before the step's first reduce-scatter
        (token mode)."""
        if step.training:
            prepare_units(step.call.get("model"), self.handle.config.loss_reduction)

    def finalize(self, step: Finalizing) -> None:
        """Every FSDP2 unit reduces as the mode needs; a Megatron-FSDP one-rank buffer's miscount
        stops the step."""
        check_units(step.model, step.mode)


def check_units(model: Any, mode: str) -> None:
    """Every FSDP2 unit of ``model`` reduces as ``mode`` needs (:data:`UNIT_STATE`), and no
    Megatron-FSDP chunk meets upstream's miscount of a one-rank gradient buffer
    (:func:`check_megatron_fsdp`); else the step stops here, before its gradients are scaled, naming
    the unit, what it was set to and what to do."""
    check_megatron_fsdp(model, mode)
    factor, force_sum = UNIT_STATE[mode]
    for name, _, group in _units(model):
        found = _state(group)
        if found == (factor, force_sum):
            continue
        raise LossContractError(
            f"torch FSDP2 unit {name!r} reduces its gradients with gradient divide factor "
            f"{found[0]} and force-sum reduction {found[1]}; --ga-loss-reduction {mode} "
            f"needs factor {factor} "
            "and force-sum "
            f"{force_sum} ({_why(mode)}). Something changed the unit after install() set it up "
            "(set_gradient_divide_factor or set_force_sum_reduction_for_comms): leave FSDP2's "
            "reduction to the "
            f"extension."
        )


def check_megatron_fsdp(model: Any, mode: str) -> None:
    """A Megatron-FSDP chunk with sharded gradients (optim_grads, optim_grads_params) and a gradient
    buffer whose data-parallel group has one rank (DP 1, or the experts' group when EP takes every
    DP rank) keeps its accumulated gradient in the bucket it reduces, and upstream miscounts it; the
    step stops, naming the buffer and the fix:

    * megatron-core 0.16 adds the accumulated gradient to itself at each micro-batch's reduction
      (Megatron-LM #6660: measured 2x at GA 1, about 2^GA after GA), in either mode;
    * 0.17 on, microbatch mode at GA > 1, where the buffer's scaling factor is not 1 (the experts' 1
      / DP) and is applied in place (``gradient_reduce_preprocessing``: bf16 gradients,
      --no-gradient-reduce-div-fusion, gloo): the whole accumulated gradient is multiplied by it
      before every micro-batch's reduction, so micro-batch m of GA is scaled GA - m + 1 times. Token
      mode's factor is 1: exact."""
    for index, chunk in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        buffer = getattr(chunk, "param_and_grad_buffer", None)
        strategy = getattr(
            getattr(chunk, "ddp_config", None), "data_parallel_sharding_strategy", "no_shard"
        )
        if buffer is None or strategy not in ("optim_grads", "optim_grads_params"):
            continue
        release = megatron_core_version()  # read where a sharded Megatron-FSDP chunk is found only
        for group in buffer.parameter_groups:
            grads = group.main_grad_buffer
            if grads is None or torch.distributed.get_world_size(grads.data_parallel_group) != 1:
                continue
            where = (
                f"model chunk {index}: Megatron-FSDP --data-parallel-sharding-strategy "
                f"{strategy} with {'an expert' if group.is_expert_param else 'a dense'} "
                "gradient buffer whose data-parallel group has "
                f"one rank: megatron-core {release}"
            )
            if release.startswith("0.16."):
                raise LossContractError(
                    f"{where} adds the accumulated gradient to itself at every micro-batch's "
                    "reduction (Megatron-LM #6660; 2x at one micro-batch, about 2^GA after GA). "
                    "Use --data-parallel-sharding-strategy optim or no_shard, a "
                    "data-parallel size (for experts: DP / EP) above 1, or megatron-core "
                    "0.17 or later."
                )
            if (
                mode == "microbatch"
                and _scales_in_place(grads, chunk.ddp_config)
                and (ga := _num_microbatches()) > 1
            ):
                raise LossContractError(
                    f"{where} multiplies the whole accumulated gradient by its scaling factor "
                    f"{grads.gradient_scaling_factor:g} (1 / DP) before every "
                    "micro-batch's reduction (unfused: bf16 "
                    f"gradients, --no-gradient-reduce-div-fusion or gloo), so at {ga} "
                    "micro-batches the earlier ones are scaled again at each later one and the "
                    "step misses the mean of means. Use --ga-loss-reduction token (exact "
                    "here), --data-parallel-sharding-strategy optim or no_shard, or "
                    f"an expert data-parallel size (DP / EP) above 1."
                )


def _scales_in_place(grads: Any, ddp_config: Any) -> bool:
    """Megatron-FSDP's ``gradient_reduce_preprocessing`` multiplies the bucket itself by the
    buffer's scaling factor (not an AVG or a fused PREMUL_SUM reduction), and the factor is not
    1."""
    factor = grads.gradient_scaling_factor
    if factor is None or factor == 1.0 or ddp_config.average_in_collective:
        return False
    return not ddp_config.gradient_reduce_div_fusion or grads.dtype == torch.bfloat16


def _num_microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return int(get_num_microbatches())


def _units(model: Any) -> Iterator[tuple[str, Any, Any]]:
    """(qualified name, FSDP2 unit, its parameter group) for every unit with parameters of every
    torch FSDP2 chunk of ``model`` (a chunk or a list of chunks; None: none)."""
    chunks = model if isinstance(model, (list, tuple)) else [] if model is None else [model]
    for index, chunk in enumerate(chunks):
        if not is_torch_fsdp2(chunk):
            continue
        for name, module in chunk.module.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                yield f"chunk {index} {name or '(root)'}", module, group


def _state(group: Any) -> tuple[float | None, bool]:
    """A unit's parameter group: (gradient divide factor, sum-only reduction); FSDP2's defaults
    where a torch has no such field."""
    return getattr(group, "gradient_divide_factor", None), getattr(
        group, "force_sum_reduction_for_comms", False
    )


def _why(mode: str) -> str:
    if mode == "token":
        return "summed over DP x CP, then divided once by the global token count N"
    return "FSDP2's average over DP x CP, upstream's mean of means"
