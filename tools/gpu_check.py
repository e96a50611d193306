"""One prepared check for the day a GPU is lent: tests/gpu, the CUDA-graph rows, ``megatron-ga
verify --device cuda`` and benchmarks/gpu_overhead.sh on one CUDA device, offline, in under 8
minutes.

    python tools/gpu_check.py wheels              # here, with registry access: .cache/gpu-wheels (make gpu-wheels)
    python tools/gpu_check.py plan [--json]       # the steps, their timeouts, the wheels; runs nothing
    python tools/gpu_check.py run [--out DIR]     # on the GPU machine (make gpu-check; PLAN=1: plan)

Two halves, because the GPU machine's image has Python and torch (CUDA) but no network. ``wheels``
fills .cache/gpu-wheels/ with what tools/gpu-wheels.txt lists: this project's wheel, megatron-core
at the primary leg's pin, the few packages the image lacks, and a Megatron-LM snapshot
(pretrain_gpt.py); the folder travels with the checkout. ``run``, under the python that holds the
image's torch:

1. exits 2 at once where that torch sees no CUDA device (or is missing), or where the wheel folder
   is incomplete;
2. runs each step of :func:`steps` under its own timeout (together under :data:`BUDGET_S`), killing
   a step's processes past it, recording its exit status and going on past a failure;
3. writes into one folder (``--out``, else ``$OUT``, else .cache/gpu-check): gpu-check.log (every
   step's output), the pytest steps' junit xml, verify.json, overhead.json and summary.json; exits 1
   where a step failed.

Stdlib only, so that the plan, the wheel list and the exit without CUDA are tested on the CPU
(tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
CACHE = ROOT / ".cache"
WHEEL_LIST = ROOT / "tools" / "gpu-wheels.txt"
WHEELS = CACHE / "gpu-wheels"
VENV = CACHE / "gpu-check-venv"
RESULTS = CACHE / "gpu-check"
#: The primary leg, whose megatron-core pin the wheels carry; the image's python3 is CPython 3.12
#: too.
PRIMARY_CONSTRAINTS = ROOT / "constraints" / "py3.12.txt"
TARGET_PYTHON = (3, 12)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
#: Every timeout together: the device tool's command limit is 10 minutes, its session's device time
#: 15.
BUDGET_S = 480
#: The wheel folder travels with the working tree, which the device tool caps at 64 MiB in all.
WHEELS_CAP_BYTES = 32 * 2**20
#: The image has these (or must not get them: apex on the registry is an unrelated package).
NEVER_CARRIED = ("torch", "triton", "nvidia-", "transformer-engine", "apex")
LOG, SUMMARY = "gpu-check.log", "summary.json"
TAIL_LINES = 30

PROBE = (
    "import json, platform, torch; ok = torch.cuda.is_available(); print(json.dumps({'python': "
    "platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda, "
    "'devices': torch.cuda.device_count() if ok else 0, 'name': "
    "torch.cuda.get_device_name(0) if ok else None}))"
)


# -- the wheel list
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheel:
    """One line of tools/gpu-wheels.txt: ``build`` (``NAME @ .``), ``download`` (``NAME==VERSION``)
    or ``source``."""

    kind: str
    name: str
    version: str = ""

    @property
    def requirement(self) -> str:
        """What pip installs from the folder (``source`` has none)."""
        return f"{self.name}=={self.version}" if self.version else self.name

    def file_pattern(self) -> str:
        """The file in the wheel folder, as a glob (a wheel's name is spelled with underscores)."""
        if self.kind == "source":
            return self.name
        stem = re.sub(r"[-_.]+", "_", self.name).lower()
        return f"{stem}-{self.version or '*'}-*.whl"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_wheel_list(path: Path = WHEEL_LIST) -> list[Wheel]:
    wheels = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("source "):
            wheels.append(Wheel("source", line.removeprefix("source ").strip()))
        elif re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*\s*@\s*\.", line):
            wheels.append(Wheel("build", line.split("@")[0].strip()))
        elif re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+", line):
            name, version = line.split("==")
            wheels.append(Wheel("download", name, version))
        else:
            raise ValueError(
                f"{path}:{number}: {raw!r} is not 'NAME @ .', 'NAME==VERSION' or 'source FILE'"
            )
    return wheels


def primary_pin(constraints: Path = PRIMARY_CONSTRAINTS) -> str:
    """megatron-core's version in the primary leg's constraints."""
    for line in constraints.read_text().splitlines():
        found = re.fullmatch(r"megatron-core==(\S+)", line.split("#", 1)[0].strip())
        if found:
            return found.group(1)
    raise ValueError(f"{constraints}: no megatron-core==VERSION line")


def wheel_list_problems(wheels: list[Wheel]) -> list[str]:
    """What is wrong with the list: megatron-core off the primary pin, this project missing, a
    package the image has or must not get, a name twice, not exactly one Megatron-LM snapshot."""
    problems = []
    names = [canonical(w.name) for w in wheels if w.kind != "source"]
    core = [w for w in wheels if canonical(w.name) == "megatron-core"]
    if [w.version for w in core] != [primary_pin()]:
        problems.append(
            f"megatron-core must be pinned once at the primary leg's {primary_pin()} "
            f"({PRIMARY_CONSTRAINTS.relative_to(ROOT)}), not {[w.version for w in core]}"
        )
    if [canonical(w.name) for w in wheels if w.kind == "build"] != ["megatron-ga-ext"]:
        problems.append(
            "this project must be the one wheel built from the checkout: 'megatron-ga-ext @ .'"
        )
    problems += [
        f"{name}: the GPU image has it, or it must never be installed"
        for name in names
        if any(name == n or (n.endswith("-") and name.startswith(n)) for n in NEVER_CARRIED)
    ]
    problems += [
        f"{name} is listed twice (two versions stop pip's install)"
        for name in sorted(set(names))
        if names.count(name) > 1
    ]
    if len([w for w in wheels if w.kind == "source"]) != 1:
        problems.append(
            "one Megatron-LM snapshot ('source megatron-lm-<ref>.tar.gz') is needed for "
            "pretrain_gpt.py"
        )
    return problems


def missing_wheels(folder: Path, wheels: list[Wheel]) -> list[str]:
    """The list's entries with no file (or more than one) in ``folder``."""
    return [w.file_pattern() for w in wheels if len(list(folder.glob(w.file_pattern()))) != 1]


def snapshot(wheels: list[Wheel]) -> str:
    return next(w.name for w in wheels if w.kind == "source")


def megatron_lm(folder: Path, wheels: list[Wheel]) -> Path:
    """The Megatron-LM tree the steps run: ``MEGATRON_LM`` where given, else the folder's snapshot,
    unpacked where tools/regress.py's tree() unpacks a tarball (.cache/megatron-lm/<name>)."""
    given = (
        Path(os.environ["MEGATRON_LM"]).expanduser().resolve()
        if os.environ.get("MEGATRON_LM")
        else None
    )
    if given is not None and given.is_dir():
        return given
    tarball = given or folder / snapshot(wheels)
    return CACHE / "megatron-lm" / tarball.name.removesuffix(".tar.gz").removesuffix(".tgz")


# -- the steps
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: int
    what: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stdout: str | None = None
    """A file in the results folder that takes the command's stdout (its stderr goes to the log)."""
    junit: str | None = None
    """The junit xml a pytest step writes into the results folder; at least one of its tests must
    pass."""

    @property
    def files(self) -> list[str]:
        return [
            f
            for f in (self.stdout, self.junit, self.env.get("OUT") and Path(self.env["OUT"]).name)
            if f
        ]


def steps(
    out: Path, python: str = sys.executable, folder: Path = WHEELS, venv: Path = VENV
) -> list[Step]:
    """The check, in order. The first (``cuda``) is a probe: without a CUDA device the check stops
    there, exit 2."""
    vpy = str(venv / "bin" / "python")
    pytest = [vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    verify_s = 50
    return [
        Step(
            "cuda",
            45,
            "torch sees a CUDA device (else: exit 2 at once, nothing run)",
            [python, "-c", PROBE],
        ),
        Step(
            "setup",
            45,
            "venv over the image's torch; pip install --no-index the wheel folder; unpack "
            "Megatron-LM",
            [python, str(THIS), "setup", "--wheels", str(folder), "--venv", str(venv)],
        ),
        Step(
            "gpu-tests",
            40,
            "tests/gpu but the CUDA-graph rows, every marker (the launch harness, on real CUDA)",
            [
                *pytest,
                "-m",
                "gpu or not gpu",
                "tests/gpu",
                "--ignore=tests/gpu/test_cuda_graphs.py",
                f"--junitxml={out / 'gpu-tests.xml'}",
            ],
            junit="gpu-tests.xml",
        ),
        Step(
            "cuda-graphs",
            165,
            "the CUDA-graph rows in pretrain_gpt.py (marker gpu; the optimizer graph needs TE)",
            [
                *pytest,
                "-m",
                "gpu",
                "tests/gpu/test_cuda_graphs.py",
                f"--junitxml={out / 'cuda-graphs.xml'}",
            ],
            junit="cuda-graphs.xml",
        ),
        Step(
            "verify",
            verify_s,
            "megatron-ga verify --device cuda (the layouts of one GPU), against the reference",
            [
                str(venv / "bin" / "megatron-ga"),
                "verify",
                "--device",
                "cuda",
                "--json",
                "--timeout",
                str(verify_s - 10),
            ],
            stdout="verify.json",
        ),
        Step(
            "overhead",
            130,
            "benchmarks/gpu_overhead.sh: upstream / extension / async, 350M GPT, side by side",
            ["bash", "benchmarks/gpu_overhead.sh", str(megatron_lm(folder, read_wheel_list()))],
            env={
                "PYTHON": vpy,
                "OUT": str(out / "overhead.json"),
                "ITERS": os.environ.get("ITERS", "12"),
                "WARMUP": os.environ.get("WARMUP", "4"),
                "GA_VALUES": os.environ.get("GA_VALUES", "8"),
            },
        ),
    ]


def step_env(step: Step, folder: Path, venv: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        "PYTHONUNBUFFERED": "1",
        "MEGATRON_LM": str(megatron_lm(folder, read_wheel_list())),
        **step.env,
    }


def results_dir(given: str | None) -> Path:
    return Path(given or os.environ.get("OUT") or RESULTS).resolve()


def _shown(path: Path | str) -> str:
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def plan_text(out: Path, python: str, folder: Path, venv: Path) -> str:
    plan = steps(out, python, folder, venv)
    wheels = read_wheel_list()
    total = sum(s.timeout_s for s in plan)
    lines = [
        f"gpu-check: {len(plan)} steps, {total} s of timeouts in all (budget {BUDGET_S} s)",
        f"  python   {python} (its torch: the venv is made with --system-site-packages)",
        f"  venv     {_shown(venv)}",
        f"  results  {_shown(out)}  ({LOG}, {SUMMARY} and the files below)",
        "",
        f"  {'step':<12} {'timeout':>7}  writes: what",
    ]
    for s in plan:
        lines.append(f"  {s.name:<12} {s.timeout_s:>5} s  {', '.join(s.files) or '-'}: {s.what}")
        shown = [c if c != PROBE else "<probe: torch.cuda.is_available()>" for c in s.command]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s.env.items())
        lines.append(f"    $ {env + ' ' if env else ''}{shlex.join(shown)}".replace(f"{ROOT}/", ""))
    lines += ["", f"wheels: {_shown(folder)} (make gpu-wheels; the list: {_shown(WHEEL_LIST)})"]
    for w in wheels:
        found = sorted(folder.glob(w.file_pattern()))
        have = (
            ", ".join(f"{f.name} ({f.stat().st_size / 2**20:.1f} MiB)" for f in found) or "missing"
        )
        what = {
            "build": "built from this checkout",
            "download": "downloaded, --no-deps",
            "source": "Megatron-LM snapshot",
        }[w.kind]
        lines.append(f"  {w.requirement if w.kind != 'source' else w.name:<40} {what}: {have}")
    if folder.is_dir():
        lines.append(
            f"  {_size(folder) / 2**20:.1f} MiB in all (cap {WHEELS_CAP_BYTES // 2**20} MiB)"
        )
    return "\n".join(lines)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# -- running a step
# ---------------------------------------------------------------------------------------------------


class _Log:
    """gpu-check.log and the terminal, written from the main thread and a step's output pump."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.lock = handle, threading.Lock()

    def write(self, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        with self.lock:
            self.handle.write(data)
            self.handle.flush()
            terminal = getattr(sys.stdout, "buffer", None)
            if terminal is None:  # a text stream alone (a test's capture)
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()
            else:
                terminal.write(data)
                terminal.flush()

    def pump(self, pipe: BinaryIO) -> None:
        for chunk in iter(lambda: os.read(pipe.fileno(), 65536), b""):
            self.write(chunk)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc: a launch in a session of its own
    (pretrain_runs._run_alone) too."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGTERM, then after 5 s SIGKILL, to the step's process, its session and everything below
    it."""
    pids = [process.pid, *_descendants(process.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                pgid = os.getpgid(pid)
                if pgid != os.getpgrp():
                    os.killpg(pgid, sig)
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
            time.sleep(0.2)
    process.wait()


def run_step(step: Step, out: Path, log: _Log, env: dict[str, str]) -> dict:
    """Run one step under its timeout; its row of the summary. 124: killed past the timeout."""
    env_shown = "".join(f"{k}={shlex.quote(v)} " for k, v in step.env.items())
    log.write(
        f"\n== {step.name} (timeout {step.timeout_s} s): {step.what}\n$ "
        f"{env_shown}{shlex.join(step.command)}\n"
    )
    offset = log.handle.tell()
    start = time.monotonic()
    stdout = open(out / step.stdout, "wb") if step.stdout else None  # noqa: SIM115 - closed in the finally below
    try:
        process = subprocess.Popen(
            step.command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout or subprocess.PIPE,
            stderr=subprocess.PIPE if stdout else subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        log.write(f"could not start: {exc}\n")
        rc, status = 127, "failed"
    else:
        pump = threading.Thread(
            target=log.pump, args=(process.stderr if stdout else process.stdout,), daemon=True
        )
        pump.start()
        try:
            rc = process.wait(timeout=step.timeout_s)
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            kill_tree(process)
            rc, status = 124, "timed out"
        except (
            BaseException
        ):  # Ctrl-C or SIGTERM: the step's processes are in sessions of their own
            kill_tree(process)
            raise
        finally:
            pump.join(timeout=10)
    finally:
        if stdout:
            stdout.close()
    seconds = round(time.monotonic() - start, 1)
    tests = junit_counts(out / step.junit) if step.junit else None
    note = ""
    if status == "passed" and tests is not None and tests["passed"] == 0:
        status, note = "failed", "no test passed (every one skipped or none collected)"
    log.write(f"-- {step.name}: {status} (exit {rc}) in {seconds} s{'; ' + note if note else ''}\n")
    with open(log.handle.name, "rb") as written:
        written.seek(offset)
        tail = written.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
    return {
        "name": step.name,
        "timeout_s": step.timeout_s,
        "status": status,
        "rc": rc,
        "seconds": seconds,
        "tests": tests,
        "note": note,
        "files": [f for f in step.files if (out / f).is_file()],
        "tail": tail,
    }


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests, passed, failed (failures and errors) and skipped in a junit xml; None where there is
    none."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {
        key: sum(int(s.get(key, 0)) for s in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    failed = total["failures"] + total["errors"]
    return {
        "tests": total["tests"],
        "passed": total["tests"] - failed - total["skipped"],
        "failed": failed,
        "skipped": total["skipped"],
    }


# -- the commands
# -----------------------------------------------------------------------------------------------------


def no_cuda(step: Step) -> tuple[str | None, dict]:
    """Why the check cannot run here (None: it can), and what the probe read."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return f"no CUDA device is visible: CUDA_VISIBLE_DEVICES={hidden!r} hides every one", {}
    try:
        done = subprocess.run(
            step.command,
            capture_output=True,
            text=True,
            timeout=step.timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return (
            f"no CUDA device: torch in {step.command[0]} did not answer within {step.timeout_s} "
            "s (a hung "
            f"driver, or a cold import slower than that)"
        ), {}
    except OSError as exc:
        return f"cannot run {step.command[0]}: {exc}", {}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if "No module named 'torch'" in done.stderr:
            return (
                f"{step.command[0]} has no torch ({last}); run with the python that holds the "
                "image's CUDA "
                f"torch (make gpu-check GPU_PYTHON=...)"
            ), {}
        return f"no CUDA device: the probe failed in {step.command[0]}: {last}", {}
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return f"no CUDA device: the probe printed {done.stdout!r}", {}
    if not found.get("devices"):
        build = f"CUDA {found['cuda']}" if found.get("cuda") else "a CPU build"
        return (
            f"no CUDA device is visible to torch {found.get('torch')} ({build}): "
            "torch.cuda.is_available() is False"
        ), found
    return None, found


def command_run(args: argparse.Namespace) -> int:
    out, folder, venv = (
        results_dir(args.out),
        Path(args.wheels).resolve(),
        Path(args.venv).resolve(),
    )
    out.mkdir(parents=True, exist_ok=True)
    plan = steps(out, args.python, folder, venv)
    for name in {LOG, SUMMARY, *(f for s in plan for f in s.files)}:
        (out / name).unlink(missing_ok=True)
    summary: dict = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": BUDGET_S,
        "results": str(out),
        "python": args.python,
        "device": {},
        "steps": [{"name": s.name, "timeout_s": s.timeout_s, "status": "not run"} for s in plan],
    }
    start = time.monotonic()

    def finish(code: int, reason: str = "") -> int:
        summary.update(
            exit=code, ok=code == 0, seconds=round(time.monotonic() - start, 1), reason=reason
        )
        (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        if reason:
            print(f"gpu-check: {reason}", file=sys.stderr)
        return code

    probe_started = time.monotonic()
    reason, summary["device"] = no_cuda(plan[0])
    summary["steps"][0].update(
        status="failed" if reason else "passed",
        rc=2 if reason else 0,
        seconds=round(time.monotonic() - probe_started, 1),
    )
    if reason:
        return finish(2, f"{reason}; nothing was run (a GPU machine runs this check)")
    missing = missing_wheels(folder, read_wheel_list())
    if missing:
        return finish(
            2,
            f"{_shown(folder)} lacks {', '.join(missing)}: run `make gpu-wheels` on a machine "
            "with registry access first, and bring the folder along",
        )
    device = summary["device"]
    print(
        f"gpu-check on {device['name']} ({device['devices']} visible), torch {device['torch']}, "
        f"Python {device['python']}; results in {out}",
        flush=True,
    )
    previous = signal.signal(
        signal.SIGTERM, _interrupted
    )  # a killed check kills its step's processes too
    try:
        with open(out / LOG, "wb") as handle:
            log = _Log(handle)
            for number, step in enumerate(plan[1:], 1):
                summary["steps"][number] = run_step(step, out, log, step_env(step, folder, venv))
    except KeyboardInterrupt:
        return finish(130, "interrupted")
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(summary_table(summary["steps"]))
    failed = [s["name"] for s in summary["steps"] if s["status"] != "passed"]
    return finish(1 if failed else 0, f"failed: {', '.join(failed)}" if failed else "")


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def summary_table(rows: list[dict]) -> str:
    lines = [f"{'step':<12} {'status':<10} {'exit':>4} {'seconds':>8} {'timeout':>7}  tests"]
    for r in rows:
        t = r.get("tests")
        tests = f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped" if t else ""
        lines.append(
            f"{r['name']:<12} {r['status']:<10} {r.get('rc', ''):>4} {r.get('seconds', ''):>8} "
            f"{r['timeout_s']:>7}  {tests}{'  ' + r['note'] if r.get('note') else ''}"
        )
    return "\n".join(lines)


def command_setup(args: argparse.Namespace) -> int:
    """The setup step, in the image's python: a venv that sees its torch, the wheels installed
    offline, the Megatron-LM tree unpacked, then the venv checked (``check-venv``)."""
    folder, venv = Path(args.wheels).resolve(), Path(args.venv).resolve()
    if sys.version_info[:2] != TARGET_PYTHON:
        print(
            f"setup: the wheels are for CPython {'.'.join(map(str, TARGET_PYTHON))}; this is "
            f"{sys.version.split()[0]} ({sys.executable})",
            file=sys.stderr,
        )
        return 1
    wheels = read_wheel_list()
    # No pip of its own: the image's (through its site-packages) installs into it, and ensurepip is
    # not needed.
    _echo(
        [
            sys.executable,
            "-m",
            "venv",
            "--clear",
            "--system-site-packages",
            "--without-pip",
            str(venv),
        ]
    )
    if sys.prefix != sys.base_prefix:
        # This python is itself a venv (the image's is /opt/torch/.venv): --system-site-packages
        # reaches the interpreter below it, not this venv's site-packages, where torch is. A .pth
        # file adds them (and runs their own .pth files) after the new venv's own, so that a wheel
        # installed there wins.
        site_packages = (
            venv
            / "lib"
            / f"python{sys.version_info.major}.{sys.version_info.minor}"
            / "site-packages"
        )
        (site_packages / "_gpu_check_base.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages())
        )
        print(f"setup: {sys.prefix} is a venv: its site-packages added to the new one", flush=True)
    vpy = str(venv / "bin" / "python")
    _python3_config(venv)
    if (
        subprocess.run([vpy, "-m", "pip", "--version"], cwd=venv, capture_output=True).returncode
        != 0
    ):
        _echo([vpy, "-m", "ensurepip", "--default-pip"], cwd=venv)
    # Every wheel into the venv, whatever the image has. Not from the checkout: pip would take its
    # egg-info for an installed megatron-ga-ext.
    _echo(
        [
            vpy,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(folder),
            "--no-deps",
            "--no-compile",
            "--ignore-installed",
            "--disable-pip-version-check",
            *[w.requirement for w in wheels if w.kind != "source"],
        ],
        cwd=venv,
    )
    tree = megatron_lm(folder, wheels)
    given = os.environ.get("MEGATRON_LM") or str(folder / snapshot(wheels))
    unpack = (
        "import sys; from pathlib import Path; from tools.regress import tree; "
        "print(tree(Path(sys.argv[1])))"
    )
    unpacked = _echo([vpy, "-c", unpack, str(Path(given).expanduser().resolve())], cwd=ROOT).strip()
    if Path(unpacked) != tree:
        print(f"setup: tree() unpacked {unpacked}, the steps expect {tree}", file=sys.stderr)
        return 1
    _echo(
        [vpy, str(THIS), "check-venv", "--megatron-lm", str(tree)],
        cwd=venv,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # megatron-core's warnings about TE and Apex
    return 0


def _python3_config(venv: Path) -> None:
    """pretrain_gpt.py runs `make` in megatron/core/datasets on rank 0, whose Makefile names its
    target by `python3-config --extension-suffix`; a venv has no python3-config, and another
    Python's would name another file. This one names the file check-venv puts there, so that make
    finds it built and compiles nothing."""
    config = venv / "bin" / "python3-config"
    config.write_text(f"""#!/bin/sh
# gpu_check.py: the extension suffix of this venv's python, for megatron/core/datasets/Makefile.
[ "$1" = --extension-suffix ] && exec {shlex.quote(str(venv / "bin" / "python"))} -c \\
  'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))'
echo "python3-config (gpu_check.py): only --extension-suffix" >&2; exit 1
""")
    config.chmod(0o755)


def _echo(command: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    """Run ``command``, print it and its output; its stdout. CalledProcessError where it fails."""
    print(f"$ {shlex.join(command)}", flush=True)
    done = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, text=True, env=env)
    print(done.stdout, end="", flush=True)
    done.check_returncode()
    return done.stdout


def command_check_venv(args: argparse.Namespace) -> int:
    """In the new venv: what the steps import imports, from where; megatron-core is the primary pin;
    the dataset helpers the wheel compiled are given to the Megatron-LM tree where its helpers.cpp
    is the same (so that pretrain_gpt.py need not compile them there)."""
    import importlib
    import importlib.metadata
    import importlib.util

    installed = Path(importlib.util.find_spec("megatron_ga_ext").origin).parent
    if not installed.is_relative_to(sys.prefix):
        print(f"check-venv: megatron_ga_ext is {installed}, not the venv's wheel", file=sys.stderr)
        return 1
    stale = _differences(installed, ROOT / "megatron_ga_ext")
    if stale:  # the tests run the checkout, verify the wheel: they must be the same code
        print(
            "check-venv: the wheel is not this checkout (rebuild it: make gpu-wheels): "
            f"{', '.join(stale)}",
            file=sys.stderr,
        )
        return 1
    for name in ("torch", "megatron.core", "megatron_ga_ext", "pytest", "hypothesis", "einops"):
        module = importlib.import_module(name)
        distribution = {"megatron.core": "megatron-core", "megatron_ga_ext": "megatron-ga-ext"}.get(
            name, name
        )
        print(
            f"  {name} {importlib.metadata.version(distribution)}: {Path(module.__file__).parent}"
        )
    if importlib.metadata.version("megatron-core") != primary_pin():
        print(
            f"check-venv: megatron-core is {importlib.metadata.version('megatron-core')}, not "
            f"{primary_pin()}",
            file=sys.stderr,
        )
        return 1
    datasets = Path(importlib.import_module("megatron.core.datasets").__file__).parent
    target = Path(args.megatron_lm) / "megatron" / "core" / "datasets"
    for built in datasets.glob("helpers_cpp*.so"):
        source = target / "helpers.cpp"
        same_source = (
            source.is_file() and source.read_bytes() == (datasets / "helpers.cpp").read_bytes()
        )
        if same_source and not (target / built.name).exists():
            shutil.copy(built, target / built.name)  # newer than helpers.cpp: make leaves it
            print(f"  {built.name}: the wheel's, into {target}")
    return 0


def _differences(installed: Path, checkout: Path) -> list[str]:
    """The package's files (sources and data) that differ between the installed wheel and the
    checkout."""

    def files(root: Path) -> dict[str, bytes]:
        return {
            str(f.relative_to(root)): f.read_bytes()
            for f in root.rglob("*")
            if f.is_file() and "__pycache__" not in f.parts and f.suffix in (".py", ".json")
        }

    mine, theirs = files(installed), files(checkout)
    return sorted(
        name for name in mine.keys() | theirs.keys() if mine.get(name) != theirs.get(name)
    )


def command_wheels(args: argparse.Namespace) -> int:
    """Build this project's wheel, download the pinned ones, copy the snapshot; into ``--wheels``,
    replaced whole."""
    folder, snapshots = Path(args.wheels).resolve(), Path(args.snapshots).resolve()
    wheels = read_wheel_list()
    problems = wheel_list_problems(wheels)
    if problems:
        print("\n".join(f"{_shown(WHEEL_LIST)}: {p}" for p in problems), file=sys.stderr)
        return 2
    if not (snapshots / snapshot(wheels)).is_file():
        print(
            f"gpu-wheels: no {snapshot(wheels)} in {snapshots} (MEGATRON_LM_SNAPSHOTS)",
            file=sys.stderr,
        )
        return 2
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    with (
        tempfile.TemporaryDirectory() as tmp
    ):  # a copy, so that the build writes nothing into the checkout
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, tmp)
        shutil.copytree(
            ROOT / "megatron_ga_ext",
            Path(tmp) / "megatron_ga_ext",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
        )
        _echo([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(partial), tmp])
    python = ".".join(map(str, TARGET_PYTHON))
    abi = f"cp{python.replace('.', '')}"
    _echo(
        [
            *pip,
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--abi",
            abi,
            "--abi",
            "abi3",
            "--abi",
            "none",
            *[f"--platform={p}" for p in PLATFORMS],
            "--dest",
            str(partial),
            *[w.requirement for w in wheels if w.kind == "download"],
        ]
    )
    shutil.copy2(snapshots / snapshot(wheels), partial)
    missing = missing_wheels(partial, wheels)
    size = _size(partial)
    if missing or size > WHEELS_CAP_BYTES:
        print(
            f"gpu-wheels: {partial}: missing {missing}, {size / 2**20:.1f} MiB (cap "
            f"{WHEELS_CAP_BYTES // 2**20} MiB)",
            file=sys.stderr,
        )
        return 1
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    for f in sorted(folder.iterdir()):
        print(f"  {f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    print(f"  {size / 2**20:6.2f} MiB  in {_shown(folder)} (cap {WHEELS_CAP_BYTES // 2**20} MiB)")
    return 0


def command_plan(args: argparse.Namespace) -> int:
    out, folder, venv = (
        results_dir(args.out),
        Path(args.wheels).resolve(),
        Path(args.venv).resolve(),
    )
    if args.json:
        plan = steps(out, args.python, folder, venv)
        print(
            json.dumps(
                {
                    "budget_s": BUDGET_S,
                    "total_s": sum(s.timeout_s for s in plan),
                    "steps": [asdict(s) | {"files": s.files} for s in plan],
                    "wheels": [asdict(w) for w in read_wheel_list()],
                    "missing": missing_wheels(folder, read_wheel_list()),
                },
                indent=2,
            )
        )
    else:
        print(plan_text(out, args.python, folder, venv))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, helps in (
        ("wheels", "fill the wheel folder (here, with registry access)"),
        ("plan", "print the steps, their timeouts and the wheels; run nothing"),
        ("run", "run the check on a GPU machine"),
        ("setup", "the setup step (run runs it)"),
        ("check-venv", "the setup step's check, in the new venv"),
    ):
        command = commands.add_parser(name, help=helps)
        command.add_argument(
            "--wheels", default=str(WHEELS), help=f"the wheel folder (default {_shown(WHEELS)})"
        )
        command.add_argument(
            "--venv", default=str(VENV), help=f"the check's venv (default {_shown(VENV)})"
        )
        command.add_argument(
            "--out", help=f"the results folder (default $OUT, else {_shown(RESULTS)})"
        )
        command.add_argument(
            "--python",
            default=sys.executable,
            help="the python whose CUDA torch the venv reuses (default: this one)",
        )
        if name == "wheels":
            command.add_argument(
                "--snapshots",
                default=os.environ.get("MEGATRON_LM_SNAPSHOTS")
                or str(ROOT.parent / "shared" / "upstream"),
                help="where the Megatron-LM snapshot is (MEGATRON_LM_SNAPSHOTS)",
            )
        if name == "plan":
            command.add_argument("--json", action="store_true", help="the plan as JSON")
        if name == "check-venv":
            command.add_argument(
                "--megatron-lm", required=True, help="the unpacked Megatron-LM tree"
            )
    args = parser.parse_args(argv)
    handler = {
        "wheels": command_wheels,
        "plan": command_plan,
        "run": command_run,
        "setup": command_setup,
        "check-venv": command_check_venv,
    }[args.command]
    try:
        return handler(args)
    except subprocess.CalledProcessError as exc:
        print(
            f"{args.command}: {shlex.join(map(str, exc.cmd))} exited {exc.returncode}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
