"""Launch Megatron-LM's own pretrain_gpt.py (with the extension through one of its drop-in routes,
or bare for upstream's reference) on the CPU over gloo, or on one CUDA device over NCCL, and read
back what every rank recorded.

The drop-in routes, as a user takes them: ``entry``, the unmodified script run as ``python -m
megatron_ga_ext pretrain_gpt.py ...``; ``one-line``, a copy of the script whose only change is the
line ``ONE_LINE`` at its top.

The ranks are forked by ``tests/support/pretrain_server.py --nproc-per-node N`` after one import of
Megatron (torchrun would start N interpreters that import it N times: 7-12 s each on 2 cores); each
rank gets torchrun's environment and runs the script unchanged. That launcher runs in
``tests/support/pretrain_server.py --serve``, one per Megatron-LM root, forked from its one import
of Megatron, so the import is paid once per source instead of once per launch.

    run = launch(source, "dp2", ["--global-batch-size", "16", ...], extension=True, name="token")
    run.rc, run.iterations (last-stage rows, one per iteration), run.error, run.num_tokens_match

The tiny GPT and the CPU flags are the same for every run; a run adds its batch, loss-mode and
checkpoint flags. ``tests/support/pretrain_server.py`` applies the CPU shims and records.

``device="cuda"`` (tests/gpu): one rank (layout ``dp1``) over NCCL, in a fresh interpreter per
launch with torchrun's environment, not forked from a server: CUDA that the parent touched while
importing cannot be used in a forked child. ``MEGATRON_GA_DEVICE=cuda`` tells pretrain_server to
leave torch.cuda alone (it keeps only the dataset helpers' shim).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ga_ext.testing.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
#: The launcher, run by its path (with ROOT on PYTHONPATH): ``python -m tests...`` from a
#: Megatron-LM checkout would import that checkout's own ``tests`` package.
SERVER = str(Path(__file__).resolve().with_name("pretrain_server.py"))
ONE_LINE = (
    "import megatron_ga_ext; megatron_ga_ext.install()  # megatron-ga-ext: the whole drop-in\n"
)
DROP_INS = ("entry", "one-line")

#: name -> (processes, Megatron flags): DP = world / PP.
LAYOUTS = {
    "dp1": (1, []),
    "dp2": (2, []),
    "pp2dp2": (4, ["--pipeline-model-parallel-size", "2"]),
}
SEQ_LENGTH = 64
MICRO_BATCH_SIZE = 2
#: The device a launch trains on -> Megatron's --distributed-backend there.
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
TINY_GPT = [
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--clip-grad",
    "0",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1024",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(SEQ_LENGTH),
    "--max-position-embeddings",
    str(SEQ_LENGTH),
    "--micro-batch-size",
    str(MICRO_BATCH_SIZE),
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "linear",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "100000",
    "--num-workers",
    "0",
    "--eod-mask-loss",
    "--seed",
    "1234",
]
#: Mock documents of 1-15 tokens: with --eod-mask-loss every micro-batch masks a different share.
DOCUMENT_LENGTH = "16"
TIMEOUT_S = 240
#: How long a launch server may take to import Megatron before its first launch.
IMPORT_TIMEOUT_S = 120


@dataclass
class Run:
    """What a launch did: exit status, the per-rank records, and the tail of its output."""

    name: str
    command: list[str]
    rc: int
    seconds: float
    records: dict[int, list[dict]] = field(default_factory=dict)
    output: str = ""

    @property
    def output_tail(self) -> str:
        return _tail(self.output)

    @property
    def last_stage_ranks(self) -> list[int]:
        return sorted(
            r
            for r, rows in self.records.items()
            if any(x.get("last_stage") for x in _iterations(rows))
        )

    @property
    def iterations(self) -> list[dict]:
        """One row per iteration, from the first last-stage rank (the one that holds the loss)."""
        ranks = self.last_stage_ranks
        return _iterations(self.records[ranks[0]]) if ranks else []

    @property
    def error(self) -> str | None:
        errors = [
            row["error"]
            for rows in self.records.values()
            for row in rows
            if row.get("event") == "end" and row.get("error")
        ]
        return errors[0] if errors else None

    def mask_tokens(self) -> list[int]:
        """Per iteration: the loss-mask sum over every last-stage rank (the global batch's loss
        tokens)."""
        per_rank = [_iterations(self.records[r]) for r in self.last_stage_ranks]
        return [sum(rows[i]["mask_tokens"] for rows in per_rank) for i in range(len(per_rank[0]))]

    def describe(self) -> str:
        return (
            f"{self.name}: rc {self.rc} in {self.seconds:.1f} s\n$ "
            f"{' '.join(self.command)}\n{self.output_tail}"
        )


def _iterations(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row.get("event") == "iteration"]


def launch(
    root: Path,
    layout: str,
    flags: list[str],
    *,
    extension: bool,
    name: str,
    workdir: Path,
    drop_in: str = "entry",
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    device: str = "cpu",
    timeout: float = TIMEOUT_S,
) -> Run:
    """Run pretrain_gpt.py from the Megatron-LM checkout ``root`` as a user would, and collect the
    records (``timeout``: seconds the training may take, on the CPU)."""
    command, environment = launch_command(
        root,
        layout,
        flags,
        extension=extension,
        name=name,
        workdir=workdir,
        drop_in=drop_in,
        python=python,
        env=env,
        device=device,
    )
    for old in workdir.glob(f"{name}.rank*.jsonl"):
        old.unlink()
    start = time.monotonic()
    log = workdir / f"{name}.log"
    if device == "cuda":
        timeout = IMPORT_TIMEOUT_S + TIMEOUT_S  # the launch imports Megatron itself
        rc = _run_alone(command, root, environment, log, timeout)
        output = _read(log) if rc != 124 else f"timed out after {timeout} s\n{_read(log)}"
    else:
        try:
            rc = _server(root, python, environment).run(command[2:], environment, log, timeout)
        except _ServerGone as gone:  # the import failed, or the server died: that launch's failure
            rc, output = 1, f"{gone}\n{_read(gone.log)}"
        else:
            output = _read(log) if rc != 124 else f"timed out after {timeout} s\n{_read(log)}"
    seconds = time.monotonic() - start
    records = {}
    for path in sorted(workdir.glob(f"{name}.rank*.jsonl")):
        rank = int(path.name.rsplit(".rank", 1)[1].split(".")[0])
        records[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return Run(name, command, rc, seconds, records, output)


def launch_command(
    root: Path,
    layout: str,
    flags: list[str],
    *,
    extension: bool,
    name: str,
    workdir: Path,
    drop_in: str = "entry",
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    device: str = "cpu",
) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line and environment for :func:`launch` (run from ``root``); creates
    ``workdir``."""
    if device not in BACKENDS:
        raise ValueError(f"device {device!r} is not one of {tuple(BACKENDS)}")
    processes, layout_flags = LAYOUTS[layout]
    workdir.mkdir(parents=True, exist_ok=True)
    tiny_gpt = list(TINY_GPT)
    tiny_gpt[tiny_gpt.index("--distributed-backend") + 1] = BACKENDS[device]
    if {"--data-path", "--train-data-path"} & set(
        flags
    ):  # a real dataset (benchmarks/corpus.py): its tokenizer
        tiny_gpt.remove("--mock-data")
    # On the CPU the launcher forks the ranks; on a CUDA device this process is the one rank (see
    # the docstring).
    ranks = ["--nproc-per-node", str(processes)] if device == "cpu" else []
    command = [
        python,
        SERVER,
        *ranks,
        *_program(root, workdir, extension, drop_in),
        *tiny_gpt,
        *layout_flags,
        *flags,
    ]
    environment = {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "MEGATRON_GA_RECORD": str(workdir / name),
        "MEGATRON_GA_MOCK_DOCUMENT_LENGTH": DOCUMENT_LENGTH,
        "PYTHONPATH": str(ROOT),
        "MEGATRON_GA_DEVICE": device,
        **(env or {}),
    }
    if device == "cuda":
        if processes != 1:
            raise ValueError(
                f"layout {layout!r} has {processes} ranks; a CUDA launch runs one (layout 'dp1')"
            )
        environment.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    return command, environment


def _run_alone(
    command: list[str], root: Path, environment: dict[str, str], log: Path, timeout: float
) -> int:
    """One launch in an interpreter of its own; its exit status, 124 (its session killed) past
    ``timeout`` s."""
    with open(log, "w") as output:
        process = subprocess.Popen(
            command,
            cwd=root,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return 124


def _program(root: Path, workdir: Path, extension: bool, drop_in: str) -> list[str]:
    """What the launcher runs: upstream's pretrain_gpt.py, or the extension by the drop-in route
    ``drop_in``."""
    script = root / "pretrain_gpt.py"
    if not extension:
        return [str(script)]
    if drop_in == "entry":
        return ["-m", "megatron_ga_ext", str(script)]
    if drop_in != "one-line":
        raise ValueError(f"drop_in {drop_in!r} is not one of {DROP_INS}")
    one_line = workdir / "pretrain_gpt_one_line.py"
    one_line.write_text(ONE_LINE + script.read_text())
    return [str(one_line)]


class _ServerGone(RuntimeError):
    def __init__(self, message: str, log: Path) -> None:
        super().__init__(message)
        self.log = log


class _Server:
    """``python tests/support/pretrain_server.py --serve`` from a Megatron-LM root: each launch
    forked from its one import of Megatron, answered as a JSON line (the fork's pid, then its exit
    status)."""

    def __init__(self, root: Path, python: str, environment: dict[str, str]) -> None:
        self.key = (root, python)
        self.log = (
            Path(os.environ.get("TMPDIR", "/tmp"))
            / f"megatron-ga-serve-{os.getpid()}-{root.name}.log"
        )
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [python, SERVER, "--serve"],
                cwd=root,
                env=environment,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        self._buffer = b""

    def run(self, argv: list[str], environment: dict[str, str], log: Path, timeout: float) -> int:
        """The launch's exit status; 124 (its session killed) past ``timeout`` seconds from its
        fork."""
        request = json.dumps({"argv": argv, "env": environment, "log": str(log)}) + "\n"
        try:
            self.process.stdin.write(request.encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._gone() from None
        try:  # a new server answers once it has imported Megatron
            pid = self._answer(time.monotonic() + IMPORT_TIMEOUT_S)["pid"]
        except TimeoutError:
            raise self._gone() from None
        try:
            return self._answer(time.monotonic() + timeout)["rc"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            self._answer(None)  # the server's answer for the killed launch
            return 124

    def _answer(self, deadline: float | None) -> dict:
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and (
                remaining <= 0 or not select.select([fd], [], [], remaining)[0]
            ):
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise self._gone()
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _gone(self) -> _ServerGone:
        if _SERVERS and _SERVERS[0] is self:
            _SERVERS.pop()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        return _ServerGone(
            f"the launch server ended (status {self.process.wait()}); its output:", self.log
        )

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self._gone()
        else:
            self.log.unlink(
                missing_ok=True
            )  # kept where the server failed (a launch's output names it)


_SERVERS: list[_Server] = []  # the one live server: tests run source by source


def _server(root: Path, python: str, environment: dict[str, str]) -> _Server:
    if _SERVERS and _SERVERS[0].key != (root, python):
        _close_server()
    if not _SERVERS:
        _SERVERS.append(_Server(root, python, environment))
    return _SERVERS[0]


@atexit.register
def _close_server() -> None:
    if _SERVERS:
        server = _SERVERS.pop()
        if server.process.poll() is None:
            server.close()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _tail(output: str, lines: int = 40) -> str:
    interesting = [
        line
        for line in output.splitlines()
        if "Warning" not in line and "warnings.warn" not in line
    ]
    return "\n".join(interesting[-lines:])
