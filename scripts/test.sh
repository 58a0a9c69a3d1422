#!/usr/bin/env bash
# The README's test command. On a fresh Debian machine it installs what the checks need, then runs
# formatting, lints, the fuzz targets (bounded), the Helm chart checks, and every test.
#   KVFABRIC_FUZZ_SECS  fuzzing time, split over the targets (default 90)
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
pkgs=()
command -v protoc >/dev/null || pkgs+=(protobuf-compiler)          # gRPC code (agent, etcd-client)
python3 -m pip --version >/dev/null 2>&1 || pkgs+=(python3-pip)    # scripts/install-helm.sh
command -v etcd >/dev/null || pkgs+=(etcd-server)                  # registry and e2e tests
command -v openssl >/dev/null || pkgs+=(openssl)                   # etcd TLS test certificates
command -v ip >/dev/null || pkgs+=(iproute2)                       # e2e network namespaces
python3 -m venv --help >/dev/null 2>&1 || pkgs+=(python3-venv)     # kubernetes-validate, vLLM venvs
# Images without a Docker daemon (scripts/build-images.sh), the peers' engine library.
for p in mmdebstrap umoci skopeo binutils libibverbs1; do
  dpkg -s "$p" >/dev/null 2>&1 || pkgs+=("$p")
done
# The engine's `rdma` feature: ibverbs-sys configures rdma-core with cmake and binds it with
# bindgen, then links the system libibverbs.
for p in libibverbs-dev cmake pkg-config libnl-3-dev libnl-route-3-dev libclang-dev clang; do
  dpkg -s "$p" >/dev/null 2>&1 || pkgs+=("$p")
done
if [ ${#pkgs[@]} -gt 0 ]; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt

# Each phase's heading says how long the one before it took.
mark=$SECONDS
phase() { echo "== $* (previous phase: $((SECONDS - mark)) s, total $SECONDS s)"; mark=$SECONDS; }
phase "fmt and clippy"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy -p kvfabric-engine --all-targets --features cuda,rdma -- -D warnings
cargo clippy -p kvfabric-cli --features rdma -- -D warnings
phase "fuzz: frames, op validation, planners, the target's checks, chunks, :authority"
scripts/fuzz.sh "${KVFABRIC_FUZZ_SECS:-90}"
phase "helm: lint, render, strict parse and Kubernetes 1.29/1.35 schemas of every manifest"
scripts/helm-check.sh
phase "tests"
log=$(mktemp)
cargo test --workspace --no-fail-fast 2>&1 | tee "$log" || true
cargo test -p kvfabric-engine --features rdma --test rdma 2>&1 | tee -a "$log" || true
phase "images: operator and agent as OCI archives, checked inside their own root filesystems"
scripts/build-images.sh 2>&1 | tee -a "$log"
phase "python: the kvfabric package and the vLLM connector against real vLLM processes"
scripts/python-test.sh 2>&1 | tee -a "$log"
# One closing line: passed, failed, skipped (KVFABRIC-SKIP lines), ignored; exits non-zero on a
# failure, a crashed test binary, or in CI a skip for anything but a missing GPU or RDMA device.
phase "summary"
status=0
scripts/test-summary.sh "$log" || status=$?
rm -f "$log"
exit "$status"
