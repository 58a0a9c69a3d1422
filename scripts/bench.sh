#!/usr/bin/env bash
# The README's main job: installs what the build needs on a fresh Debian machine (protoc for the
# gRPC code), then runs `kvfabric bench` on the embedded default (no etcd, no cluster).
# Arguments are passed to `kvfabric bench` (e.g. --through-agent, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v protoc >/dev/null; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq protobuf-compiler >/dev/null
fi
exec cargo run --release --bin kvfabric -- bench "$@"
