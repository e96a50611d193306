#!/usr/bin/env bash
# The package as a user installs it: build the wheel and the sdist from this checkout, install the wheel into a
# fresh virtual environment (no editable install, no checkout on the path), and run the console script and
# install() on megatron-core from there. A module or data file missing from the wheel fails here.
#   tools/check-wheel.sh PYTHON CONSTRAINTS
set -euo pipefail
python=${1:?python}
constraints=${2:?constraints file}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/build-env"
"$work/build-env/bin/pip" install --quiet build
"$work/build-env/bin/python" -m build --outdir "$work/dist" "$root" >/dev/null
ls "$work/dist"
wheel=$(ls "$work/dist"/*.whl)
# Test-only support (fault injection, the e2e fork server, its recorder) is tests/support/, never in the wheel.
"$python" - "$wheel" <<'PY'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
test_only = [n for n in names if n.startswith("tests/") or n.endswith(("/faults.py", "/pretrain_server.py", "/recorder.py"))]
if test_only:
    sys.exit(f"the wheel carries test-only support: {test_only}")
print(f"wheel: {len(names)} files, no test-only support")
PY
"$python" -m venv "$work/env"
"$work/env/bin/pip" install --quiet -c "$root/$constraints" "$wheel[megatron]"
cd "$work"  # not the checkout: the wheel's package, not the source tree's
"$work/env/bin/megatron-ga" --version
"$work/env/bin/megatron-ga" check -- torchrun --nproc-per-node 8 -m megatron_ga_ext pretrain_gpt.py --tensor-model-parallel-size 2 \
  --micro-batch-size 2 --global-batch-size 64 --seq-length 2048 --ga-loss-reduction token
"$work/env/bin/python" - <<'PY'
import megatron_ga_ext
from megatron_ga_ext import GAConfig

state = megatron_ga_ext.install(GAConfig(loss_reduction="token"))
print(f"install() on megatron-core {state.version}: {state.config.loss_reduction} mode")
megatron_ga_ext.uninstall()
PY
