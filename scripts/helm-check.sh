#!/usr/bin/env bash
# Lints and renders the Helm chart (default values, and every optional feature on), then runs the
# Rust test that parses every rendered document strictly into its Kubernetes type.
#
#   KVFABRIC_RENDERED_DIR  where rendered manifests go (default <workspace>/target/helm-rendered)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
chart="charts/kvfabric"
all_on="$chart/ci/all-features-values.yaml"

bin="$("$root/scripts/install-helm.sh")"
export PATH="$bin:$PATH"

out="${KVFABRIC_RENDERED_DIR:-$root/target/helm-rendered}"
rm -rf "$out"
mkdir -p "$out"

helm lint --strict "$chart"
helm lint --strict "$chart" -f "$all_on"

helm template kvfabric "$chart" --namespace kvfabric --include-crds \
    > "$out/default.yaml"
helm template kvfabric "$chart" --namespace kvfabric --include-crds -f "$all_on" \
    > "$out/all-features.yaml"
echo "helm-check: rendered into $out" >&2

# replicas > 1 without leader election must be refused at render time.
if helm template kvfabric "$chart" --set replicas=2 > /dev/null 2>&1; then
    echo "helm-check: replicas=2 without leader election rendered, expected a failure" >&2
    exit 1
fi

KVFABRIC_RENDERED_DIR="$out" cargo test -p kvfabric-operator --test helm_render -- --nocapture
