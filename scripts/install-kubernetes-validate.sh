#!/usr/bin/env bash
# Sets up PyPI's kubernetes-validate (it bundles the Kubernetes JSON schemas, so validation works
# offline) in a cached virtual environment (scripts/tool-venv.sh), and prints its python.
#
#   KVFABRIC_CACHE                      cache root (default ~/.cache/kvfabric)
#   KVFABRIC_KUBERNETES_VALIDATE_VERSION  package version (default 1.37.0: schemas 1.25 to 1.37)
set -euo pipefail

version="${KVFABRIC_KUBERNETES_VALIDATE_VERSION:-1.37.0}"
python="$("$(dirname "${BASH_SOURCE[0]}")/tool-venv.sh" "kubernetes-validate-$version" \
    "kubernetes-validate==$version")"
# The schemas this project validates against must be in the package.
"$python" - <<'PY' >&2
import kubernetes_validate.utils as u
have = set(u.all_versions())
for v in ("1.29.0", "1.35.0"):
    assert v in have, f"kubernetes-validate lacks the {v} schemas (has {sorted(have)})"
PY
echo "$python"
