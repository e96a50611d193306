"""The world size a launch line starts: --world-size, torchrun's --nnodes x --nproc-per-node,
Slurm's tasks, or ``megatron-ga check --world-size`` where the line leaves it open. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.report import Note, Problem
from megatron_ga_ext.launch.slurm import slurm_world, torchrun_under_slurm

__all__ = ["Found", "checked_world"]


@dataclass
class Found:
    """What reading the world size finds besides the number (check only)."""

    problems: list[Problem] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)


def checked_world(
    launch: Launch,
    ints: dict[str, int],
    given: dict[str, str],
    world_size: int | None,
    found: Found | None,
) -> int:
    """The world size: the line's, else ``world_size`` (check's --world-size). With ``found``
    (check), a ``world_size`` the line contradicts (its own --world-size or --nnodes x
    --nproc-per-node, or one that is not a multiple of --nproc-per-node where --nnodes is left open)
    is a problem, and the line's world is kept; without ``found``, ``world_size`` wins."""
    if world_size is None:
        return _world_size(launch, ints, given, found)
    if found is None:
        return world_size
    check = f"megatron-ga check --world-size {world_size}"
    try:
        line_world = _world_size(launch, ints, given, found)
    except UsageError:
        line_world = None
    nproc = launch.get("--nproc-per-node")
    open_nodes = (
        "world_size" not in ints and launch.get("--nnodes") is None and line_world is not None
    )
    if line_world == world_size:
        return world_size  # the same world, given twice
    if line_world is None or (open_nodes and world_size % line_world == 0):
        per_node = f"{launch.name('--nproc-per-node')} {nproc}"
        nodes = "" if line_world is None else f" = {world_size // line_world} nodes x {per_node}"
        given["world_size"] = check + nodes
        return world_size
    if open_nodes:
        reason = (
            f"is not a multiple of the line's {launch.name('--nproc-per-node')} {nproc} (ranks "
            "per node), so no "
            f"number of nodes gives it"
        )
    else:
        line_given = given.get("world_size", f"--world-size {line_world}")
        reason = f"contradicts the line, whose {line_given} start {line_world:,} ranks"
    found.problems.append(
        Problem(
            message=f"{check} {reason}: the ledger shows the line's {line_world:,}. Drop check's "
            "--world-size, or "
            f"change the line's launcher flags.",
            rule="world-size-contradiction",
            flag="--world-size",
            value=str(world_size),
            fix="Drop check's --world-size, or change the line's launcher flags.",
        )
    )
    return line_world


def _world_size(
    launch: Launch, ints: dict[str, int], given: dict[str, str], found: Found | None = None
) -> int:
    """--world-size, else torchrun's --nnodes x --nproc-per-node, else Slurm's tasks; ``given``
    records the flags used, ``found`` (check) what Slurm's start changes."""
    if "world_size" in ints:
        return ints["world_size"]
    nproc_flag = launch.name("--nproc-per-node")
    nnodes, nproc = launch.get("--nnodes"), launch.get("--nproc-per-node")
    if nproc is None and launch.slurm.launcher == "srun" and launch.slurm.values:
        world, given["world_size"], notes = slurm_world(launch.slurm, careful=found is not None)
        if found is not None:
            found.notes += notes
        return world
    if (
        nproc is None and "WORLD_SIZE" in launch.env
    ):  # torch.distributed's own variable, set before the command
        given["world_size"] = f"the prefix WORLD_SIZE={launch.env['WORLD_SIZE']}"
        return read_int("WORLD_SIZE", launch.env["WORLD_SIZE"])
    if nproc is None:
        raise UsageError(
            "the world size is unknown: give torchrun's --nproc-per-node (and --nnodes), srun's "
            "--nodes and --ntasks-per-node, or megatron-ga check --world-size N -- "
            "<launch line>."
        )
    if nproc.strip() in ("gpu", "cpu", "auto", "xpu"):  # torchrun's own choices
        raise UsageError(
            f"{nproc_flag} {nproc} leaves the world size to the machine; pass it with "
            "megatron-ga check --world-size N -- <launch line>."
        )
    per_node = read_int(nproc_flag, nproc)
    nodes = _nnodes(launch, nnodes)
    given["world_size"] = (
        f"{launch.name('--nnodes')} {nodes} x {nproc_flag} {per_node}"
        if nnodes is not None
        else f"{nproc_flag} {per_node}"
    )
    if found is not None:
        found.problems += torchrun_under_slurm(
            launch.slurm, launch.name("--nnodes"), nodes if nnodes is not None else None
        )
    return nodes * per_node


def _nnodes(launch: Launch, text: str | None) -> int:
    """torchrun's --nnodes: N, MIN:MAX with MIN == MAX (a fixed world), or an elastic range."""
    if text is None:
        return 1
    flag = launch.name("--nnodes")
    if ":" in text:
        low, _, high = text.partition(":")
        if low.strip() != high.strip():
            raise UsageError(
                f"{flag} {text} is an elastic range, so the world size is not fixed; pass the "
                "size to check "
                f"with megatron-ga check --world-size N -- <launch line>."
            )
        text = low
    return read_int(flag, text)
