"""A pasted launch script read as the shell reads it, as far as a launch line needs. Pure Python.

Megatron-LM's own example scripts build the line from bash arrays and variables::

    GPUS_PER_NODE=8
    DISTRIBUTED_ARGS=( --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES )
    torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ...

:func:`read_script` runs the parts of bash such a script uses: comments, line continuations, quotes, ``NAME=value``
and ``export NAME=value``, arrays (``NAME=( ... )``, ``NAME+=( ... )``), ``$NAME``, ``${NAME}``,
``${NAME:-default}``, ``${NAME[@]}``, ``${NAME[*]}`` and ``$(( arithmetic ))``. An unquoted
expansion is split into words on whitespace as bash splits it (a quoted schedule inside an array
expanded without quotes becomes several words, as it does for Megatron); a quoted ``"${NAME[@]}"``
keeps each element one word. A variable the script does not set is read from the environment
(``SLURM_NNODES`` inside an allocation), else left as written, so a number flag names it.
``#SBATCH`` lines are kept as the allocation's options. The launch is the last command that runs a
Python script, torchrun or srun; a command that starts with a flag is a continuation the shell never
joins (a missing ``\\``), reported. Everything else bash does (``$(...)``, loops, conditions,
functions) is not run: where the launch cannot be found, the refusal shows the pattern that works
(check inside the script, on the expanded array).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_ga_ext.errors import UsageError

__all__ = ["Script", "is_script", "read_script"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", re.S)
_ARITH = re.compile(r"^[\d\s+\-*/%()]*$")
#: Words that name a launch command (its program, by basename).
_PROGRAMS = ("torchrun", "python", "python3", "srun", "deepspeed", "accelerate")
#: The working pattern, shown where a script cannot be read.
PATTERN = (
    "in the script, check the line the shell expands: LAUNCH=(torchrun ... pretrain_gpt.py ...); "
    'megatron-ga check -- "${LAUNCH[@]}" && exec "${LAUNCH[@]}" (examples/launch.sh)'
)


@dataclass
class Script:
    """What a pasted script gives check: the launch's words, the allocation's ``#SBATCH`` options,
    the variables read from the environment, and lines the shell runs apart from the launch."""

    words: list[str]
    sbatch: list[str] = field(default_factory=list)
    from_environment: dict[str, str] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)
    """Commands that start with a flag: continuation lines of the launch the shell runs on their
    own."""


def is_script(text: str) -> bool:
    """Text to read as bash reads it: several lines not all joined by ``\\``, an array, or a ``$``
    expansion."""
    joined = text.replace("\\\n", " ")
    return (
        "\n" in joined.strip()
        or "$" in joined
        or bool(re.search(r"\b[A-Za-z_][A-Za-z0-9_]*\+?=\(", joined))
    )


def read_script(text: str, environment: Mapping[str, str] | None = None) -> Script:
    """The launch of a pasted script (see the module docstring). UsageError where there is none."""
    env = os.environ if environment is None else environment
    reader = _Reader(env)
    sbatch = [
        line.strip()[len("#SBATCH") :].strip()
        for line in text.splitlines()
        if line.strip().startswith("#SBATCH")
    ]
    launch: list[str] | None = None
    orphans: list[str] = []
    for command in _commands(_tokens(text)):
        words = reader.run(command)
        if not words:
            continue
        if words[0].startswith("--"):
            orphans.append(" ".join(words))
        elif _is_launch(words):
            launch, orphans = words, []
    if launch is None:
        raise UsageError(
            "the pasted script has no launch command check can find (torchrun, python ... .py, "
            f"srun); {PATTERN}."
        )
    sbatch_words = [w for line in sbatch for w in _split_plain(line)]
    return Script(
        words=launch, sbatch=sbatch_words, from_environment=reader.from_environment, orphans=orphans
    )


def _is_launch(words: list[str]) -> bool:
    return any(os.path.basename(w) in _PROGRAMS or w.endswith(".py") for w in words)


def _split_plain(line: str) -> list[str]:
    return line.split("#", 1)[0].split()


# -- the tokens of the shell: words made of literal and expanded parts
# ----------------------------------------

#: A part of a word: (text, quoted, expand). ``expand`` is True for a ``$...`` expansion still to
#: do.
Part = tuple[str, bool, bool]
Word = list[Part]
#: A token: a word, or an operator: "\n" (end of a command, also ";", "&&", "||", "|"), "(" or ")".
Token = Word | str


def _tokens(text: str) -> list[Token]:
    """The shell's tokens of ``text``: quotes and escapes resolved, comments dropped,
    ``\\``-newlines joined."""
    tokens: list[Token] = []
    word: Word = []
    i, n = 0, len(text)

    def end_word() -> None:
        nonlocal word
        if word:
            tokens.append(word)
            word = []

    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            if text[i + 1] != "\n":
                word.append((text[i + 1], True, False))
            i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise UsageError(
                    f"the pasted script has an unmatched ' (from {text[i : i + 40]!r}); {PATTERN}."
                )
            word.append((text[i + 1 : j], True, False))
            word.append(("", True, False))  # '' is an empty word, not none
            i = j + 1
        elif c == '"':
            i = _double_quoted(text, i + 1, word)
        elif c == "$":
            i = _dollar(text, i, word, quoted=False)
        elif c == "#" and not word:
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in " \t":
            end_word()
            i += 1
        elif c in "\n;|&":
            end_word()
            tokens.append("\n")
            i += 2 if text[i : i + 2] in ("&&", "||") else 1
        elif c in "()":
            end_word()
            tokens.append(c)
            i += 1
        else:
            word.append((c, False, False))
            i += 1
    end_word()
    return tokens


def _double_quoted(text: str, i: int, word: Word) -> int:
    word.append(("", True, False))
    while i < len(text) and text[i] != '"':
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in '"\\$`\n':
            if text[i + 1] != "\n":
                word.append((text[i + 1], True, False))
            i += 2
        elif c == "$":
            i = _dollar(text, i, word, quoted=True)
        else:
            word.append((c, True, False))
            i += 1
    if i >= len(text):
        raise UsageError(f'the pasted script has an unmatched " ; {PATTERN}.')
    return i + 1


def _dollar(text: str, i: int, word: Word, quoted: bool) -> int:
    """``$...`` at ``text[i]``: its source text, to expand (a part with expand=True)."""
    rest = text[i + 1 :]
    if rest.startswith("(("):
        end = _closing(text, i + 3, "((", "))")
    elif rest.startswith("("):
        end = _closing(text, i + 2, "(", ")")
    elif rest.startswith("{"):
        end = text.find("}", i)
        end = len(text) if end < 0 else end + 1
    else:
        match = _NAME.match(rest) or re.match(r"[0-9@*#?$!-]", rest)
        if match is None:
            word.append(("$", quoted, False))
            return i + 1
        end = i + 1 + match.end()
    word.append((text[i:end], quoted, True))
    return end


def _closing(text: str, i: int, opening: str, closing: str) -> int:
    depth = 1
    while i < len(text) and depth:
        if text.startswith(closing, i):
            depth -= 1
            i += len(closing)
        elif text.startswith(opening, i):
            depth += 1
            i += len(opening)
        else:
            i += 1
    return i


def _commands(tokens: list[Token]) -> list[list[Token]]:
    """``tokens`` cut at the end of each command; an array's parentheses keep its newlines
    inside."""
    commands: list[list[Token]] = []
    current: list[Token] = []
    depth = 0
    for token in tokens:
        if token == "(":
            depth += 1
        elif token == ")":
            depth = max(depth - 1, 0)
        if token == "\n" and depth == 0:
            if current:
                commands.append(current)
            current = []
        elif token != "\n":
            current.append(token)
    if current:
        commands.append(current)
    return commands


# -- running the commands: assignments, arrays, expansions
# ---------------------------------------------------


class _Reader:
    def __init__(self, environment: Mapping[str, str]) -> None:
        self.environment = environment
        self.variables: dict[str, list[str]] = {}
        self.from_environment: dict[str, str] = {}

    def run(self, command: list[Token]) -> list[str]:
        """Run the assignments of ``command``; the words of what it runs (none for an assignment
        alone)."""
        tokens = list(command)
        if (
            tokens
            and tokens[0] != "("
            and self._literal(tokens[0]) in ("export", "local", "declare", "readonly")
        ):
            tokens = tokens[1:]
        while tokens and not isinstance(first := tokens[0], str):
            assignment = _ASSIGN.match(self._literal(first))
            if assignment is None:
                break
            name, append, _ = assignment.groups()
            if len(tokens) > 1 and tokens[1] == "(":
                end = tokens.index(")", 1) if ")" in tokens[1:] else len(tokens)
                elements = [
                    w for t in tokens[2:end] if not isinstance(t, str) for w in self.expand(t)
                ]
                self.variables[name] = (self.variables.get(name, []) if append else []) + elements
                tokens = tokens[end + 1 :]
            else:
                value = self._assigned(first, len(name) + len(append) + 1)
                held = self.variables.get(name, [""])
                self.variables[name] = [held[0] + value, *held[1:]] if append else [value]
                tokens = tokens[1:]
        return [w for t in tokens if not isinstance(t, str) for w in self.expand(t)]

    def _literal(self, token: Token) -> str:
        return (
            token
            if isinstance(token, str)
            else "".join(text for text, _, expand in token if not expand)
        )

    def _assigned(self, word: Word, skip: int) -> str:
        """The value of ``NAME=value``: expanded without word splitting (bash does not split an
        assignment)."""
        out, dropped = [], 0
        for text, _, expand in word:
            if dropped < skip and not expand:
                take = min(skip - dropped, len(text))
                text, dropped = text[take:], dropped + take
            out.append(" ".join(self._expansion(text)) if expand else text)
        return "".join(out)

    def expand(self, word: Word) -> list[str]:
        """The words ``word`` becomes: expansions in quotes joined into the word, unquoted ones
        split on whitespace, a quoted ``${A[@]}`` one word per element."""
        words: list[str] = []
        current, has = "", False
        for text, quoted, expand in word:
            if not expand:
                current, has = current + text, has or quoted or bool(text)
                continue
            values = self._expansion(text)
            if quoted and text.endswith("[@]}"):
                pieces = values
            elif quoted:
                pieces = [" ".join(values)]
            else:
                pieces = " ".join(values).split()
                if not pieces:
                    continue
            if len(pieces) == 1:
                current, has = current + pieces[0], True
                continue
            words.append(current + pieces[0])
            words.extend(pieces[1:-1])
            current, has = pieces[-1], True
        if has:
            words.append(current)
        return words

    def _expansion(self, source: str) -> list[str]:
        """The value(s) of ``$NAME``, ``${...}`` or ``$((...))``; unknown ones as written."""
        if source.startswith("$(("):
            return [self._arithmetic(source[3:-2])]
        if source.startswith("$("):
            return [source]
        body = source[2:-1] if source.startswith("${") else source[1:]
        name, _, default = body.partition(":-")
        index = None
        if name.endswith("]") and "[" in name:
            name, _, index = name[:-1].partition("[")
        values = self._variable(name)
        if values is None:
            return [default] if default or ":-" in body else [source]
        if index in ("@", "*"):
            return values
        if index is not None and index.isdigit():
            return [values[int(index)]] if int(index) < len(values) else [""]
        return values[:1]

    def _variable(self, name: str) -> list[str] | None:
        if name in self.variables:
            return self.variables[name]
        if _NAME.fullmatch(name) and name in self.environment:
            self.from_environment[name] = self.environment[name]
            return [self.environment[name]]
        return None

    def _arithmetic(self, expression: str) -> str:
        """``$((...))`` over whole numbers with + - * / %: the variables substituted first; as
        written otherwise."""
        text = re.sub(
            r"\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
            lambda m: (self._variable(m.group(1)) or [m.group(0)])[0],
            expression,
        )
        if not _ARITH.match(text) or len(text) > 200:
            return f"$(({expression}))"
        try:
            return str(_evaluate(text))
        except (ValueError, ZeroDivisionError, IndexError):
            return f"$(({expression}))"


def _evaluate(text: str) -> int:
    """Whole-number arithmetic as bash does it (``/`` truncates), by recursive descent: + - * / % (
    )."""
    tokens: list[str] = re.findall(r"\d+|[-+*/%()]", text)
    position = 0

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        position += 1
        return tokens[position - 1]

    def atom() -> int:
        token = take()
        if token == "(":
            value = total()
            if take() != ")":
                raise ValueError("unbalanced")
            return value
        if token == "-":
            return -atom()
        if token == "+":
            return atom()
        return int(token)

    def product() -> int:
        value = atom()
        while peek() in ("*", "/", "%"):
            op, right = take(), atom()
            quotient = int(value / right) if op != "*" else 0  # bash truncates toward zero
            value = (
                value * right if op == "*" else quotient if op == "/" else value - right * quotient
            )
        return value

    def total() -> int:
        value = product()
        while peek() in ("+", "-"):
            value = value + product() if take() == "+" else value - product()
        return value

    result = total()
    if position != len(tokens):
        raise ValueError("trailing")
    return result
