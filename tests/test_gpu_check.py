"""make gpu-check (tools/gpu_check.py) on the CPU, as far as it goes without a GPU: its plan and
their timeouts, its wheel list, its exit without CUDA, its step runner (timeouts, failures, skips),
and tests/gpu skipping without CUDA. The steps themselves need a GPU."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

import pytest

from megatron_ga_ext.integration.compat import UPSTREAM
from tools import gpu_check

ROOT = gpu_check.ROOT
TOOL = ROOT / "tools" / "gpu_check.py"
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
STEPS = ["cuda", "setup", "gpu-tests", "cuda-graphs", "verify", "overhead"]
NO_CUDA = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def tool(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def fake_python(path: Path, body: str) -> str:
    """An executable standing for the GPU image's python3."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


# -- the plan
# ---------------------------------------------------------------------------------------------------------


def test_the_plan_runs_every_part_of_the_check_within_8_minutes(tmp_path):
    plan = {step.name: step for step in gpu_check.steps(tmp_path)}
    assert list(plan) == STEPS
    assert all(step.timeout_s > 0 for step in plan.values())
    assert sum(step.timeout_s for step in plan.values()) < gpu_check.BUDGET_S == 480
    gpu_tests, graphs = plan["gpu-tests"].command, plan["cuda-graphs"].command
    assert "tests/gpu" in gpu_tests and "--ignore=tests/gpu/test_cuda_graphs.py" in gpu_tests
    assert (
        gpu_tests[gpu_tests.index("pytest") + 1 :].count("-m") == 1
    )  # one marker expression: every marker
    assert "tests/gpu/test_cuda_graphs.py" in graphs and graphs[-4:-2] == ["-m", "gpu"]
    verify = plan["verify"].command
    assert verify[1:4] == ["verify", "--device", "cuda"] and "--json" in verify
    assert float(verify[verify.index("--timeout") + 1]) < plan["verify"].timeout_s
    assert plan["overhead"].command[:2] == ["bash", "benchmarks/gpu_overhead.sh"]
    assert plan["setup"].command[1:3] == [str(TOOL), "setup"]
    for path in ("tests/gpu", "tests/gpu/test_cuda_graphs.py", "benchmarks/gpu_overhead.sh"):
        assert (ROOT / path).exists(), path


def test_every_result_lands_in_the_one_folder(tmp_path):
    plan = {step.name: step for step in gpu_check.steps(tmp_path)}
    assert f"--junitxml={tmp_path / 'gpu-tests.xml'}" in plan["gpu-tests"].command
    assert f"--junitxml={tmp_path / 'cuda-graphs.xml'}" in plan["cuda-graphs"].command
    # gpu_overhead.sh takes OUT as the JSON file it writes: the folder's overhead.json, not the
    # folder itself
    assert plan["overhead"].env["OUT"] == str(tmp_path / "overhead.json")
    files = [f for step in plan.values() for f in step.files]
    assert files == ["gpu-tests.xml", "cuda-graphs.xml", "verify.json", "overhead.json"]
    # the device tool brings back at most 8 files
    assert len({gpu_check.LOG, gpu_check.SUMMARY, *files}) <= 8


def test_the_plan_prints_each_step_its_timeout_and_the_wheels_and_runs_nothing(tmp_path):
    done = tool(
        "plan",
        "--out",
        str(tmp_path / "out"),
        "--wheels",
        str(tmp_path / "wheels"),
        "--venv",
        str(tmp_path / "venv"),
        env=NO_CUDA,
    )
    assert done.returncode == 0, done.stderr
    total = sum(step.timeout_s for step in gpu_check.steps(tmp_path))
    assert f"6 steps, {total} s of timeouts in all (budget 480 s)" in done.stdout
    for step in gpu_check.steps(tmp_path):
        assert re.search(rf"^  {re.escape(step.name)} +{step.timeout_s} s ", done.stdout, re.M), (
            step.name
        )
    for wheel in gpu_check.read_wheel_list():
        assert re.search(rf"^  {re.escape(wheel.requirement)} .*: missing$", done.stdout, re.M), (
            wheel
        )
    assert not any((tmp_path / name).exists() for name in ("out", "wheels", "venv"))
    as_json = json.loads(tool("plan", "--json", "--out", str(tmp_path), env=NO_CUDA).stdout)
    assert [s["name"] for s in as_json["steps"]] == STEPS and as_json["total_s"] == total < as_json[
        "budget_s"
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_makefile_targets_call_the_tool(tmp_path):
    plan = subprocess.run(
        [
            "make",
            "-s",
            "--no-print-directory",
            "gpu-check",
            "PLAN=1",
            f"GPU_PYTHON={sys.executable}",
        ],
        cwd=ROOT,
        env={**NO_CUDA, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0 and f"results  {tmp_path}" in plan.stdout, plan.stdout + plan.stderr
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "gpu-wheels", "gpu-check", "GPU_PYTHON=py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.stdout.splitlines() == ["py tools/gpu_check.py wheels", "py tools/gpu_check.py run"]


# -- the wheel list
# ---------------------------------------------------------------------------------------------------


def test_the_wheel_list_carries_the_primary_pin_this_project_and_nothing_the_image_has():
    wheels = gpu_check.read_wheel_list()
    assert gpu_check.wheel_list_problems(wheels) == []
    by_name = {gpu_check.canonical(w.name): w for w in wheels if w.kind != "source"}
    pinned = re.search(
        r"^megatron-core==(\S+)", (ROOT / "constraints" / "py3.12.txt").read_text(), re.M
    ).group(1)
    assert by_name["megatron-core"].version == pinned
    assert by_name["megatron-ga-ext"].kind == "build"
    assert not {"torch", "apex", "transformer-engine", "triton"} & set(by_name)
    assert not [
        n
        for n in by_name
        if n.startswith(("torch", "nvidia-", "transformer-engine", "transformer_engine"))
    ]
    assert all(
        re.fullmatch(r"[0-9][0-9a-z.+]*", w.version) for w in wheels if w.kind == "download"
    )  # exact pins
    # the snapshot is the tested source of that release (its pretrain_gpt.py)
    release = next(u for u in UPSTREAM if u.name == pinned)
    assert (
        gpu_check.snapshot(wheels) == f"megatron-lm-{release.ref}.tar.gz"
        and release.python == "3.12"
    )


def test_a_wrong_wheel_list_is_refused(tmp_path):
    listed = tmp_path / "wheels.txt"
    listed.write_text(
        "torch==2.11.0\nmegatron-core==0.16.1\npydantic==2.1\npydantic==2.2\napex==0.9\n"
    )
    problems = "\n".join(gpu_check.wheel_list_problems(gpu_check.read_wheel_list(listed)))
    assert (
        f"primary leg's {gpu_check.primary_pin()}" in problems
        and "'megatron-ga-ext @ .'" in problems
    )
    assert "torch: the GPU image has it" in problems and "apex: " in problems
    assert "pydantic is listed twice" in problems and "one Megatron-LM snapshot" in problems
    listed.write_text("megatron-core>=0.19\n")
    with pytest.raises(ValueError, match=r"wheels.txt:1: 'megatron-core>=0.19' is not"):
        gpu_check.read_wheel_list(listed)


def test_the_folder_check_finds_each_listed_file(tmp_path):
    wheels = gpu_check.read_wheel_list()
    assert len(gpu_check.missing_wheels(tmp_path, wheels)) == len(wheels)
    (tmp_path / "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl").touch()
    (tmp_path / "megatron_ga_ext-0.1.0-py3-none-any.whl").touch()
    (tmp_path / gpu_check.snapshot(wheels)).touch()
    missing = gpu_check.missing_wheels(tmp_path, wheels)
    assert "megatron_core-0.19.2-*.whl" not in missing and "megatron_ga_ext-*-*.whl" not in missing
    assert "pydantic_core-2.50.5-*.whl" in missing and gpu_check.snapshot(wheels) not in missing


# -- without CUDA
# -----------------------------------------------------------------------------------------------------


def test_with_cuda_hidden_the_check_exits_2_at_once_and_runs_nothing(tmp_path):
    start = time.monotonic()
    done = tool(
        "run", "--out", str(tmp_path / "out"), "--venv", str(tmp_path / "venv"), env=NO_CUDA
    )
    assert done.returncode == 2 and time.monotonic() - start < 10
    assert (
        "gpu-check: no CUDA device is visible: CUDA_VISIBLE_DEVICES='' hides every one"
        in done.stderr
    )
    assert not (tmp_path / "venv").exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["exit"] == 2 and not summary["ok"] and "no CUDA device" in summary["reason"]
    assert [s["status"] for s in summary["steps"]] == ["failed"] + ["not run"] * 5
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["summary.json"]


def test_a_torch_without_cuda_exits_2_naming_it(tmp_path):
    """The probe itself, on this interpreter's torch (a GPU machine has one: then the empty wheel
    folder stops it)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = tool("run", "--out", str(tmp_path), "--wheels", str(tmp_path / "none"), env=env)
    assert done.returncode == 2, done.stderr
    assert any(
        reason in done.stderr
        for reason in (
            "torch.cuda.is_available() is False",
            "has no torch",
            "lacks",
            "did not answer within",
        )
    ), done.stderr  # a loaded CPU


def test_a_python_without_torch_exits_2_naming_it(tmp_path):
    python = fake_python(
        tmp_path / "python", f'exec {sys.executable} -S "$@"'
    )  # -S: no site-packages, no torch
    done = tool(
        "run",
        "--out",
        str(tmp_path),
        "--python",
        python,
        env={**NO_CUDA, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert done.returncode == 2
    assert f"{python} has no torch" in done.stderr and "GPU_PYTHON=" in done.stderr


def test_with_a_device_but_no_wheels_the_check_says_to_build_them(tmp_path):
    device = (
        '{"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "devices": 1, "name": "NVIDIA '
        'H200"}'
    )
    python = fake_python(tmp_path / "python", f"echo '{device}'")
    done = tool(
        "run",
        "--out",
        str(tmp_path / "out"),
        "--python",
        python,
        "--wheels",
        str(tmp_path / "wheels"),
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert (
        done.returncode == 2
        and "run `make gpu-wheels` on a machine with registry access first" in done.stderr
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["device"]["name"] == "NVIDIA H200" and summary["steps"][0]["status"] == "passed"


# -- the step runner
# --------------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_step_past_its_timeout_is_killed_with_every_process_below_it(tmp_path):
    """A launch in a session of its own (as pretrain_runs._run_alone starts a CUDA rank) is killed
    too."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(60)'], start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
        "time.sleep(60)"
    )
    step = gpu_check.Step("sleeper", 2, "sleeps past its timeout", [sys.executable, "-c", code])
    with open(tmp_path / "log", "wb") as handle:
        row = gpu_check.run_step(step, tmp_path, gpu_check._Log(handle), dict(os.environ))
    assert (row["status"], row["rc"]) == ("timed out", 124) and row["seconds"] < 10
    assert "started" in row["tail"] and "-- sleeper: timed out (exit 124)" in row["tail"][-1]
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_the_check_goes_on_past_a_failed_step_and_exits_1(tmp_path, monkeypatch):
    junit = tmp_path / "out" / "skipped.xml"
    python = sys.executable
    steps = [
        gpu_check.Step("cuda", 5, "probe", ["true"]),
        gpu_check.Step(
            "fails", 10, "exits 3", [python, "-c", "import sys; print('boom'); sys.exit(3)"]
        ),
        gpu_check.Step(
            "skips",
            10,
            "a pytest step whose every test skipped",
            [
                python,
                "-c",
                f"open({str(junit)!r}, 'w').write('<testsuites><testsuite tests=\"2\" "
                f'failures="0" errors="0" skipped="2"/></testsuites>\')',
            ],
            junit="skipped.xml",
        ),
        gpu_check.Step(
            "prints",
            10,
            "writes its stdout to a file",
            [python, "-c", "print('{}')"],
            stdout="prints.json",
        ),
        gpu_check.Step("hangs", 1, "sleeps", [python, "-c", "import time; time.sleep(30)"]),
    ]
    monkeypatch.setattr(gpu_check, "steps", lambda *args: steps)
    monkeypatch.setattr(
        gpu_check,
        "no_cuda",
        lambda step: (None, {"name": "fake", "devices": 1, "torch": "t", "python": "3.12"}),
    )
    monkeypatch.setattr(gpu_check, "missing_wheels", lambda *args: [])
    code = gpu_check.main(["run", "--out", str(tmp_path / "out"), "--wheels", str(tmp_path)])
    assert code == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = {row["name"]: row for row in summary["steps"]}
    assert [(r["status"], r["rc"]) for r in rows.values()] == [
        ("passed", 0),
        ("failed", 3),
        ("failed", 0),
        ("passed", 0),
        ("timed out", 124),
    ]
    assert rows["skips"]["tests"] == {"tests": 2, "passed": 0, "failed": 0, "skipped": 2}
    assert "no test passed" in rows["skips"]["note"] and "boom" in rows["fails"]["tail"]
    assert (tmp_path / "out" / "prints.json").read_text() == "{}\n" and rows["prints"]["files"] == [
        "prints.json"
    ]
    assert summary["reason"] == "failed: fails, skips, hangs"
    log = (tmp_path / "out" / gpu_check.LOG).read_text()
    assert all(f"== {name} (timeout" in log for name in ("fails", "skips", "prints", "hangs"))


# -- tests/gpu without CUDA
# -------------------------------------------------------------------------------------------


def test_tests_gpu_are_marked_and_skip_cleanly_without_cuda(tmp_path):
    graphs = ROOT / "tests" / "gpu" / "test_cuda_graphs.py"
    defined = [
        node.name
        for node in ast.parse(graphs.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]
    source = (
        tmp_path / "megatron-lm-core_v0.19.0"
    )  # a checkout's name: the newest release the tier knows
    (source / "megatron" / "core").mkdir(parents=True)
    env = {**NO_CUDA, "MEGATRON_LM": str(source)}
    pytest_ = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    unmarked = subprocess.run(
        [*pytest_, "--collect-only", "-m", "not gpu", str(graphs)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unmarked.returncode == 5, unmarked.stdout  # no test of the file lacks the marker
    junit = tmp_path / "gpu.xml"
    ran = subprocess.run(
        [*pytest_, "-m", "gpu", "tests/gpu", f"--junitxml={junit}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    cases = list(ElementTree.parse(junit).getroot().iter("testcase"))
    assert cases and all(
        case.find("skipped") is not None for case in cases
    )  # none failed, none ran
    graph_rows = {
        case.get("name").split("[")[0]: case.find("skipped").get("message")
        for case in cases
        if case.get("classname") == "tests.gpu.test_cuda_graphs"
    }
    assert sorted(graph_rows) == sorted(defined)
    assert all("no CUDA device" in message for message in graph_rows.values()), graph_rows


# -- make gpu-wheels (registry access) and the setup step
# -------------------------------------------------------------


def _snapshots() -> Path:
    return Path(os.environ.get("MEGATRON_LM_SNAPSHOTS") or ROOT.parent / "shared" / "upstream")


@pytest.fixture(scope="module")
def wheel_folder(tmp_path_factory) -> Path:
    snapshots = _snapshots()
    if not (snapshots / gpu_check.snapshot(gpu_check.read_wheel_list())).is_file():
        pytest.skip(f"no Megatron-LM snapshot in {snapshots}")
    folder = tmp_path_factory.mktemp("gpu") / "wheels"
    build_existed = (ROOT / "build").exists()
    done = tool("wheels", "--wheels", str(folder), "--snapshots", str(snapshots), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (ROOT / "build").exists() == build_existed  # built from a copy
    return folder


@pytest.mark.slow
def test_make_gpu_wheels_fills_a_small_folder_with_the_list(wheel_folder):
    wheels = gpu_check.read_wheel_list()
    assert gpu_check.missing_wheels(wheel_folder, wheels) == []
    assert len(list(wheel_folder.iterdir())) == len(wheels)
    assert gpu_check._size(wheel_folder) < gpu_check.WHEELS_CAP_BYTES


@pytest.mark.slow
@pytest.mark.skipif(
    sys.version_info[:2] != gpu_check.TARGET_PYTHON, reason="the wheels are for CPython 3.12"
)
def test_setup_installs_the_folder_offline_over_this_pythons_torch(wheel_folder, tmp_path):
    """The primary leg's venv is a venv, as the GPU image's python is: the new one still sees its
    torch."""
    pytest.importorskip("torch")
    core = next(wheel_folder.glob("megatron_core-*.whl"))
    tree = tmp_path / "megatron-lm-core_v0.19.0"
    (tree / "megatron" / "core" / "datasets").mkdir(parents=True)
    with zipfile.ZipFile(core) as wheel:
        (tree / "megatron" / "core" / "datasets" / "helpers.cpp").write_bytes(
            wheel.read("megatron/core/datasets/helpers.cpp")
        )
    venv = tmp_path / "venv"
    done = tool(
        "setup",
        "--wheels",
        str(wheel_folder),
        "--venv",
        str(venv),
        env={**os.environ, "MEGATRON_LM": str(tree)},
        timeout=300,
    )
    if (
        "the wheel is not this checkout" in done.stderr
    ):  # a file of the package changed since the fixture's build
        rebuilt = tool(
            "wheels", "--wheels", str(wheel_folder), "--snapshots", str(_snapshots()), timeout=600
        )
        assert rebuilt.returncode == 0, rebuilt.stderr
        done = tool(
            "setup",
            "--wheels",
            str(wheel_folder),
            "--venv",
            str(venv),
            env={**os.environ, "MEGATRON_LM": str(tree)},
            timeout=300,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"megatron.core {gpu_check.primary_pin()}: {venv}" in done.stdout
    assert f"megatron_ga_ext {VERSION}: {venv}" in done.stdout and "torch " in done.stdout
    # the wheel's compiled dataset helpers, named as the Makefile pretrain_gpt.py runs names them:
    # nothing to compile
    suffix = subprocess.run(
        [str(venv / "bin" / "python3-config"), "--extension-suffix"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert (tree / "megatron" / "core" / "datasets" / f"helpers_cpp{suffix}").is_file()


# -- the benchmark step's launches
# ------------------------------------------------------------------------------------


def test_gpu_overhead_launches_upstream_and_the_extension_through_the_drop_in_entry(tmp_path):
    """benchmarks/gpu_overhead.sh under a python that records each launch (it needs CUDA to run
    them)."""
    record, final = tmp_path / "launches", tmp_path / "final"
    python = fake_python(
        tmp_path / "python",
        f"""case "$1" in
  -c) case "$2" in *transformer_engine*) exit 1;; *) exit 0;; esac;;
  -m) echo "$PWD|$PYTHONPATH|$*" >> {record}; echo "elapsed time per iteration (ms): 100.0"; exit 0;;
  -) cat > /dev/null; echo "$*" > {final}; exit 0;;
esac
exit 3""",
    )
    source = tmp_path / "megatron-lm"
    source.mkdir()
    out = tmp_path / "results" / "overhead.json"
    done = subprocess.run(
        ["bash", "benchmarks/gpu_overhead.sh", str(source)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "PYTHON": python,
            "OUT": str(out),
            "ITERS": "3",
            "WARMUP": "1",
            "GA_VALUES": "8 32",
        },
    )
    assert done.returncode == 0, done.stderr
    launches = [line.split("|") for line in record.read_text().splitlines()]
    assert {(cwd, path) for cwd, path, _ in launches} == {(str(source), f"{ROOT}:{source}")}
    script = str(source / "pretrain_gpt.py")
    runner = "-m torch.distributed.run --nproc-per-node 1"
    programs = [argv.split(" --num-layers")[0] for _, _, argv in launches]
    assert (
        programs
        == [
            f"{runner} {script}",
            f"{runner} -m megatron_ga_ext {script}",
            f"{runner} -m megatron_ga_ext {script}",
        ]
        * 2
    )
    assert [argv.split("--global-batch-size ")[1] for _, _, argv in launches] == [
        "8",
        "8",
        "8 --ga-checks async",
        "32",
        "32",
        "32 --ga-checks async",
    ]
    assert all(
        "--train-iters 3 " in argv and "--transformer-impl local " in argv
        for _, _, argv in launches
    )
    logs = final.read_text().split()[1]
    assert final.read_text().split()[2:] == [str(out), "1", "local", "8", "32"] and logs.startswith(
        "/"
    )
