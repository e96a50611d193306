"""The tier's launcher itself: one import of Megatron per source serves every launch, a hung launch is stopped at its
timeout without stopping the server, and each launch sees the environment and arguments it was given."""

from __future__ import annotations

import os
import sys
import time

import pytest

from pretrain_runs import ROOT, _server

pytestmark = pytest.mark.e2e


def test_a_hung_launch_is_stopped_and_the_next_launch_runs(newest_release, tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    report = tmp_path / "report.py"
    report.write_text("import os, sys\n"
                      "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['MARK'], sys.argv[1:],\n"
                      "      'imported' if 'megatron.training.training' in sys.modules else 'not imported')\n")
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    server = _server(newest_release, sys.executable, environment)
    start = time.monotonic()
    assert server.run(["--nproc-per-node", "2", str(hang)], environment, tmp_path / "hang.log", timeout=5) == 124
    assert time.monotonic() - start < 60  # the import, then 5 s; not the script's 600 s

    rc = server.run(["--nproc-per-node", "2", str(report), "--flag", "1"], {**environment, "MARK": "second"},
                    tmp_path / "report.log", timeout=60)
    output = (tmp_path / "report.log").read_text()
    assert rc == 0, output
    assert sorted(line for line in output.splitlines() if line.startswith("rank ")) == [
        "rank 0 of 2 second ['--flag', '1'] imported", "rank 1 of 2 second ['--flag', '1'] imported"]
    assert "MARK" not in os.environ
