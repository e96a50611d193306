"""Each --ga-* flag is declared once (config/flags.py): GAConfig, add_args, BY_DEST, the launch-line
reading and the docs table are derived from the declaration, and each flag's own rule refuses a bad
value by name."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import typing

import pytest

from megatron_ga_ext.config import flags
from megatron_ga_ext.config.args import add_args
from megatron_ga_ext.config.flags import (
    BY_DEST,
    GA_OPTIONS,
    MODES,
    OPTIONS,
    ZERO_TOKEN_POLICIES,
    GAFlag,
    flag_errors,
    ga_flag,
    whole_number,
)
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.core.megatron_flags import BY_DEST as MEGATRON_BY_DEST
from megatron_ga_ext.core.megatron_flags import MEGATRON_OPTIONS, NOT_MEGATRON
from megatron_ga_ext.errors import OptionError
from megatron_ga_ext.launch.line import ga_values, parse_launch
from tools.doc_tables import flags_table


def test_each_declared_flag_is_a_typed_gaconfig_field_with_its_default():
    hints = typing.get_type_hints(GAConfig)
    defaults = GAConfig()
    for option in GA_OPTIONS:
        assert (
            option.flag == "--ga-" + option.field.replace("_", "-")
            and option.dest == "ga_" + option.field
        )
        assert option.type in typing.get_args(hints[option.field]) + (hints[option.field],)
        assert getattr(defaults, option.field) == option.default
        assert option.help and option.nargs == (0 if option.type is bool else 1)


def test_add_args_parses_every_declared_flag_and_from_args_reads_it_back():
    parser = add_args(argparse.ArgumentParser())
    assert {s for o in GA_OPTIONS for s in o.spellings} <= set(parser._option_string_actions)
    args = parser.parse_args([])
    assert {o.dest: getattr(args, o.dest) for o in GA_OPTIONS} == {
        o.dest: o.default for o in GA_OPTIONS
    }
    assert GAConfig.from_args(args) == GAConfig()
    args = add_args(argparse.ArgumentParser()).parse_args(
        ["--ga-noise-scale", "10", "--no-ga-guards"]
    )
    assert (GAConfig.from_args(args).noise_scale, GAConfig.from_args(args).guards) == (10, False)


def test_by_dest_is_one_table_of_megatrons_flags_and_ours():
    assert {d: o for d, o in BY_DEST.items() if d in MEGATRON_BY_DEST} == MEGATRON_BY_DEST
    assert {o.dest for o in GA_OPTIONS} == set(BY_DEST) - set(MEGATRON_BY_DEST)
    assert all(
        OPTIONS[spelling] is option for option in GA_OPTIONS for spelling in option.spellings
    )


def test_choices_are_listed_once():
    assert OPTIONS["--ga-loss-reduction"].choices is MODES
    assert (
        OPTIONS["--ga-zero-token-policy"].choices is ZERO_TOKEN_POLICIES
    )  # the one list (loss_contract.py has none)


def test_megatron_flags_are_spelled_as_megatrons_parser_spells_them():
    """The spelling only: tests/test_megatron_flags_upstream.py holds each one to Megatron-LM's own
    parsers."""
    spelled = {o.flag for o in MEGATRON_OPTIONS}
    assert "--microbatch-group-size-per-virtual-pipeline-stage" in spelled
    assert not spelled & set(NOT_MEGATRON)
    assert all(o.flag == "--" + o.flag[2:].replace("_", "-") for o in MEGATRON_OPTIONS)


def test_a_launch_line_reads_each_flag_typed_as_declared():
    line = (
        "pretrain_gpt.py --ga-noise-scale 10 --ga-noise-scale-decay 0.5 --ga-checks async "
        "--no-ga-strict --ga-convert-rampup --ga-noise-scale-trace t.jsonl"
    )
    assert ga_values(parse_launch(shlex.split(line))) == {
        "noise_scale": 10,
        "noise_scale_decay": 0.5,
        "checks": "async",
        "strict": False,
        "convert_rampup": True,
        "noise_scale_trace": "t.jsonl",
    }


def test_the_docs_table_has_every_declared_flag_and_its_help():
    table = flags_table()
    assert all(option.flag in table and option.help in table for option in GA_OPTIONS)


def test_a_new_flag_is_one_field():
    """What adding a flag takes: one field; its flag, destination, type and rule are derived from
    it."""

    @dataclasses.dataclass(kw_only=True, frozen=True)
    class Extra:
        example: int = ga_flag(0, rule=whole_number(0, "give 0 or more."), help="an example.")

    (option,) = flags._declared(Extra)
    assert (option.flag, option.dest, option.type, option.nargs, option.default) == (
        "--ga-example",
        "ga_example",
        int,
        1,
        0,
    )
    with pytest.raises(
        OptionError, match=r"^--ga-example -1 is not a whole number >= 0: give 0 or more\.$"
    ):
        option.check(-1)


#: A value each kind of flag refuses, and what its message says.
def _bad(option: GAFlag) -> tuple[object, str]:
    if option.choices:
        return "bogus", rf"is not one of {', '.join(option.choices)}; pick one of them"
    if option.type is bool:
        return "yes", r"is not on or off \(True or False\)"
    if option.type is str:
        return 3, r"is not a str"
    if option.type is int:
        return -1, r"is not a whole number >= \d+: \w"
    return float("nan"), r"is not (in \[0, 1\)|a positive finite number): \w"


@pytest.mark.parametrize("option", GA_OPTIONS, ids=lambda o: o.flag)
def test_each_flags_rule_refuses_a_bad_value_naming_flag_value_rule_and_fix(option):
    value, rule = _bad(option)
    with pytest.raises(OptionError, match=rf"^{option.flag} {value!r} {rule}"):
        GAConfig(**{option.field: value})
    assert str(flag_errors({option.field: value})[option.field]).startswith(
        f"{option.flag} {value!r} "
    )
    with pytest.raises(OptionError, match=rf"^{option.flag} {value!r} {rule}"):
        GAConfig.from_args(argparse.Namespace(**{option.dest: value}))


@pytest.mark.parametrize(
    "field, value",
    [
        ("noise_scale", True),
        ("noise_scale", 2.5),
        ("noise_scale", "3"),
        ("batch_size_warmup_max", 0),
        ("batch_size_warmup_trust", float("inf")),
        ("noise_scale_decay", 1),
        ("noise_scale_decay", -0.1),
    ],
)
def test_nothing_is_rounded_or_coerced(field, value):
    with pytest.raises(OptionError, match=rf"^--ga-{field.replace('_', '-')} {value!r} is not "):
        GAConfig(**{field: value})
