"""The model's flags of a launch line (layers, hidden, heads, vocabulary, MoE, MTP, precision,
recompute), which the batch rules do not read, and the refusals Megatron makes of them. Pure Python.

The words are read as ``parse_launch`` reads them (a pasted script expanded, one quoted line split
like a shell); ``--flag value`` and ``--flag=value`` both work, ``_`` counts as ``-``, the last
occurrence wins.
"""

from __future__ import annotations

import ast
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_ga_ext.core.memory import Precision, Recompute
from megatron_ga_ext.core.model_shape import ModelShape, padded_vocab
from megatron_ga_ext.launch.model_flag_table import _FREQ, _OFF, _ON, _STR, MODEL_FLAGS
from megatron_ga_ext.launch.report import Problem
from megatron_ga_ext.launch.script import is_script, read_script

__all__ = ["MODEL_FLAGS", "line_words", "model_problems", "model_shape", "read_model_args"]

#: GPT-2's BPE vocabulary: Megatron's --tokenizer-type GPT2BPETokenizer, and what the ledger assumes
#: without
#: --vocab-size.
GPT2_VOCAB = 50257
_ARGS = "megatron/training/arguments.py"
_CONFIG = "megatron/core/transformer/transformer_config.py"


def line_words(tokens: Sequence[str], environment: Mapping[str, str] | None = None) -> list[str]:
    """The words of a launch as ``parse_launch`` reads them."""
    if len(tokens) == 1 and is_script(tokens[0]):
        return read_script(tokens[0], environment).words
    if len(tokens) == 1 and " " in tokens[0].strip():
        try:
            return shlex.split(tokens[0].replace("\\\n", " "), comments=True)
        except ValueError:
            return []  # the line's own reading reports it
    return list(tokens)


def read_model_args(words: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the model flags the words give, by destination; each destination's flag as the line spelled
    it). A value that is not a number is kept as text (its rule names it)."""
    args: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name, eq, inline = word.partition("=")
        flag = "--" + name[2:].replace("_", "-")
        if flag not in MODEL_FLAGS:
            continue
        dest, kind = MODEL_FLAGS[flag]
        spelled[dest] = name
        if kind in (_ON, _OFF):
            args[dest] = kind == _ON
            continue
        text = inline if eq else (words[i + 1] if i + 1 < len(words) else "")
        args[dest] = _typed(kind, text)
    return args, spelled


def _typed(kind: str, text: str) -> Any:
    if kind == _STR:
        return text
    if kind == _FREQ and "[" in text:
        return _pattern(text)
    try:
        return int(text)
    except ValueError:
        return text


def _pattern(text: str) -> tuple[int, ...] | str:
    """--moe-layer-freq's list expression (``([0]*3+[1]*58)``), evaluated over lists, ints, + and *
    only."""

    def value(node: ast.expr) -> Any:
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        return text
    return tuple(result) if isinstance(result, list) else text


def _int(args: Mapping[str, Any], dest: str) -> int | None:
    """A size the line gives, or None: not a number, or below 1 (its own rule reports that)."""
    value = args.get(dest)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def model_shape(
    args: Mapping[str, Any], tensor_model_parallel_size: int, seq_length: int | None
) -> tuple[ModelShape | None, list[str]]:
    """(the model the flags give, the assumptions made in words); None where the line does not give
    the flags Megatron requires (--num-layers, --hidden-size, --num-attention-heads, and a
    sequence length)."""
    layers, hidden, heads = (
        _int(args, d) for d in ("num_layers", "hidden_size", "num_attention_heads")
    )
    if layers is None or hidden is None or heads is None or seq_length is None:
        return None, []
    assumed = []
    vocab = _int(args, "vocab_size")
    if vocab is None:
        vocab = GPT2_VOCAB
        assumed.append(f"GPT-2's vocabulary {GPT2_VOCAB:,} assumed: give --vocab-size")
    divisible = _int(args, "make_vocab_size_divisible_by") or 128
    freq = args.get("moe_layer_freq", 1)
    ints: dict[str, Any] = {
        d: _int(args, d)
        for d in (
            "ffn_hidden_size",
            "kv_channels",
            "num_experts",
            "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
            "moe_latent_size",
            "mtp_num_layers",
            "q_lora_rank",
        )
    }
    defaults: dict[str, Any] = {"moe_router_topk": 2, "kv_lora_rank": 32, "qk_head_dim": 128}
    defaults |= {"qk_pos_emb_head_dim": 64, "v_head_dim": 128}
    resolved: dict[str, Any] = {d: _int(args, d) or v for d, v in defaults.items()}
    shape = ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq_length,
        padded_vocab_size=padded_vocab(vocab, max(divisible, 1), tensor_model_parallel_size),
        num_query_groups=_int(args, "num_query_groups")
        if args.get("group_query_attention")
        else None,
        untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights")),
        swiglu=bool(args.get("swiglu")),
        normalization=str(args.get("normalization") or "LayerNorm"),
        add_bias_linear=args.get("add_bias_linear", True),
        moe_layer_freq=freq if isinstance(freq, (int, tuple)) else 1,
        moe_shared_expert_gate=bool(args.get("moe_shared_expert_gate")),
        multi_latent_attention=bool(args.get("multi_latent_attention")),
        **ints,
        **resolved,
    )
    return shape, assumed


def precision_of(args: Mapping[str, Any]) -> Precision:
    """--bf16 / --fp16 (fp32 without either), --fp8-param-gather, --grad-reduce-in-bf16, the
    distributed optimizer, Megatron-FSDP's sharding (optim_grads_params unless given,
    arguments.py:3023)."""
    dtype = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    fsdp = str(args.get("data_parallel_sharding_strategy") or "optim_grads_params")
    return Precision(
        params_dtype=dtype,
        fp8_param_gather=bool(args.get("fp8_param_gather")),
        grad_reduce_in_bf16=bool(args.get("grad_reduce_in_bf16")),
        use_distributed_optimizer=bool(args.get("use_distributed_optimizer")),
        fsdp_sharding=fsdp if args.get("use_megatron_fsdp") else None,
    )


def recompute_of(args: Mapping[str, Any]) -> Recompute:
    """--recompute-activations is selective (arguments.py); full without a method is uniform."""
    granularity = args.get("recompute_granularity")
    if args.get("recompute_activations"):
        granularity = "selective"
    method = args.get("recompute_method")
    if granularity == "full" and method is None:
        method = "uniform"
    return Recompute(
        granularity=granularity if isinstance(granularity, str) else None,
        method=method if isinstance(method, str) else None,
        num_layers=_int(args, "recompute_num_layers") or 1,
    )


def model_problems(args: Mapping[str, Any], spelled: Mapping[str, str], tp: int) -> list[Problem]:
    """The model flags Megatron refuses, as it refuses them: heads and hidden size, heads and query
    groups against TP, FFN against TP, a vocabulary that cannot be padded. check's rule registry
    holds the heads and query-groups rules too (same ids; check says each once); the ledger command,
    whose line the registry's view does not read, gets them here."""
    name = {d: spelled.get(d, "--" + d.replace("_", "-")) for d in MODEL_FLAGS_BY_DEST}
    problems: list[Problem] = []
    hidden, heads = _int(args, "hidden_size"), _int(args, "num_attention_heads")
    tp_flag = "--tensor-model-parallel-size"
    if hidden and heads and _int(args, "kv_channels") is None and hidden % heads:
        near = _near_divisible(hidden, heads)
        problems.append(
            _problem(
                f"{name['hidden_size']} {hidden} is not divisible by "
                f"{name['num_attention_heads']} {heads}: Megatron asserts hidden_size % "
                f"num_attention_heads == 0 ({_ARGS}:1292 at core_v0.19.0) unless "
                f"--kv-channels is given. Nearest valid {name['hidden_size']}: {near}.",
                "hidden-size-attention-heads",
            )
        )
    if heads and heads % tp:
        problems.append(
            _problem(
                f"{name['num_attention_heads']} {heads} is not a multiple of {tp_flag} {tp}: "
                "TransformerConfig raises 'num_attention_heads must be a multiple of "
                f"tensor_model_parallel_size' ({_CONFIG}:1323 at core_v0.19.0). Use a {tp_flag} "
                f"that divides {heads}.",
                "attention-heads-tensor-parallel",
            )
        )
    groups = _int(args, "num_query_groups") if args.get("group_query_attention") else None
    if groups and groups % tp and tp % groups:
        problems.append(
            _problem(
                f"{name['num_query_groups']} {groups} is neither a multiple nor a divisor of "
                f"{tp_flag} {tp}: TransformerConfig raises ({_CONFIG}:1338-1345 at "
                f"core_v0.19.0). Use a {tp_flag} that divides {groups} or that {groups} "
                "divides.",
                "query-groups-tensor-parallel",
            )
        )
    ffn = _int(args, "ffn_hidden_size")
    if ffn and ffn % tp:
        problems.append(
            _problem(
                f"{name['ffn_hidden_size']} {ffn} is not divisible by {tp_flag} {tp}: the MLP's "
                "RowParallelLinear divides its input by TP (megatron/core/tensor_parallel/"
                f'layers.py:1328 at core_v0.19.0) and Megatron asserts "{ffn} is not divisible '
                f'by {tp}" (megatron/core/utils.py:558). Use a {tp_flag} that divides '
                f"{ffn}.",
                "ffn-hidden-size-tensor-parallel",
            )
        )
    divisible = args.get("make_vocab_size_divisible_by")
    if divisible is not None and (not isinstance(divisible, int) or divisible < 1):
        flag = name["make_vocab_size_divisible_by"]
        problems.append(
            _problem(
                f"{flag} {divisible} cannot pad the vocabulary: Megatron pads it to a multiple "
                "of make_vocab_size_divisible_by x TP "
                "(megatron/core/tokenizers/utils/build_tokenizer.py:129 at "
                f"core_v0.19.0), which must be a positive integer. Use {flag} 128 "
                "(Megatron's default).",
                "vocab-size-padding",
            )
        )
    return problems


MODEL_FLAGS_BY_DEST = {dest: flag for flag, (dest, _) in MODEL_FLAGS.items()}


def _near_divisible(value: int, by: int) -> str:
    low = value - value % by
    return ", ".join(str(v) for v in sorted({low, low + by}) if v > 0)


def _problem(message: str, rule: str) -> Problem:
    flag = message.split(" ", 1)[0]
    value = message.split(" ", 2)[1]
    fix = message[message.rfind(". ") + 2 :] if ". " in message else None
    return Problem(message=message, rule=rule, flag=flag, value=value, fix=fix)
