"""Megatron-Bridge 0.6.2's own ``pretrain(cfg, forward_step)`` on the CPU over gloo, DP 2, on a tiny
GPT over mock data, with Bridge's GPT step (tests/bridge; make test-bridge).

    python tests/support/bridge_runs.py OUT CASE [CASE ...]

imports Bridge once (under the TE import stand-in, shim 13 of tests/support/bridge_shims.py), then
per case forks two ranks. Each rank applies ``bridge_shims()``, builds :func:`tiny_config`, runs the
case's :data:`CASES` set-up and ``pretrain()``, and writes ``OUT/CASE.rankR.jsonl``: one row per
iteration at full precision from Bridge's own ``training_log`` (iteration, ``lm loss``, grad norm,
learning rate, consumed samples, train_iters), and a last row ``{"error": ..., "type": ...}`` where
``pretrain()`` raised (Bridge's ``sys.exit(0)`` at ``train.exit_interval`` is a normal end), and
``OUT/CASE.rankR.log``: what it printed and logged. The parent exits 0 once every rank has finished.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SEQ_LENGTH = 64
WORLD_SIZE = 2
#: The output directory (main's first argument): rows, and the checkpoints of the resume cases.
OUT = Path(".")


#: MoE as the Megatron-LM tier runs it (tests/e2e/test_moe_mtp.py): 4 experts top-2, aux loss and
#: z-loss.
MOE = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_aux_loss_coeff": 1e-2,
    "moe_z_loss_coeff": 1e-3,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_token_dispatcher_type": "allgather",
    "add_bias_linear": False,
}


def tiny_config(*, per_token: bool = True, train_iters: int = 6, **model_fields: Any) -> Any:
    """A 2-layer GPT (hidden 64, 4 heads, seq 64) on mock data: GBS 8, MBS 2 (2 micro-batches per
    rank at DP 2), fp32, Adam, clip_grad 1, linear LR decay, ``model.calculate_per_token_loss`` as
    ``per_token``; ``model_fields`` on top (:data:`MOE`)."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training import config as c

    model = GPTModelProvider(
        transformer_layer_spec=local_layer_spec,
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        vocab_size=1024,
        make_vocab_size_divisible_by=128,
        use_cpu_initialization=True,
        bf16=False,
        fp16=False,
        calculate_per_token_loss=per_token,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **model_fields,
    )
    model.params_dtype = torch.float32
    return c.ConfigContainer(
        model=model,
        train=c.TrainingConfig(train_iters=train_iters, global_batch_size=8, micro_batch_size=2),
        validation=c.ValidationConfig(eval_interval=1000, eval_iters=0),
        optimizer=c.OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=1e-4,
            weight_decay=0.01,
            bf16=False,
            fp16=False,
            use_distributed_optimizer=False,
            clip_grad=1.0,
        ),
        scheduler=c.SchedulerConfig(
            lr_decay_style="linear",
            lr_warmup_iters=0,
            start_weight_decay=0.01,
            end_weight_decay=0.01,
            weight_decay_incr_style="constant",
        ),
        ddp=c.DistributedDataParallelConfig(
            use_distributed_optimizer=False,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            grad_reduce_in_fp32=False,
        ),
        dataset=c.MockGPTDatasetConfig(
            seq_length=SEQ_LENGTH,
            random_seed=1234,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=True,
            num_workers=0,
            dataloader_type="single",
            split="99,1,0",
        ),
        logger=c.LoggerConfig(log_interval=1, tensorboard_dir=None),
        tokenizer=c.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=1024),
        checkpoint=c.CheckpointConfig(save=None, save_interval=None, load=None),
        rng=c.RNGConfig(seed=1234),
        dist=c.DistributedInitConfig(distributed_backend="gloo"),
        mixed_precision=None,
    )


def _bridge(cfg: Any) -> Any:
    """Bridge's own per-token run: nothing of ours."""
    return cfg


def _microbatch(cfg: Any) -> Any:
    """Bridge's mean of per-micro-batch means (per-token loss off): the reference must differ from
    it."""
    cfg.model.calculate_per_token_loss = False
    return cfg


def _extension(cfg: Any, **settings: Any) -> Any:
    """A user's launch: per-token loss off in the recipe, the extension configured from its ga
    section (``settings``; ``ga_bridge.install`` turns per-token loss on)."""
    from megatron_ga_ext.integration import bridge as ga_bridge

    cfg.model.calculate_per_token_loss = False
    cfg = ga_bridge.with_ga(cfg, **settings)
    ga_bridge.install(cfg)
    return cfg


def _schedule(cfg: Any) -> Any:
    """train_samples 56 under train.step_batch_size_schedule "0:8 1536:16" (thresholds in tokens, as
    upstream's: 24 samples of 64; GBS 8 for 3 steps, then 16 for 2), sample-based LR decay to min_lr
    at 56."""
    cfg.train.train_iters, cfg.train.train_samples = None, 56
    cfg.train.step_batch_size_schedule = "0:8 1536:16"
    return cfg


def _schedule_extension(cfg: Any, **settings: Any) -> Any:
    return _extension(_schedule(cfg), **settings)


def _schedule_wsd(cfg: Any) -> Any:
    """The schedule's run with an LR warmup over 16 samples and WSD, its final linear decay over the
    last 24 (Bridge #3438: with a batch that changes, WSD's decay must still end on the last
    step)."""
    cfg.scheduler.lr_decay_style, cfg.scheduler.lr_warmup_iters = "WSD", 0
    cfg.scheduler.lr_warmup_samples, cfg.scheduler.lr_warmup_init = 16, 0.0
    cfg.scheduler.lr_wsd_decay_samples, cfg.scheduler.lr_wsd_decay_style = 24, "linear"
    return _schedule_extension(cfg)


def _saving(cfg: Any) -> Any:
    """The schedule's run through the extension, saved at iteration 3 (where its batch is to double)
    and stopped."""
    cfg.checkpoint.save = str(OUT / "checkpoints")
    cfg.train.exit_interval = 3
    return _schedule_extension(cfg)


def _resuming(cfg: Any) -> Any:
    """The same run resumed from that checkpoint, to its end."""
    cfg.checkpoint.save = cfg.checkpoint.load = str(OUT / "checkpoints")
    return _schedule_extension(cfg)


def _rampup(cfg: Any) -> Any:
    """The schedule's run given as Bridge's deprecated rampup: GBS 16 reached from 8 in one
    increment after 24 samples (train.rampup_batch_size [8, 8, 24]), under ga.convert_rampup."""
    cfg.train.train_iters, cfg.train.train_samples = None, 56
    cfg.train.global_batch_size, cfg.train.rampup_batch_size = 16, [8, 8, 24]
    return _extension(cfg, convert_rampup=True)


def _measuring(
    run: str, exit_interval: int | None = None, resume: bool = False, warmup: bool = False
) -> Callable[[Any], Any]:
    """The extension's run with ga.noise_scale 1, its trace and TensorBoard under OUT/<run>, saved
    every 3 iterations (every 2 with ``warmup``) to OUT/<run>/checkpoints; stopped at
    ``exit_interval``, or resumed from there. ``warmup``: ga.batch_size_warmup auto from GBS 8
    (trust 2000, so that it doubles at every measurement, up to 32) over train.train_samples 88."""

    def measuring(cfg: Any) -> Any:
        directory = OUT / run
        directory.mkdir(parents=True, exist_ok=True)
        cfg.logger.tensorboard_dir = str(directory / "tb")
        cfg.checkpoint.save, cfg.checkpoint.save_interval = (
            str(directory / "checkpoints"),
            2 if warmup else 3,
        )
        cfg.checkpoint.load = cfg.checkpoint.save if resume else None
        cfg.train.exit_interval = exit_interval
        trace = directory / f"trace-{'load' if resume else 'save'}.jsonl"
        settings: dict[str, Any] = {"noise_scale": 1, "noise_scale_trace": str(trace)}
        if warmup:
            cfg.train.train_iters, cfg.train.train_samples = None, 88
            settings.update(
                batch_size_warmup="auto", batch_size_warmup_trust=2000.0, batch_size_warmup_max=32
            )
        return _extension(cfg, **settings)

    return measuring


def _moe(setup: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def moe(cfg: Any) -> Any:
        for field, value in MOE.items():
            setattr(cfg.model, field, value)
        return setup(cfg)

    return moe


def masked_forward_step(
    state: Any, data_iterator: Any, model: Any, return_schedule_plan: bool = False
) -> Any:
    """Bridge #6103's fix as a user writes it: Bridge's GPT step (DP only, no packing) with
    ``loss_mask`` passed to the model."""
    from functools import partial

    from megatron.bridge.training.gpt_step import get_batch
    from megatron.bridge.training.losses import masked_next_token_loss
    from megatron.bridge.training.utils.pg_utils import get_pg_collection

    tokens, labels, loss_mask, attention_mask, position_ids, _ = get_batch(
        data_iterator, state.cfg, pg_collection=get_pg_collection(model)
    )
    output = model(
        input_ids=tokens,
        position_ids=position_ids,
        attention_mask=attention_mask,
        labels=labels,
        loss_mask=loss_mask,
    )
    return output, partial(
        masked_next_token_loss, loss_mask, check_for_nan_in_loss=True, check_for_spiky_loss=False
    )


def _drop_finalize() -> None:
    """Bridge #4974's shape: the model config the loop trains with holds no
    finalize_model_grads_func."""
    import megatron.bridge.training.pretrain as pretrain_module
    from megatron.core.utils import get_model_config

    original = pretrain_module.train

    def train(forward_step_func: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        get_model_config(model[0]).finalize_model_grads_func = None
        return original(forward_step_func, model, *args, **kwargs)

    pretrain_module.train = train


def _dropped(setup: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def dropped(cfg: Any) -> Any:
        _drop_finalize()
        return setup(cfg)

    return dropped


def _bypassed(cfg: Any) -> Any:
    """A forward/backward function bound before install(): Bridge's loop is given megatron-core's
    schedule as it was before the extension wrapped it."""
    import megatron.bridge.training.train as train_module
    from megatron.core.pipeline_parallel import schedules

    unwrapped = schedules.forward_backward_no_pipelining
    cfg = _extension(cfg)
    train_module.get_forward_backward_func = lambda *args, **kwargs: unwrapped
    return cfg


#: case -> what it does to the tiny config before pretrain() (and returns as the config to train).
CASES: dict[str, Callable[[Any], Any]] = {
    "bridge": _bridge,
    "bridge-microbatch": _microbatch,
    "extension": _extension,
    "schedule-bridge": _schedule,
    "schedule-extension": _schedule_extension,
    "resume-save": _saving,
    "resume-load": _resuming,
    "rampup-extension": _rampup,
    "schedule-lr-sqrt": lambda cfg: _schedule_extension(cfg, lr_scaling="sqrt"),
    "schedule-wsd": _schedule_wsd,
    "noise-scale": _measuring("noise-scale"),
    "noise-scale-save": _measuring("noise-scale-resume", exit_interval=3),
    "noise-scale-load": _measuring("noise-scale-resume", resume=True),
    "warmup": _measuring("warmup", warmup=True),
    "warmup-save": _measuring("warmup-resume", exit_interval=2, warmup=True),
    "warmup-load": _measuring("warmup-resume", resume=True, warmup=True),
    "moe-bridge": _moe(_bridge),
    "moe-extension": _moe(_extension),
    "moe-extension-masked-step": _moe(_extension),
    "dropped-finalize-bridge": _dropped(_bridge),
    "dropped-finalize-extension": _dropped(_extension),
    "bypassed-schedule-extension": _bypassed,
}


def _record(path: Path) -> Any:
    """Wrap Bridge's training_log (bound by name in train.py) to write one row per iteration to
    ``path``."""
    import megatron.bridge.training.train as train

    original = train.training_log
    out = path.open("w")

    def training_log(
        loss_dict: dict,
        total_loss_dict: dict,
        learning_rate: Any,
        decoupled_learning_rate: Any,
        loss_scale: Any,
        report_memory_flag: Any,
        skipped_iter: Any,
        grad_norm: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        state = kwargs.get("global_state", args[3] if len(args) > 3 else None)
        loss = loss_dict.get("lm loss")
        out.write(
            json.dumps(
                {
                    "iteration": state.train_state.step,
                    "consumed_samples": state.train_state.consumed_train_samples,
                    "train_iters": state.cfg.train.train_iters,
                    "loss": None if loss is None else float(loss),
                    "lr": learning_rate,
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "skipped": int(skipped_iter),
                }
            )
            + "\n"
        )
        out.flush()
        return original(
            loss_dict,
            total_loss_dict,
            learning_rate,
            decoupled_learning_rate,
            loss_scale,
            report_memory_flag,
            skipped_iter,
            grad_norm,
            *args,
            **kwargs,
        )

    train.training_log = training_log
    return out


def _rank(case: str, rank: int, port: int, out: Path) -> int:
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from tests.support.bridge_shims import bridge_shims

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    rows = _record(out / f"{case}.rank{rank}.jsonl")
    with bridge_shims():
        try:
            pretrain(
                CASES[case](tiny_config()),
                masked_forward_step if case.endswith("masked-step") else forward_step,
            )
        except SystemExit as error:  # train.exit_interval: Bridge saves, then sys.exit(0)
            if error.code not in (0, None):
                raise
        except BaseException as error:  # the error is the result: written for the test to read
            traceback.print_exc()
            rows.write(json.dumps({"error": str(error), "type": type(error).__name__}) + "\n")
            rows.close()
            return 1
    rows.close()
    return 0


def main(argv: list[str]) -> int:
    global OUT
    out, cases = Path(argv[0]), argv[1:]
    OUT = out
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        raise SystemExit(f"unknown case {unknown[0]!r}; the cases: {', '.join(CASES)}")
    out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    from megatron_ga_ext.testing.distributed import free_port
    from tests.support.bridge_shims import bridge_import_shim

    with bridge_import_shim():
        import megatron.bridge.training.gpt_step
        import megatron.bridge.training.pretrain  # noqa: F401
    for case in cases:
        port, children = free_port(), []
        for rank in range(WORLD_SIZE):
            pid = os.fork()
            if pid == 0:
                code = 1
                log = os.open(out / f"{case}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(
                    log, 1
                )  # what the rank prints and logs (Bridge's iteration lines), for the test to read
                os.dup2(log, 2)
                try:
                    code = _rank(case, rank, port, out)
                finally:
                    # the checkpoint writer's spawned workers hold the parent's pipes and outlive
                    # os._exit
                    for child in multiprocessing.active_children():
                        child.terminate()
                        child.join()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        print(f"{case}: exit codes {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
