"""Hostile inputs for the fuzz tests (tests/test_fuzz.py): hypothesis strategies for every input
surface.

Each strategy mixes inputs that should work (so the success paths are exercised and their properties
checked) with hostile ones: numbers past every bound, signs, fractions, exponents, unknown suffixes,
nan and inf spellings, Unicode digits, unexpanded shell variables, empty strings, wrong types, and
flags given with too few values. Flag names are Megatron's own, from options.py's declarations.
"""

from __future__ import annotations

from hypothesis import strategies as st

from megatron_ga_ext.config.flags import OPTIONS
from megatron_ga_ext.core.layout import FLAGS
from megatron_ga_ext.core.megatron_flags import NOT_MEGATRON, VIRTUAL_PIPELINE

#: Number spellings that have broken parsers somewhere (Python's int/float/Decimal, upstream's
#: float()).
SPECIAL_NUMBERS = (
    "",
    " ",
    "0",
    "00",
    "-0",
    "+0",
    "1",
    "-1",
    "+4",
    "0.0",
    "1.",
    ".5",
    "1..2",
    "1e",
    "e3",
    "1e3",
    "1E-5",
    "1e400",
    "1e-400",
    "1e30",
    "1e31",
    "2.01K",
    "16.9",
    "1_000",
    "0x10",
    "0b1",
    "nan",
    "NaN",
    "-nan",
    "snan",
    "sNaN123",
    "inf",
    "-inf",
    "Infinity",
    "-Infinity",
    "\u0661\u0662",
    "\uff11\uff12",
    "1" + "0" * 30,
    "1" + "0" * 31,
    "9" * 64,
    "9" * 65,
    "$WORLD",
    "${NPROC}",
    "gpu",
    "auto",
    "cpu",
    "1:4",
    "2:2",
    ":",
    "None",
    "true",
    "-",
    "+",
    ".",
    "--",
    "1k",
    "1K",
    "1m",
    "1M",
    "1b",
    "1B",
    "1t",
    "1T",
    "1G",
    "1kk",
    "k",
    "1.5k",
    "-5k",
    " 8 ",
    "8\n",
    "\t",
)

#: Suffixes: upstream's four in both cases, and some it does not know.
SUFFIXES = ("", "", "k", "K", "m", "M", "b", "B", "t", "T", "G", "x", "kk", "e3", "E-2", "%")


@st.composite
def mostly(
    draw: st.DrawFn, usual: st.SearchStrategy, rare: st.SearchStrategy, odds: int = 4
) -> object:
    """``usual`` ``odds`` times in ``odds + 1``, else ``rare`` (st.one_of picks its distinct
    branches about equally often, and one strategy repeated is one branch); only the branch taken is
    drawn."""
    return draw(usual) if draw(st.integers(0, odds)) else draw(rare)


def numbers() -> st.SearchStrategy[str]:
    """A number as a command line or a schedule spells it, valid or not."""
    plain = st.one_of(st.integers(0, 10**4), st.integers(-(10**40), 10**40)).map(str)
    suffixed = st.builds(
        lambda whole, fraction, suffix: f"{whole}{fraction}{suffix}",
        st.integers(-20, 10**6),
        st.sampled_from(("", "", ".5", ".25", ".001", ".0")),
        st.sampled_from(SUFFIXES),
    )
    return st.one_of(
        plain,
        suffixed,
        st.sampled_from(SPECIAL_NUMBERS),
        st.decimals(allow_nan=True, allow_infinity=True).map(str),
        st.floats().map(repr),
        st.integers(30, 6000).map(lambda n: "9" * n),
        st.text(alphabet="0123456789.+-eEkKmMbBtTxn_ ", max_size=12),
        st.text(max_size=12),
    )


def sizes() -> st.SearchStrategy[str]:
    """A size as a command line spells it: three times in four a small valid number, else
    :func:`numbers`."""
    return mostly(small_sizes(), numbers(), odds=3)


def small_sizes() -> st.SearchStrategy[str]:
    """A size that reads: a small whole number."""
    return st.one_of(
        st.sampled_from(("1", "2", "4", "8", "16", "32", "64")), st.integers(1, 512).map(str)
    )


def python_sizes() -> st.SearchStrategy[object]:
    """A size as a Python caller passes it: mostly small ints, else zero, negatives, huge, bools,
    floats, text."""
    return st.one_of(
        st.sampled_from((1, 2, 4, 8)),
        st.integers(1, 64),
        st.integers(-3, 10**6),
        st.integers(-(10**40), 10**40),
        st.sampled_from(
            (
                True,
                False,
                0,
                -1,
                2.0,
                2.5,
                float("nan"),
                float("inf"),
                "4",
                None,
                10**30,
                10**30 + 1,
            )
        ),
    )


# -- step batch-size schedules ---------------------------------------------------------------------


def _increasing_schedule(stages: list[tuple[int, int, bool]]) -> str:
    """``0:B0 T1:B1 ...`` from (gap, batch, suffixed) per stage; the first gap is not used
    (threshold 0)."""
    parts, threshold = [], 0
    for index, (gap, batch, suffixed) in enumerate(stages):
        threshold += gap if index else 0
        text = (
            f"{threshold // 1000}K"
            if suffixed and threshold % 1000 == 0 and threshold
            else str(threshold)
        )
        parts.append(f"{text}:{batch}")
    return " ".join(parts)


def valid_schedule_texts() -> st.SearchStrategy[str]:
    """Schedules whose thresholds increase from 0 (stage checks may still refuse them for a
    layout)."""
    stage = st.tuples(
        st.sampled_from((1, 16, 64, 1000, 4096, 10**6)) | st.integers(1, 10**5),
        st.sampled_from((8, 16, 32, 64, 128)) | st.integers(1, 2048),
        st.booleans(),
    )
    return st.lists(stage, min_size=1, max_size=6).map(_increasing_schedule)


def schedule_texts() -> st.SearchStrategy[object]:
    """A --step-batch-size-schedule value: valid, near-valid, malformed, or not a string at all."""
    entry = st.one_of(
        st.tuples(numbers(), numbers()).map(lambda pair: f"{pair[0]}:{pair[1]}"),
        st.tuples(sizes(), sizes()).map(lambda pair: f"{pair[0]}:{pair[1]}"),
        st.text(alphabet="0123456789:kKmMbB.-+eE, ", max_size=12),
    )
    joined = st.tuples(
        st.lists(entry, max_size=8), st.sampled_from((" ", ",", ", ", "\t", "\n", "  ", ";"))
    ).map(lambda pair: pair[1].join(pair[0]))
    return st.one_of(
        valid_schedule_texts(),
        joined,
        st.text(max_size=40),
        st.sampled_from((None, 0, b"0:8", ["0:8"])),
    )


def seq_lengths() -> st.SearchStrategy[object]:
    return st.one_of(
        st.none(), st.sampled_from((1, 7, 64, 2048, 4096)), st.integers(1, 10**6), python_sizes()
    )


# -- megatron-ga ledger
# ------------------------------------------------------------------------------


def layout_kwargs() -> st.SearchStrategy[dict]:
    """BatchLayout's keyword arguments (world and MBS always present, as the CLI passes them); each
    size mostly a small valid one, so that many layouts get as far as the batch rules."""
    size = mostly(st.sampled_from((1, 2, 4, 8)), python_sizes(), odds=12)
    optional = {
        name: st.none() | size for name in FLAGS if name not in ("world_size", "micro_batch_size")
    }
    return st.fixed_dictionaries(
        {
            "world_size": mostly(st.sampled_from((1, 2, 4, 8, 16, 64)), python_sizes()),
            "micro_batch_size": size,
        },
        optional={
            **optional,
            "grad_sync": st.sampled_from(("step", "microbatch", "", "never", None)),
        },
    )


def ledger_argv() -> st.SearchStrategy[list[str]]:
    """``megatron-ga ledger`` arguments: a subset of its flags, each as ``--flag=value`` (argparse
    then reads any value, even one starting with '-'), switches bare; sometimes --json."""
    from megatron_ga_ext.cli.main import _ledger_options

    valued = [o.flag for o in _ledger_options() if o.type is not bool] + [VIRTUAL_PIPELINE.flag]
    switches = [o.flag for o in _ledger_options() if o.type is bool]
    pair = st.tuples(st.sampled_from(valued), sizes()).map(lambda p: f"{p[0]}={p[1]}")
    must = st.tuples(sizes(), sizes()).map(
        lambda p: [f"--world-size={p[0]}", f"--micro-batch-size={p[1]}"]
    )
    return st.tuples(
        must,
        st.lists(pair, max_size=6),
        st.lists(st.sampled_from(switches), max_size=2),
        st.sampled_from(([], ["--json"], ["--grad-sync=microbatch"])),
    ).map(lambda parts: [*parts[0], *parts[1], *parts[2], *parts[3]])


def _options(flags: dict[str, st.SearchStrategy[str]]) -> st.SearchStrategy[list[str]]:
    """Some of ``flags``, each as ``--flag=value`` (a value None: the flag alone)."""
    return st.fixed_dictionaries({}, optional=flags).map(
        lambda chosen: [
            flag if value is None else f"{flag}={value}" for flag, value in chosen.items()
        ]
    )


def schedule_options() -> st.SearchStrategy[list[str]]:
    """``megatron-ga schedule``'s options besides the schedule (no --plot: it writes files)."""
    # argparse's own usage errors (SystemExit) are not generated: --lr takes a float,
    # --train-samples and --train-tokens exclude each other, and a value of
    # --planned-data-parallel-sizes must not look like a flag.
    length = _options({"--train-samples": sizes()}) | _options({"--train-tokens": sizes()})
    planned = mostly(small_sizes(), st.sampled_from(("0", "-1", "1.5", "1K", "x", "1e3", "$DP")))
    return st.tuples(
        mostly(
            st.just(["--micro-batch-size=1", "--data-parallel-size=1"]),
            st.tuples(sizes(), sizes()).map(
                lambda p: [f"--micro-batch-size={p[0]}", f"--data-parallel-size={p[1]}"]
            ),
            odds=1,
        ),
        _options(
            {
                "--seq-length": sizes(),
                "--consumed-samples": st.sampled_from(("0", "100", "1M")) | sizes(),
                "--sample-thresholds": st.none(),
                "--pipeline-model-parallel-size": sizes(),
                "--virtual-pipeline-model-parallel-size": sizes(),
                "--microbatch-group-size-per-virtual-pipeline-stage": sizes(),
                "--warn-future-stages": st.none(),
                "--lr": st.sampled_from(("3e-4", "nan", "-1", "inf", "0")),
                "--lr-base-batch-size": sizes(),
                "--json": st.none(),
            }
        ),
        length,
        st.lists(planned, max_size=3).map(
            lambda d: ["--planned-data-parallel-sizes", *d] if d else []
        ),
    ).map(lambda parts: [*parts[0], *parts[1], *parts[2], *parts[3]])


# -- megatron-ga check: launch lines ---------------------------------------------------------------

#: Every flag check reads (each spelling), the ones no Megatron parser has, and some it passes over.
CHECK_FLAGS = sorted(OPTIONS) + sorted(NOT_MEGATRON) + ["--lr", "--save", "--unknown-flag"]
LAYER_PATTERNS = (
    "E|(t|)*3L",
    "(tt|)*2",
    "t*4|t*4",
    "E(t|)*1000000000000L",
    "((t)*2)*3",
    "|",
    "",
    "M*M|M*M",
    "M-M-|M-M-",
    "*-1",
    "(|)*99999999",
    "t*" + "9" * 70,
    "M|M|M|M/MTP",
    "Et|tL",
    "E|t*2|t*2|L",
)
TEXT_VALUES = {
    "--pipeline-model-parallel-layout": LAYER_PATTERNS,
    "--hybrid-layer-pattern": LAYER_PATTERNS,
    "--hybrid-override-pattern": LAYER_PATTERNS,
    "--nnodes": ("1", "2", "1:2", "2:2", "1:1:1", ":"),
    "--nproc-per-node": ("1", "2", "8", "gpu", "auto", "$NPROC", "4.0"),
}


def _spelled(flag: str) -> st.SearchStrategy[str]:
    """A flag as a launch line may spell it: as declared, or with '_' for '-' (torchrun accepts
    both)."""
    return st.sampled_from((flag, "--" + flag[2:].replace("-", "_")))


def _values_of(flag: str, hostile: bool) -> st.SearchStrategy[list[str]]:
    """Values for ``flag``: what its declaration takes (sizes, choices, a schedule, a layout);
    ``hostile``: also any number, and sometimes the wrong number of values."""
    option = OPTIONS.get(flag)
    size = sizes() if hostile else small_sizes()
    if option is not None and option.nargs == 0:
        right = st.just([])
    elif option is not None and option.nargs == 3:
        right = st.lists(size, min_size=3, max_size=3)
    elif option is not None and option.choices:
        right = st.sampled_from(option.choices).map(lambda value: [value])
    elif flag == "--step-batch-size-schedule":
        right = (
            schedule_texts().filter(lambda value: isinstance(value, str))
            if hostile
            else valid_schedule_texts()
        ).map(lambda value: [value])
    elif flag in TEXT_VALUES:
        right = st.sampled_from(TEXT_VALUES[flag][: None if hostile else 3]).map(
            lambda value: [value]
        )
    else:
        right = size.map(lambda value: [value])
    if not hostile:
        return right
    wrong = st.lists(
        st.one_of(numbers(), st.sampled_from(("--", "-5", "--x=1", "tokens"))), max_size=4
    )
    return mostly(right, wrong, odds=5)


def _flag_words(flag: str, hostile: bool) -> st.SearchStrategy[list[str]]:
    def words(parts: tuple[str, list[str], bool]) -> list[str]:
        spelled, values, inline = parts
        if inline and len(values) == 1:
            return [f"{spelled}={values[0]}"]
        return [spelled, *values]

    return st.tuples(_spelled(flag), _values_of(flag, hostile), st.booleans()).map(words)


def launch_tokens(hostile: bool) -> st.SearchStrategy[list[str]]:
    """A launch line as tokens: torchrun's words, --micro-batch-size (mostly), then flags of
    options.py with values each (see :func:`_values_of`), and, ``hostile``, stray words."""
    names = CHECK_FLAGS if hostile else [name for name in CHECK_FLAGS if name in OPTIONS]
    flag = st.one_of(
        [_flag_words(name, hostile) for name in names]
    )  # built once: a flatmap rebuilds per draw
    stray = st.sampled_from(
        ("torchrun", "pretrain_gpt.py", "python", "-m", "-x", "\\", "#", "'", '"', "--")
    ).map(lambda word: [word])
    # Hypothesis favours the first alternatives: the lines that lack the world size or MBS come
    # last.
    prefix = st.sampled_from(
        (
            ["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py"],
            ["--nproc_per_node=2"],
            ["torchrun", "--nnodes", "2", "--nproc_per_node", "4", "pretrain_gpt.py"],
            ["torchrun", "--nproc-per-node=16", "pretrain_gpt.py", "--calculate-per-token-loss"],
            [],
        )
    )
    micro = mostly(_flag_words("--micro-batch-size", hostile), st.just([]))
    words = mostly(flag, stray, odds=3) if hostile else flag
    return st.tuples(prefix, micro, st.lists(words, max_size=10)).map(
        lambda parts: parts[0] + parts[1] + [word for group in parts[2] for word in group]
    )


def check_argv() -> st.SearchStrategy[list[str]]:
    """``megatron-ga check --json [--world-size N] -- LINE``: a line of readable values (so check
    gets as far as the problems) or a hostile one, as tokens or pasted as one string that check
    splits like a shell."""
    tokens = st.one_of(launch_tokens(hostile=False), launch_tokens(hostile=True))
    line = st.one_of(
        tokens,
        st.tuples(tokens, st.sampled_from((" ", " \\\n  ", "\n", " # comment\n "))).map(
            lambda pair: [pair[1].join(pair[0])]
        ),
    )
    world = mostly(st.just([]), sizes().map(lambda size: [f"--world-size={size}"]))
    return st.tuples(world, line).map(lambda parts: ["check", "--json", *parts[0], "--", *parts[1]])


# -- rampups and the calculator
# -----------------------------------------------------------------------


def ramp_values() -> st.SearchStrategy[tuple]:
    """(start, increment, ramp samples, GBS): small ramps, long ones (described, not listed), and
    hostile ones."""
    small = st.tuples(
        st.integers(1, 64), st.integers(1, 32), st.integers(0, 5000), st.integers(1, 1024)
    )
    landing = st.tuples(
        st.integers(1, 64), st.integers(1, 16), st.integers(0, 10**6), st.integers(0, 300)
    ).map(lambda r: (r[0], r[1], r[2], r[0] + r[1] * r[3]))  # the ramp lands on GBS
    long = st.tuples(
        st.integers(1, 10**3),
        st.integers(1, 10**3),
        st.integers(0, 10**15),
        st.integers(10**4, 10**12),
    ).map(lambda r: (r[0], r[1], r[2], r[0] + r[1] * r[3]))
    hostile = st.tuples(python_sizes(), python_sizes(), python_sizes(), python_sizes())
    return st.one_of(small, landing, long, hostile)


def consumed_counts() -> st.SearchStrategy[object]:
    return st.one_of(
        st.integers(0, 10**4),
        st.integers(0, 10**16),
        st.integers(-5, 10**40),
        st.sampled_from((True, 1.5, -1, "8", None)),
    )


@st.composite
def runnable_calculators(draw) -> dict:
    """init_num_microbatches_calculator arguments that mostly run: batch sizes in multiples of MBS x
    DP (a few off by one, some schedules decreasing), by a schedule, a constant GBS or a rampup."""
    mbs, dp = draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2, 3, 8)))
    unit = mbs * dp
    off = st.sampled_from((0, 0, 0, 0, 0, 1))
    arguments = {"rank": 1, "micro_batch_size": mbs, "data_parallel_size": dp}
    kind = draw(st.sampled_from(("schedule", "global_batch_size", "rampup")))
    if kind == "schedule":
        count = draw(st.integers(1, 5))
        multiples = draw(st.lists(st.integers(1, 8), min_size=count, max_size=count))
        if draw(st.integers(0, 3)):
            multiples.sort()
        gaps = draw(st.lists(st.integers(1, 40 * unit), min_size=count - 1, max_size=count - 1))
        thresholds = [sum(gaps[:i]) for i in range(count)]
        seq_length = draw(st.sampled_from((None, None, 1, 64)))
        scale = seq_length or 1
        arguments["step_batch_size_schedule"] = " ".join(
            f"{t * scale}:{m * unit + draw(off)}" for t, m in zip(thresholds, multiples)
        )
        arguments["seq_length"] = seq_length
    elif kind == "global_batch_size":
        arguments["global_batch_size"] = draw(st.integers(1, 16)) * unit + draw(off)
    else:
        start, increment = (
            draw(st.integers(1, 4)) * unit,
            draw(st.integers(1, 4)) * unit + draw(off),
        )
        arguments["rampup_batch_size"] = [start, increment, draw(st.integers(0, 400))]
        arguments["global_batch_size"] = start + increment * draw(st.integers(0, 6))
    arguments["pipeline_model_parallel_size"] = draw(st.sampled_from((1, 1, 2)))
    if arguments["pipeline_model_parallel_size"] > 1:
        arguments["virtual_pipeline_size"] = draw(st.sampled_from((None, 2)))
    arguments["strict_future"] = draw(st.booleans())
    return arguments
