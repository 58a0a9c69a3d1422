#!/usr/bin/env bash
# Checks the Helm chart and every object the operator builds, without a cluster:
#   1. helm lint --strict and helm template: default values, and every optional feature on;
#   2. `kvfabric-operator render` of the example fabric and of the all-features fabrics (the
#      objects the controller would apply, from the same builders);
#   3. every rendered document validated strictly (unknown fields are errors) against the
#      Kubernetes 1.29 and 1.35 schemas with PyPI's kubernetes-validate (offline, cached venv);
#   4. the chart's default image names are the ones scripts/build-images.sh builds;
#   5. operator/tests/helm_render.rs: typed round trips, RBAC, security contexts, CEL rules.
#
#   KVFABRIC_RENDERED_DIR  where rendered manifests go (default <workspace>/target/helm-rendered)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
chart="charts/kvfabric"
all_on="$chart/ci/all-features-values.yaml"

bin="$("$root/scripts/install-helm.sh")"
export PATH="$bin:$PATH"
python="$("$root/scripts/install-kubernetes-validate.sh")"

out="${KVFABRIC_RENDERED_DIR:-$root/target/helm-rendered}"
rm -rf "$out"
mkdir -p "$out"

helm lint --strict "$chart"
helm lint --strict "$chart" -f "$all_on"

helm template kvfabric "$chart" --namespace kvfabric --include-crds \
    > "$out/default.yaml"
helm template kvfabric "$chart" --namespace kvfabric --include-crds -f "$all_on" \
    > "$out/all-features.yaml"
# The agents' PodMonitor watching every namespace (all-features has it on one namespace).
helm template kvfabric "$chart" --namespace kvfabric --set podMonitor.enabled=true \
    > "$out/pod-monitor.yaml"

refuse() { # what, then the command that must fail
    local what="$1"
    shift
    if "$@" > /dev/null 2>&1; then
        echo "helm-check: $what rendered, expected a failure" >&2
        exit 1
    fi
}
# replicas > 1 without leader election, and an unknown uninstall mode, are refused at render time.
refuse "replicas=2 without leader election" helm template kvfabric "$chart" --set replicas=2
refuse "uninstall.fabrics=Keep" helm template kvfabric "$chart" --set uninstall.fabrics=Keep
# values.schema.json: a misspelt key and a wrongly typed value are refused at render time.
refuse "a misspelt key (replica)" helm template kvfabric "$chart" --set replica=2
refuse "metrics.port as a string" helm template kvfabric "$chart" --set-string metrics.port=http
refuse "tracing.sampleRatio above 1" helm template kvfabric "$chart" --set tracing.sampleRatio=2
refuse "csi.maxVolumes 0" helm template kvfabric "$chart" --set csi.enabled=true --set csi.maxVolumes=0
# The chart refuses Kubernetes older than 1.29 (kubeVersion) and accepts 1.29.
refuse "kube-version 1.28" helm template kvfabric "$chart" --kube-version 1.28.0
helm template kvfabric "$chart" --kube-version 1.29.0 > /dev/null

# The operator's own objects, from its builders.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
cargo build --quiet -p kvfabric-operator --bin kvfabric-operator
operator="$CARGO_TARGET_DIR/debug/kvfabric-operator"
for v in 1.29 1.35; do
    "$operator" render --kube-version "$v" --file "$chart/examples/prefill-decode.yaml" \
        > "$out/objects-example-$v.yaml"
    "$operator" render --kube-version "$v" --file "$chart/examples/kind.yaml" \
        > "$out/objects-kind-$v.yaml"
    "$operator" render --kube-version "$v" --file "$chart/ci/fabric-all-features.yaml" \
        > "$out/objects-all-features-$v.yaml"
    # The operator of a chart with csi.enabled: socket directories as CSI volumes.
    "$operator" render --kube-version "$v" --socket-volume csi --file "$chart/examples/baseline.yaml" \
        > "$out/objects-baseline-$v.yaml"
done
"$operator" render --kube-version 1.35 --file "$chart/ci/fabric-dra.yaml" > "$out/objects-dra-1.35.yaml"
# DRA in its GA shape needs 1.31: for an older API server the operator must refuse, naming why.
if dra_old="$("$operator" render --kube-version 1.29 --file "$chart/ci/fabric-dra.yaml" 2>&1)"; then
    echo "helm-check: the DRA fabric rendered for Kubernetes 1.29, expected a refusal" >&2
    exit 1
fi
grep -q "spec.agent.resourceClaims.*1.31" <<<"$dra_old" || {
    echo "helm-check: unexpected refusal of the DRA fabric for 1.29: $dra_old" >&2
    exit 1
}
# The fabric NOTES.txt tells a new user to apply (from a packaged chart, no repository at hand)
# is one the operator renders.
helm install kvfabric "$chart" --dry-run=client -n kvfabric 2>/dev/null \
    | sed -n "/kubectl apply -f - <<'EOF'/,/^  EOF/p" | sed '1d;$d' | sed 's/^  //' > "$out/notes-fabric.yaml.in"
grep -q "kind: TransferFabric" "$out/notes-fabric.yaml.in" || {
    echo "helm-check: no TransferFabric example in NOTES.txt" >&2
    exit 1
}
"$operator" render --kube-version 1.35 --file "$out/notes-fabric.yaml.in" > "$out/objects-notes-1.35.yaml"
cp "$chart/examples/etcd.yaml" "$out/example-etcd.yaml"
echo "helm-check: rendered into $out" >&2

# Strict schema validation. Custom kinds (TransferFabric, ServiceMonitor, PodMonitor) have no
# bundled schema:
# helm_render.rs checks them; any other kind without a schema is an error.
validate() { # version, files...
    local version="$1"
    shift
    "$python" - "$version" "$@" <<'PY'
import sys
import yaml
import kubernetes_validate
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

CUSTOM = {
    ("kvfabric.io/v1alpha1", "TransferFabric"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}
version, files = sys.argv[1], sys.argv[2:]
checked, failed = 0, 0
for path in files:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for d in docs:
        what = f"{path}: {d.get('kind')} {d.get('metadata', {}).get('name')}"
        if (d.get("apiVersion"), d.get("kind")) in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(d, version, strict=True)
            checked += 1
        except ValidationError as e:
            failed += 1
            path_in_doc = ".".join(str(p) for p in e.absolute_path)
            print(f"helm-check: {what} is invalid for Kubernetes {version} at {path_in_doc}: {e.message}", file=sys.stderr)
        except SchemaNotFoundError as e:
            failed += 1
            print(f"helm-check: {what}: {e.message}", file=sys.stderr)
if failed:
    sys.exit(f"helm-check: {failed} document(s) failed the Kubernetes {version} schemas")
print(f"helm-check: {checked} documents valid against the Kubernetes {version} schemas (strict)", file=sys.stderr)
PY
}
common=("$out/default.yaml" "$out/all-features.yaml" "$out/pod-monitor.yaml" "$out/example-etcd.yaml"
    "$chart/examples/prefill-decode.yaml" "$chart/examples/kind.yaml" "$chart/examples/baseline.yaml")
for v in 1.29 1.35; do
    objects=("$out/objects-example-$v.yaml" "$out/objects-kind-$v.yaml" "$out/objects-all-features-$v.yaml"
        "$out/objects-baseline-$v.yaml")
    [[ "$v" == 1.35 ]] && objects+=("$out/objects-dra-1.35.yaml" "$chart/ci/dra-claim-templates.yaml")
    validate "$v.0" "${common[@]}" "${objects[@]}"
done

# The chart's default images are exactly what scripts/build-images.sh builds.
refs="$("$root/scripts/build-images.sh" --print-refs)"
operator_ref="$(sed -n 's/^operator //p' <<<"$refs")"
agent_ref="$(sed -n 's/^agent //p' <<<"$refs")"
grep -q "image: \"$operator_ref\"" "$out/default.yaml" || {
    echo "helm-check: the chart's default operator image is not $operator_ref" >&2
    exit 1
}
grep -q -- "--agent-image=$agent_ref\$" "$out/default.yaml" || {
    echo "helm-check: the chart's default agent image is not $agent_ref" >&2
    exit 1
}

KVFABRIC_RENDERED_DIR="$out" cargo test -p kvfabric-operator --test helm_render -- --nocapture
