"""The tier's launcher itself: one import of Megatron per source serves every launch, a hung launch
is stopped at its timeout without stopping the server, and each launch sees the environment and
arguments it was given."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.support.pretrain_runs import ROOT, _server

pytestmark = pytest.mark.e2e

# One write per rank: the ranks share the log, and print's separate writes of each piece interleave
# under load.
REPORT = """import os, sys
imported = 'imported' if 'megatron.training.training' in sys.modules else 'not imported'
line = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} {os.environ['MARK']} {sys.argv[1:]} {imported}"
os.write(1, (line + chr(10)).encode())
"""


def test_a_hung_launch_is_stopped_and_the_next_launch_runs(newest_release, tmp_path):
    (tmp_path / "hang.py").write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "report.py").write_text(REPORT)
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    server = _server(newest_release, sys.executable, environment)

    def report(mark: str) -> None:
        log = tmp_path / f"{mark}.log"
        rc = server.run(
            ["--nproc-per-node", "2", str(tmp_path / "report.py"), "--flag", mark],
            {**environment, "MARK": mark},
            log,
            timeout=60,
        )
        text = log.read_text()
        assert rc == 0, text
        lines = sorted(line for line in text.splitlines() if line.startswith("rank "))
        assert lines == [f"rank {r} of 2 {mark} ['--flag', '{mark}'] imported" for r in (0, 1)], (
            text
        )

    report("first")
    start = time.monotonic()
    assert (
        server.run(
            ["--nproc-per-node", "2", str(tmp_path / "hang.py")],
            environment,
            tmp_path / "hang.log",
            timeout=5,
        )
        == 124
    )
    assert time.monotonic() - start < 30  # stopped at 5 s, not after the script's 600
    report("second")
    assert "MARK" not in os.environ
