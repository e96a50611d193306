"""How a launch splits its layers over (virtual) pipeline stages, as Megatron reads its flags. Pure
Python.

The virtual pipeline size (VPP, model chunks per pipeline rank) comes from one of, in Megatron's
order (``megatron/training/arguments.py``, the same from core_v0.16.1 to main):

    --hybrid-layer-pattern  'M*M|M*M|...'   VPP = segments / PP     (segments = '|' count + 1; > PP)
    --pipeline-model-parallel-layout        VPP = stages / PP        (stages after unrolling '(..)*n')
    --num-layers-per-virtual-pipeline-stage VPP = (L + E + S) / PP / that
    --num-virtual-stages-per-pipeline-rank  VPP = that

where L = --num-layers, E = 1 with --account-for-embedding-in-pipeline-split, S = 1 with
--account-for-loss-in-pipeline-split; a VPP of 1 is no interleaving. The layers must then split
evenly: (L + E + S) % PP == 0 and, interleaved, (L + E + S) / PP % VPP == 0; with an uneven first or
last stage (--decoder-first/last-pipeline-num-layers) the middle stages split the rest, and each
stage's layers divide by VPP (TransformerConfig and get_num_layers_to_build). Every broken rule is a
:class:`LayerSplitError` (Megatron asserts them) naming Megatron's flags and its own reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ga_ext.core.rules import divisor_list, nearest_multiples
from megatron_ga_ext.errors import LayerSplitError
from megatron_ga_ext.launch.pipeline_layout import LAYOUT, layout_stage_count

__all__ = [
    "LayerSplit",
    "VirtualPipeline",
    "virtual_pipeline",
]

HYBRID = "--hybrid-layer-pattern"
PER_STAGE = "--num-layers-per-virtual-pipeline-stage"
PER_RANK = "--num-virtual-stages-per-pipeline-rank"
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING, LOSS = (
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
)


@dataclass(kw_only=True, frozen=True)
class LayerSplit:
    """The flags that split the layers over pipeline stages (Megatron's names)."""

    pipeline_model_parallel_size: int = 1
    num_layers: int | None = None
    decoder_num_layers: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    pipeline_model_parallel_layout: str | None = None
    hybrid_layer_pattern: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def extra_layers(self) -> int:
        """E + S: the embedding and the loss, counted as layers in the split when asked."""
        return int(self.account_for_embedding_in_pipeline_split) + int(
            self.account_for_loss_in_pipeline_split
        )

    @property
    def uneven(self) -> bool:
        return (
            self.decoder_first_pipeline_num_layers is not None
            or self.decoder_last_pipeline_num_layers is not None
        )


@dataclass(kw_only=True)
class VirtualPipeline:
    """What the flags give: VPP (None: not interleaved), the flags it came from, and every broken
    rule."""

    size: int | None = None
    given: str | None = None
    """The flags VPP comes from, for messages, e.g. ``--num-virtual-stages-per-pipeline-rank 2``."""
    problems: list[LayerSplitError] = field(default_factory=list)


def virtual_pipeline(split: LayerSplit) -> VirtualPipeline:
    """VPP of ``split`` as Megatron derives it, and every rule the split breaks (see the module
    docstring)."""
    result = VirtualPipeline()
    if split.pipeline_model_parallel_size < 1:
        # no split to derive: the layout's own checks name --pipeline-model-parallel-size
        return result
    for flag, value in (
        ("--num-layers", split.num_layers),
        ("--decoder-num-layers", split.decoder_num_layers),
    ):
        if value is not None and value < 1:
            result.problems.append(
                LayerSplitError(
                    f"{flag} {value} must be at least 1: a model has layers to split over the "
                    "pipeline stages. Give a "
                    f"whole number >= 1."
                )
            )
    for flag, value in (
        (PER_STAGE, split.num_layers_per_virtual_pipeline_stage),
        (PER_RANK, split.num_virtual_stages_per_pipeline_rank),
    ):
        if value is not None and value < 1:
            result.problems.append(
                LayerSplitError(
                    f"{flag} {value} must be at least 1: it sets how the layers of each pipeline "
                    "stage split into "
                    f"virtual stages. Give a whole number >= 1, or leave {flag} out."
                )
            )
    if result.problems:
        return result
    if split.hybrid_layer_pattern is not None:
        _hybrid(split, split.hybrid_layer_pattern, result)
        return result
    chosen = [
        f
        for f, v in (
            (PER_STAGE, split.num_layers_per_virtual_pipeline_stage),
            (PER_RANK, split.num_virtual_stages_per_pipeline_rank),
            (LAYOUT, split.pipeline_model_parallel_layout),
        )
        if v is not None
    ]
    if len(chosen) > 1:
        result.problems.append(
            LayerSplitError(
                f"{' and '.join(chosen)} are both given; Megatron asserts that no more than one "
                f"of {PER_STAGE}, {PER_RANK} and {LAYOUT} is set. Keep one."
            )
        )
        return result
    if split.pipeline_model_parallel_layout is not None:
        _from_layout(split, split.pipeline_model_parallel_layout, result)
    elif (per_stage := split.num_layers_per_virtual_pipeline_stage) is not None:
        _from_layers_per_stage(split, per_stage, result)
    elif split.num_virtual_stages_per_pipeline_rank is not None:
        result.size = split.num_virtual_stages_per_pipeline_rank
        result.given = f"{PER_RANK} {result.size}"
    if result.size == 1:
        result.size = None
    if not result.problems and split.pipeline_model_parallel_layout is None:
        result.problems += _split_problems(split, result)
    return result


def _hybrid(split: LayerSplit, pattern: str, result: VirtualPipeline) -> None:
    """--hybrid-layer-pattern (``pattern``) sets the layers and the pipeline segments itself; the
    other flags conflict. VPP = '|' segments / PP where there are more segments than pipeline
    ranks."""
    main = pattern.split("/")[0]
    conflicts = [
        f
        for f, on in (
            (PER_STAGE, split.num_layers_per_virtual_pipeline_stage is not None),
            (PER_RANK, split.num_virtual_stages_per_pipeline_rank is not None),
            (LAYOUT, split.pipeline_model_parallel_layout is not None),
            (EMBEDDING, split.account_for_embedding_in_pipeline_split),
            (LOSS, split.account_for_loss_in_pipeline_split),
            (FIRST, "|" in main and split.decoder_first_pipeline_num_layers is not None),
            (LAST, "|" in main and split.decoder_last_pipeline_num_layers is not None),
        )
        if on
    ]
    for flag in conflicts:
        result.problems.append(
            LayerSplitError(
                f"{flag} is given with {HYBRID}; Megatron asserts it should not be: the "
                "pattern's '|' segments define "
                f"the pipeline stages (and virtual stages). Drop {flag}."
            )
        )
    segments, pp = main.count("|") + 1, split.pipeline_model_parallel_size
    if segments == 1 and pp > 1:
        return  # no pipes: Megatron splits the layers over PP itself, without interleaving
    if segments % pp:
        result.problems.append(
            LayerSplitError(
                f"{HYBRID} {pattern!r} has {segments} pipeline segments ('|' separated), not a "
                f"multiple of --pipeline-model-parallel-size {pp}; Megatron asserts the "
                "segments divide evenly over "
                f"the pipeline ranks. Use {', '.join(map(str, nearest_multiples(segments, pp)))} "
                "segments."
            )
        )
        return
    if segments > pp:
        result.size = segments // pp
        result.given = f"{HYBRID}: {segments} segments / --pipeline-model-parallel-size {pp}"


def _from_layout(split: LayerSplit, text: str, result: VirtualPipeline) -> None:
    """VPP = stages of --pipeline-model-parallel-layout (``text``) / PP; the flags that place layers
    conflict."""
    pp = split.pipeline_model_parallel_size
    try:
        stages = layout_stage_count(text)
    except LayerSplitError as error:
        result.problems.append(error)
        return
    conflicts = [
        f
        for f, on in (
            (FIRST, split.decoder_first_pipeline_num_layers is not None),
            (LAST, split.decoder_last_pipeline_num_layers is not None),
            (EMBEDDING, split.account_for_embedding_in_pipeline_split),
            (LOSS, split.account_for_loss_in_pipeline_split),
        )
        if on
    ]
    for flag in conflicts:
        result.problems.append(
            LayerSplitError(
                f"{flag} is given with {LAYOUT}; Megatron refuses it "
                '("pipeline_model_parallel_layout cannot be set with other pipeline layout '
                'arguments"): the layout places every layer itself. '
                f"Drop {flag}."
            )
        )
    if stages % pp:
        result.problems.append(
            LayerSplitError(
                f"{LAYOUT} {text!r} has {stages} stages, not a multiple of "
                f"--pipeline-model-parallel-size {pp}; Megatron asserts the layout's "
                "length divides by PP. Give "
                f"{', '.join(map(str, nearest_multiples(stages, pp)))} stages ('|' "
                "separated)."
            )
        )
        return
    result.size = stages // pp
    result.given = f"{LAYOUT}: {stages} stages / --pipeline-model-parallel-size {pp}"


def _from_layers_per_stage(split: LayerSplit, per_stage: int, result: VirtualPipeline) -> None:
    """VPP = (layers + E + S) / PP / ``per_stage`` (--num-layers-per-virtual-pipeline-stage), where
    each divides."""
    pp = split.pipeline_model_parallel_size
    if split.uneven:
        result.problems.append(
            LayerSplitError(
                f"{PER_STAGE} {per_stage} is given with "
                f"{FIRST if split.decoder_first_pipeline_num_layers else LAST}; "
                f'Megatron asserts: "please use {PER_RANK} to specify virtual pipeline parallel '
                "degree when enable "
                f'uneven pipeline parallelism". Give {PER_RANK} N instead of '
                f"{PER_STAGE}{_uneven_sizes(split)}."
            )
        )
        return
    layers = split.num_layers if split.num_layers is not None else split.decoder_num_layers
    if layers is None:
        result.problems.append(
            LayerSplitError(
                f"{PER_STAGE} {per_stage} needs --num-layers to derive the virtual pipeline size "
                f"(layers / PP / {PER_STAGE})."
            )
        )
        return
    total = layers + split.extra_layers
    if total % pp:
        result.problems.append(
            _not_divisible(
                split,
                layers,
                "number of layers of the model must be divisible pipeline model parallel size",
            )
        )
        return
    if (total // pp) % per_stage:
        result.problems.append(
            LayerSplitError(
                f"{PER_STAGE} {per_stage} does not divide the {total // pp} layers of each "
                "pipeline stage "
                f"({_layers_text(split, layers)} / --pipeline-model-parallel-size {pp}); valid "
                "values: "
                f"{divisor_list(total // pp)}."
            )
        )
        return
    result.size = total // pp // per_stage
    result.given = (
        f"{_layers_text(split, layers)} / --pipeline-model-parallel-size {pp} / {PER_STAGE} "
        f"{per_stage}"
    )


def _uneven_sizes(split: LayerSplit) -> str:
    """``; valid N: 1, 2``: the virtual pipeline sizes the uneven split accepts (each of the first
    and last counts and the middle ranks' layers a multiple of N: TransformerConfig's rules), ""
    where none or --num-layers is unknown."""
    if split.num_layers is None:
        return ""
    probe = VirtualPipeline()
    valid = []
    for size in range(1, max(split.num_layers, 1) + 1):
        probe.size = size
        if not _uneven_problems(split, split.num_layers, probe):
            valid.append(size)
    return f"; valid N: {', '.join(map(str, valid[:12]))}" if valid else ""


def _split_problems(split: LayerSplit, vpp: VirtualPipeline) -> list[LayerSplitError]:
    """The layers over the pipeline ranks (and their virtual stages), when --num-layers is given."""
    layers, pp = split.num_layers, split.pipeline_model_parallel_size
    if layers is None or (pp == 1 and vpp.size is None):
        return []
    if split.uneven:
        return _uneven_problems(split, layers, vpp)
    total = layers + split.extra_layers
    if total % pp:
        return [
            _not_divisible(
                split,
                layers,
                "Number of layers should be divisible by the pipeline-model-parallel size",
            )
        ]
    if vpp.size is not None and (total // pp) % vpp.size:
        return [
            LayerSplitError(
                f"the {total // pp} layers of each pipeline rank ({_layers_text(split, layers)} "
                f"/ --pipeline-model-parallel-size {pp}) do not divide by the virtual "
                f"pipeline size {vpp.size} ({vpp.given}); Megatron asserts "
                "num_layers_per_pipeline_rank % vp_size == 0. Use a virtual pipeline "
                f"size in {{{divisor_list(total // pp)}}}."
            )
        ]
    return []


def _uneven_problems(split: LayerSplit, layers: int, vpp: VirtualPipeline) -> list[LayerSplitError]:
    """An uneven first/last stage of ``layers`` (--num-layers): TransformerConfig's and
    get_num_layers_to_build's rules; the layers the first/last counts leave split evenly over the
    stages they leave (and over VPP)."""
    if split.extra_layers:
        return [
            LayerSplitError(
                f"{FIRST}/{LAST} cannot be combined with {EMBEDDING} or {LOSS}; Megatron refuses "
                "the pair "
                '("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage '
                "cannot be set at the same "
                'time with account_for_embedding_in_pipeline_split"). Keep one way of balancing '
                "the stages."
            )
        ]
    problems: list[LayerSplitError] = []
    middle, stages = layers, split.pipeline_model_parallel_size
    ends = (
        (FIRST, split.decoder_first_pipeline_num_layers),
        (LAST, split.decoder_last_pipeline_num_layers),
    )
    for flag, given in ends:
        if given is None:
            continue
        if given < 1 or (vpp.size is not None and given % vpp.size):
            problems.append(
                LayerSplitError(
                    f"{flag} {given} must be at least 1"
                    f"{' and a multiple of the virtual pipeline size ' if vpp.size else ''}"
                    f"{f'{vpp.size} ({vpp.given})' if vpp.size else ''}; Megatron refuses it "
                    "otherwise."
                )
            )
        middle, stages = middle - given, stages - 1
    if problems:
        return problems
    if bool(middle) != bool(stages) or (stages and middle % stages):
        problems.append(
            LayerSplitError(
                f"--num-layers {split.num_layers} leaves {middle} layers for the {stages} middle "
                "pipeline stage(s) "
                f'after {FIRST}/{LAST}, which do not split evenly; Megatron refuses it ("number '
                "of layers at middle "
                'stage must be divisible by the middle pipeline model parallel size"). Change '
                "--num-layers or the first/last counts."
            )
        )
    elif stages and vpp.size is not None and (middle // stages) % vpp.size:
        problems.append(
            LayerSplitError(
                f"the {middle // stages} layers on each middle pipeline rank do not divide by "
                f"the virtual pipeline size {vpp.size} ({vpp.given}); Megatron "
                "refuses it. Change --num-layers or the first/last counts."
            )
        )
    return problems


def _layers_text(split: LayerSplit, layers: int) -> str:
    extra = [
        f
        for f, on in (
            (EMBEDDING, split.account_for_embedding_in_pipeline_split),
            (LOSS, split.account_for_loss_in_pipeline_split),
        )
        if on
    ]
    if not extra:
        return f"--num-layers {layers}"
    return f"--num-layers {layers} + 1 for each of {' and '.join(extra)} = {layers + len(extra)}"


def _not_divisible(split: LayerSplit, layers: int, reason: str) -> LayerSplitError:
    pp, total = split.pipeline_model_parallel_size, layers + split.extra_layers
    nearest = [
        n - split.extra_layers for n in nearest_multiples(total, pp) if n > split.extra_layers
    ]
    return LayerSplitError(
        f"{_layers_text(split, layers)} is not a multiple of --pipeline-model-parallel-size "
        f"{pp}, so the layers do "
        f'not split evenly over the pipeline stages; Megatron asserts "{reason}". Nearest valid '
        "--num-layers: "
        f"{', '.join(map(str, nearest))}; or an uneven first/last stage ({FIRST}, {LAST})."
    )
