"""Reading and spelling counts exactly: schedule numbers with suffixes, and plain integers from a
command line.

Every number is bounded before it is converted, so no input is slow to read and none reaches
Python's own "Exceeds the limit (4300 digits)" error:

    a count   <= 10**30          (far past any sample or token count; exact as an integer)
    its text  <= MAX_TEXT chars  (checked before any conversion)
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from megatron_ga_ext.errors import GAError, ScheduleError, ScheduleParseError, UsageError

__all__ = [
    "MAX_EXPONENT",
    "MAX_TEXT",
    "SUFFIXES",
    "format_count",
    "is_int",
    "parse_count",
    "read_int",
    "upstream_count",
]

#: Upstream's suffixes (case-insensitive), as exact integers.
SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}

#: Values above 10**MAX_EXPONENT are refused: far past any sample or token count, and cheap to keep
#: exact.
MAX_EXPONENT = 30

#: The longest number text read at all (digits, sign, point, exponent and suffix).
MAX_TEXT = 64

_INT = re.compile(r"[+-]?\d+")


def is_int(text: str) -> bool:
    """``text`` is decimal digits with an optional sign (any length: :func:`read_int` bounds it)."""
    return _INT.fullmatch(text.strip()) is not None


def read_int(flag: str, text: str, *, error: type[GAError] = UsageError) -> int:
    """An integer written in decimal digits, with an optional sign, of at most 10**MAX_EXPONENT in
    size.

    Raises ``error`` naming ``flag`` for anything else: a float, an unexpanded shell variable, or a
    number too long to be a size (checked on the text, before Python converts it).
    """
    body = text.strip()
    if len(body) > MAX_TEXT:
        shown = f"{body[:12]}...{body[-4:]}"
        raise error(
            f"{flag} value {shown!r} has {len(body)} characters; sizes and counts here are whole "
            "numbers up to "
            f"1e{MAX_EXPONENT} (at most {MAX_EXPONENT + 1} digits). Give a smaller number."
        )
    if not is_int(body):
        raise error(f"{flag} {text!r} is not an integer; give a whole number such as 4.")
    value = int(body)
    if abs(value) > 10**MAX_EXPONENT:
        raise error(
            f"{flag} {body} is larger than 1e{MAX_EXPONENT}; no launch has that many. Give a "
            "smaller number."
        )
    return value


def parse_count(text: str, what: str = "value", *, signed: bool = False) -> Fraction:
    """Read ``text`` exactly: a decimal number with an optional suffix K, M, B or T (either case).

    ``what`` names the value in error messages. Returns a Fraction >= 0 (it may be fractional; the
    caller decides whether it must be whole). Raises ScheduleParseError for anything else (unknown
    suffix, nan, inf, not a number, too long) and ScheduleError for a negative value, unless
    ``signed``: then a negative value is returned, for a caller with its own range and message.
    """
    if len(text.strip()) > MAX_TEXT:
        raise ScheduleParseError(
            f"{what} is {len(text.strip())} characters long; numbers here are at most {MAX_TEXT} "
            "characters "
            f"(values up to 1e{MAX_EXPONENT}). Write it plainly, e.g. 250B."
        )
    body, multiplier = _split_suffix(text)
    if body and body[-1].isalpha() and _is_decimal(body[:-1]):
        raise ScheduleParseError(
            f"{what} {text!r} has an unknown suffix {body[-1]!r}; the suffixes are K (1e3), M "
            "(1e6), B (1e9) "
            f"and T (1e12), in either case."
        )
    try:
        number = Decimal(body)
    except InvalidOperation:
        raise ScheduleParseError(
            f"{what} {text!r} is not a number; write digits with an optional suffix K, M, B or "
            "T, e.g. 250B."
        ) from None
    _check_decimal(number, text, what, multiplier, signed)
    value = Fraction(number) * multiplier
    if abs(value) > 10**MAX_EXPONENT:  # exactly, now that the digits are known to be few
        raise _too_large(what, text)
    return value


def _check_decimal(number: Decimal, text: str, what: str, multiplier: int, signed: bool) -> None:
    if (
        not number.is_finite()
    ):  # nan, snan (with payloads such as nan5), inf, in any sign: before any comparison
        raise ScheduleParseError(
            f"{what} {text!r} is not a finite number; give a whole number such as 1000 or 1K."
        )
    if number.is_signed() and number != 0 and not signed:
        raise ScheduleError(
            f"{what} {text!r} is negative; thresholds and batch sizes count samples, so use >= 0."
        )
    if number != 0 and number.as_tuple().exponent < -MAX_EXPONENT:  # type: ignore[operator]
        raise ScheduleParseError(
            f"{what} {text!r} has more than {MAX_EXPONENT} decimal places; write it plainly."
        )
    if (
        number != 0 and number.adjusted() + len(str(multiplier)) - 1 > MAX_EXPONENT
    ):  # before 1e999999 is built
        raise _too_large(what, text)


def _too_large(what: str, text: str) -> ScheduleParseError:
    return ScheduleParseError(
        f"{what} {text!r} is larger than 1e{MAX_EXPONENT}; no run consumes that much."
    )


def _split_suffix(text: str) -> tuple[str, int]:
    """``text`` stripped and upper-cased, less a known suffix, and that suffix's multiplier (1 if
    none)."""
    body = text.strip().upper()
    if body and body[-1] in SUFFIXES:
        return body[:-1], SUFFIXES[body[-1]]
    return body, 1


def _is_decimal(text: str) -> bool:
    try:
        Decimal(text)
    except InvalidOperation:
        return False
    return True


def upstream_count(text: str) -> int:
    """What megatron-core >= 0.18 reads for ``text``: int(float(number) * multiplier) (for
    comparison only)."""
    body, multiplier = _split_suffix(text)
    return int(float(body) * multiplier)


def format_count(value: int) -> str:
    """The shortest spelling of ``value`` that both this parser and upstream's float parser read
    exactly; above 2**53 upstream's float cannot hold every integer, so only this parser reads the
    digits exactly."""
    for suffix, multiplier in sorted(SUFFIXES.items(), key=lambda item: -item[1]):
        if value and value % multiplier == 0:
            text = f"{value // multiplier}{suffix}"
            if upstream_count(text) == value:
                return text
    return str(value)
