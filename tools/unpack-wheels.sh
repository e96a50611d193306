#!/usr/bin/env bash
# Unpack megatron/core of each tested megatron-core release from the package registry:
#   tools/unpack-wheels.sh DIR [VERSION ...]   ->   DIR/<version>/megatron/core/...
# Used to regenerate the fingerprint table (python -m megatron_ga_ext.integration.compat --wheel-dir DIR)
# and to check the patches in patches/ against the released sources.
set -euo pipefail
dir=$1; shift
python=${PYTHON:-python3}
# The releases default to compat.py's list of tested sources (one place to add a release).
versions=("${@:-$(cd "$(dirname "$0")/.." && PYTHONPATH=. "$python" -c 'from megatron_ga_ext.integration.compat import RELEASES; print(*RELEASES)')}")
mkdir -p "$dir"
for v in ${versions[@]}; do
  [ -d "$dir/$v/megatron/core" ] && continue
  tmp=$(mktemp -d)
  # The wheels are tagged cp312; --python-version lets any pip fetch them.
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 "megatron-core==$v" -d "$tmp"
  mkdir -p "$dir/$v"
  "$python" -m zipfile -e "$tmp"/megatron_core-"$v"-*.whl "$dir/$v.unzipped"
  mv "$dir/$v.unzipped/megatron" "$dir/$v/megatron"
  rm -rf "$tmp" "$dir/$v.unzipped"
done
