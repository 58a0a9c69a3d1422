#!/usr/bin/env bash
# A PyPI tool in a cached virtual environment: `scripts/tool-venv.sh NAME SPEC...` installs the
# pip requirement SPECs into <cache>/NAME once and prints the environment's python. The venv is
# reused once complete (a stamp file says so), so only the first run needs PyPI.
#
#   KVFABRIC_CACHE   cache root (default ~/.cache/kvfabric)
set -euo pipefail

name="$1"
shift
cache="${KVFABRIC_CACHE:-$HOME/.cache/kvfabric}"
venv="$cache/$name"
stamp="$venv/.complete"

if [[ -f "$stamp" && -x "$venv/bin/python" ]]; then
    echo "$venv/bin/python"
    exit 0
fi

# Built in place (a venv records its own path); the stamp comes last, so an interrupted run is
# redone from scratch next time.
mkdir -p "$cache"
rm -rf "$venv"
echo "tool-venv: creating $venv ($* from PyPI)" >&2
python3 -m venv "$venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" >&2
touch "$stamp"
echo "$venv/bin/python"
