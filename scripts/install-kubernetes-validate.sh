#!/usr/bin/env bash
# Sets up PyPI's kubernetes-validate (it bundles the Kubernetes JSON schemas, so validation works
# offline) in a cached virtual environment, and prints the environment's python. The venv is
# reused once complete (a stamp file says so), so only the first run needs PyPI.
#
#   KVFABRIC_CACHE                      cache root (default ~/.cache/kvfabric)
#   KVFABRIC_KUBERNETES_VALIDATE_VERSION  package version (default 1.37.0: schemas 1.25 to 1.37)
set -euo pipefail

cache="${KVFABRIC_CACHE:-$HOME/.cache/kvfabric}"
version="${KVFABRIC_KUBERNETES_VALIDATE_VERSION:-1.37.0}"
venv="$cache/kubernetes-validate-$version"
stamp="$venv/.complete"

if [[ -f "$stamp" && -x "$venv/bin/python" ]]; then
    echo "$venv/bin/python"
    exit 0
fi

# Built in place (a venv records its own path); the stamp comes last, so an interrupted run is
# redone from scratch next time.
mkdir -p "$cache"
rm -rf "$venv"
echo "install-kubernetes-validate: creating $venv (kubernetes-validate==$version from PyPI)" >&2
python3 -m venv "$venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "kubernetes-validate==$version" >&2
# The schemas this project validates against must be in the package.
"$venv/bin/python" - <<'PY' >&2
import kubernetes_validate.utils as u
have = set(u.all_versions())
for v in ("1.29.0", "1.35.0"):
    assert v in have, f"kubernetes-validate lacks the {v} schemas (has {sorted(have)})"
PY
touch "$stamp"
echo "$venv/bin/python"
