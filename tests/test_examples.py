"""examples/launch.sh: a checked launch through the drop-in entry."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_launch_script_is_valid_bash_and_checks_before_it_launches(cli_script):
    subprocess.run(["bash", "-n", str(ROOT / "examples" / "launch.sh")], check=True)
    text = (ROOT / "examples" / "launch.sh").read_text()
    assert text.index('megatron-ga check -- "${LAUNCH[@]}"') < text.index('exec "${LAUNCH[@]}"')
    # Its launch line passes megatron-ga check as it is.
    line = text.split("LAUNCH=(")[1].split("\n)")[0]
    tokens = [
        t
        for t in subprocess.run(
            [
                "bash",
                "-c",
                "NNODES=2 DATA_PATH=d VOCAB_FILE=v MERGE_FILE=m; here=.; "
                f'LAUNCH=({line}); printf "%s\\n" "${{LAUNCH[@]}}"',
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    ]
    result = cli_script("check", "--", *tokens)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no problems found" in result.stdout
