"""How Slurm starts a launch: ``srun``/``sbatch``/``salloc`` options, ``#SBATCH`` lines and
``SLURM_*``. Pure Python.

Big jobs start through Slurm. The world size then comes from the allocation:

    srun --nodes 32 --ntasks-per-node 8 python pretrain_gpt.py ...      world = 32 x 8 (one rank per task)
    srun --ntasks 256 python pretrain_gpt.py ...                        world = 256
    srun --nodes 4 --ntasks-per-node 1 torchrun --nproc-per-node 8 --nnodes 4 ...   world = torchrun's 4 x 8

srun's options win over the allocation's (``#SBATCH`` lines, sbatch's and salloc's options, then the
``SLURM_*`` variables of the allocation check runs in). Without ``--ntasks-per-node`` srun starts
one task per node, whatever ``--gpus-per-node`` says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.launch.report import Edit, Note, Problem

__all__ = ["LAUNCHERS", "Slurm", "read_slurm", "slurm_world", "torchrun_under_slurm"]

#: The Slurm commands that start or allocate a job.
LAUNCHERS = ("srun", "sbatch", "salloc")
#: The options check reads: every spelling -> the quantity.
_READ = {
    "--nodes": "nodes",
    "-N": "nodes",
    "--ntasks": "ntasks",
    "-n": "ntasks",
    "--ntasks-per-node": "ntasks_per_node",
    "--gpus-per-node": "gpus_per_node",
}
#: srun/sbatch options that take a value (besides _READ), so their value is not taken for the
#: program.
_VALUED = {
    "--partition",
    "-p",
    "--account",
    "-A",
    "--time",
    "-t",
    "--job-name",
    "-J",
    "--output",
    "-o",
    "--error",
    "-e",
    "--container-image",
    "--container-mounts",
    "--container-workdir",
    "--container-name",
    "--mpi",
    "--cpus-per-task",
    "-c",
    "--mem",
    "--mem-per-gpu",
    "--mem-per-cpu",
    "--export",
    "--gres",
    "--constraint",
    "-C",
    "--qos",
    "-q",
    "--reservation",
    "--nodelist",
    "-w",
    "--exclude",
    "-x",
    "--distribution",
    "-m",
    "--cpu-bind",
    "--gpus",
    "-G",
    "--gpus-per-task",
    "--gpu-bind",
    "--chdir",
    "-D",
    "--dependency",
    "-d",
    "--signal",
    "--wrap",
    "--comment",
    "--network",
    "--switches",
    "--begin",
    "--deadline",
    "--licenses",
    "-L",
    "--open-mode",
    "--input",
    "-i",
    "--ntasks-per-socket",
    "--sockets-per-node",
    "--cores-per-socket",
    "--threads-per-core",
    "--nice",
    "--priority",
    "--wckey",
    "--cluster",
    "-M",
    "--clusters",
}
#: The allocation's variables: the quantity each gives.
_ENVIRONMENT = (
    ("SLURM_NNODES", "nodes"),
    ("SLURM_JOB_NUM_NODES", "nodes"),
    ("SLURM_NTASKS", "ntasks"),
    ("SLURM_NPROCS", "ntasks"),
    ("SLURM_NTASKS_PER_NODE", "ntasks_per_node"),
    ("SLURM_GPUS_PER_NODE", "gpus_per_node"),
)


@dataclass
class Slurm:
    """The Slurm quantities of a launch and how each was given (``srun --nodes 32``, ``#SBATCH -N
    4``, ``SLURM_NNODES=4 from the environment``)."""

    launcher: str | None = None
    """srun, sbatch or salloc where the line has one."""
    values: dict[str, str] = field(default_factory=dict)
    given: dict[str, str] = field(default_factory=dict)
    program_index: int | None = None
    """Where the program srun starts begins in the line's words."""

    def get(self, key: str) -> str | None:
        return self.values.get(key)

    def __bool__(self) -> bool:
        return self.launcher is not None


def read_slurm(
    words: list[str], sbatch: Sequence[str] = (), environment: Mapping[str, str] | None = None
) -> Slurm:
    """The Slurm quantities of a launch: srun's (or sbatch's, salloc's) options in ``words``, over
    the allocation's ``sbatch`` options (``#SBATCH`` lines), over the allocation's ``SLURM_*``
    variables (read only where the line runs through srun)."""
    slurm = Slurm()
    start = next((i for i, w in enumerate(words) if os.path.basename(w) in LAUNCHERS), None)
    if start is None:
        return slurm
    slurm.launcher = os.path.basename(words[start])
    if slurm.launcher == "srun":
        env = os.environ if environment is None else environment
        for name, key in _ENVIRONMENT:
            value = env.get(name)
            if value and key not in slurm.values:
                slurm.values[key], slurm.given[key] = (
                    _first_count(value),
                    f"{name}={value} from the environment",
                )
        _options(list(sbatch), slurm, "#SBATCH")
    slurm.program_index = _options(words[start + 1 :], slurm, slurm.launcher) + start + 1
    return slurm


def _options(words: list[str], slurm: Slurm, source: str) -> int:
    """Read the options at the start of ``words`` into ``slurm``; the index of the first word after
    them."""
    i = 0
    while i < len(words) and words[i].startswith("-"):
        word = words[i]
        name, eq, inline = word.partition("=")
        if not eq and word.startswith("-") and not word.startswith("--") and len(word) > 2:
            name, inline, eq = word[:2], word[2:], "="  # -N32
        takes = name in _READ or name in _VALUED or (eq == "" and _takes_value(words, i))
        value = inline if eq else (words[i + 1] if takes and i + 1 < len(words) else None)
        if name in _READ and value is not None:
            key = _READ[name]
            slurm.values[key] = _first_count(value)
            slurm.given[key] = f"{source} {name} {value}"
        i += 1 if eq or not takes else 2
    return i


def _takes_value(words: list[str], i: int) -> bool:
    """An option check does not know takes the next word as its value unless that word is an option
    or a program."""
    following = words[i + 1] if i + 1 < len(words) else None
    if following is None or following.startswith("-"):
        return False
    program = os.path.basename(following)
    return not (
        program.startswith("python")
        or program
        in ("torchrun", "bash", "sh", "env", "apptainer", "singularity", "numactl", "nsys")
        or following.endswith((".py", ".sh"))
    )


def _first_count(value: str) -> str:
    """``8(x4)`` (SLURM_NTASKS_PER_NODE of a uniform job), ``gpu:8``: the count."""
    return value.split("(")[0].rpartition(":")[2]


def slurm_world(slurm: Slurm, careful: bool = True) -> tuple[int, str, list[Note]]:
    """(the world, where it came from, notes) of srun starting every rank itself: --ntasks, else
    --nodes x --ntasks-per-node (one task per node without it)."""
    ntasks, nodes, per_node, gpus = (
        slurm.get(k) for k in ("ntasks", "nodes", "ntasks_per_node", "gpus_per_node")
    )
    notes = []
    if ntasks is not None:
        world, given = read_int("srun --ntasks", ntasks), slurm.given["ntasks"]
    else:
        node_count = read_int("srun --nodes", nodes) if nodes is not None else 1
        tasks = read_int("srun --ntasks-per-node", per_node) if per_node is not None else 1
        given = " x ".join(
            [
                slurm.given.get("nodes", "1 node"),
                slurm.given.get("ntasks_per_node", "1 task per node (srun's default)"),
            ]
        )
        world = node_count * tasks
        if per_node is None and gpus is not None and gpus.isdigit() and int(gpus) > 1:
            notes.append(
                Note(
                    severity="careful",
                    text=f"srun starts one task per node without --ntasks-per-node: "
                    f"--gpus-per-node {gpus} gives each task {gpus} GPUs, not {gpus} ranks. Add "
                    "--ntasks-per-node "
                    f"{gpus} for a rank per GPU.",
                )
            )
    notes.append(
        Note(
            severity="careful",
            text="srun starts each rank itself: Megatron reads WORLD_SIZE, RANK and LOCAL_RANK "
            "from "
            "the environment, which srun does not set; export them from SLURM_NTASKS, "
            "SLURM_PROCID, SLURM_LOCALID.",
        )
    )
    return world, given, notes if careful else []


def torchrun_under_slurm(slurm: Slurm, nnodes_flag: str, nnodes: int | None) -> list[Problem]:
    """srun starting torchrun on several nodes: torchrun's --nnodes (as the line spells it:
    ``nnodes_flag``) must say how many, or each node's torchrun starts a world of its own."""
    nodes = slurm.get("nodes")
    if slurm.launcher != "srun" or nodes is None or not nodes.isdigit() or int(nodes) < 2:
        return []
    if nnodes is None:
        return [
            Problem(
                message=f"{slurm.given['nodes']} starts torchrun on {nodes} nodes, but torchrun "
                f"has no {nnodes_flag}: "
                "each node's torchrun starts a world of its own (--nnodes defaults to 1), so "
                f"{nodes} runs train apart. Give torchrun {nnodes_flag} {nodes} and one "
                "rendezvous endpoint (--rdzv-endpoint).",
                rule="slurm-torchrun-nodes",
                flag=nnodes_flag,
                fix=f"Give torchrun {nnodes_flag} {nodes}.",
                edit=Edit(give=(("--nnodes", (nodes,)),)),
            )
        ]
    if nnodes != int(nodes):
        return [
            Problem(
                message=f"{slurm.given['nodes']} starts torchrun on {nodes} nodes, but "
                f"torchrun's {nnodes_flag} is "
                f"{nnodes}: the rendezvous waits for {nnodes} nodes. Make them agree.",
                rule="slurm-torchrun-nodes",
                flag=nnodes_flag,
                value=str(nnodes),
                fix="Make them agree.",
            )
        ]
    return []
