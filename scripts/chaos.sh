#!/usr/bin/env bash
# Hours of faults against a fabric on this machine (issue 26): agents in network namespaces, a
# three-member etcd, workers pulling verified blocks between every pair, a schedule of agent
# SIGKILL/SIGTERM, workers dropped mid-pull, etcd members killed, peers blackholed and
# fabric-wide restarts; a table of invariants at the end. Needs root (namespaces) and etcd
# (scripts/test.sh installs it). Arguments go to kvfabric-chaos, e.g.
#   scripts/chaos.sh --secs 3600 --agents 4
# Exit 0 when every invariant held.
set -euo pipefail
cd "$(dirname "$0")/.."
# The runner builds the agent binary itself (as the e2e tests do), in the same profile.
cargo build --release -q -p kvfabric-e2e --bin kvfabric-chaos
exec target/release/kvfabric-chaos "$@"
