"""The ``--ga-*`` flags on Megatron's parser: ``pretrain(..., extra_args_provider=add_args)``. Pure
Python."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_ga_ext.config.flags import GA_OPTIONS, Option
from megatron_ga_ext.core.megatron_flags import STEP_SCHEDULE


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--ga-*`` flags, for ``pretrain(..., extra_args_provider=add_args)``; on releases
    without ``--step-batch-size-schedule`` it adds that flag too (the backport). A flag the parser
    has already is left as it is, so install()'s own provider and a script's ``args_provider()`` can
    both run."""
    missing = [
        option
        for option in (*GA_OPTIONS, STEP_SCHEDULE)
        if option.flag not in parser._option_string_actions
    ]
    if missing:
        group = parser.add_argument_group(
            "megatron-ga-ext", "checked batch arithmetic (megatron_ga_ext)"
        )
        for option in missing:
            _add(group, option)
    return parser


def _add(group: argparse._ActionsContainer, option: Option) -> None:
    if option.type is bool:
        action = argparse.BooleanOptionalAction if option.negatable else "store_true"
        group.add_argument(
            option.flag, dest=option.dest, action=action, default=option.default, help=option.help
        )
        return
    group.add_argument(
        option.flag,
        dest=option.dest,
        type=option.type,
        default=option.default,
        choices=option.choices or None,
        help=option.help,
    )


def args_provider(
    *others: Callable | None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``others`` (None skipped), then :func:`add_args`."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for other in others:
            if other is not None:
                parser = other(parser)
        return add_args(parser)

    return provide
