#!/usr/bin/env bash
# kvfabric next to its real peers on exactly the same work: NIXL (UCX backend), Mooncake Transfer
# Engine and DLSlime, each driven through its own Python API (bench/peers), over loopback tcp,
# two network namespaces joined by veth, and same-node shared memory where a peer has it; and
# NIXL on kvfabric's backend plugin (nixl-kvfabric: the same NIXL calls, agents started per path),
# whose column KVFABRIC/UCX compares NIXL's two backends.
#
#   scripts/peer-bench.sh [--quick] [--paths loopback,veth,shm] [--blocks 16K,64K,1M]
#                         [--engines kvfabric,nixl,mooncake,dlslime,nixl-kvfabric]
#                         [--seconds S] [--out DIR] [path/to/kvfabric]
#
# Per path and block size: kvfabric's row (`kvfabric bench --json`, 1 GiB pools, 64 MiB batches
# of random block places, 4 in flight, read and write), then each peer on that work (same pools,
# blocks, places, bytes per batch, batches in flight; warm-up untimed; median of 3 runs; random
# data; destination poisoned first and checked block by block), plus one 4 KiB read, one op in
# flight. JSON lines go to DIR/rows.jsonl (default target/peer-bench), the table last (and to
# DIR/table.txt). --quick: 256 MiB pools, 1.5 s a row — a correctness check, not a measurement.
# Needs root (apt, network namespaces). The peers install into a cached virtualenv,
# ~/.cache/kvfabric/peers-venv, reused once complete.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0 paths=loopback,veth,shm blocks=16K,64K,1M seconds="" out=${OUT:-target/peer-bench} bin=""
engines=kvfabric,nixl,mooncake,dlslime,nixl-kvfabric
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --paths) paths=$2; shift ;;
    --engines) engines=$2; shift ;;
    --blocks) blocks=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    --out) out=$2; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) echo "peer-bench: unknown option $1" >&2; exit 2 ;;
    *) bin=$1 ;;
  esac
  shift
done
pool=1GiB
if [ "$quick" = 1 ]; then pool=256MiB; seconds=${seconds:-1.5}; fi
seconds=${seconds:-6}

# Debian packages: Mooncake's engine library links libibverbs1 (it only has to load), the
# namespaces need iproute2.
need=()
dpkg -s libibverbs1 >/dev/null 2>&1 || need+=(libibverbs1)
command -v ip >/dev/null || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The peers, pinned to the versions this script was last run with; a different list rebuilds.
specs="nixl==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1 dlslime==0.1.23 numpy tqdm"
venv=${PEERS_VENV:-$HOME/.cache/kvfabric/peers-venv}
if [ "$(cat "$venv/.complete" 2>/dev/null)" != "$specs" ]; then
  echo "peer-bench: installing $specs into $venv" >&2
  rm -rf "$venv.partial" "$venv"
  python3 -m venv "$venv.partial"
  "$venv.partial/bin/pip" install -q --upgrade pip
  # shellcheck disable=SC2086
  "$venv.partial/bin/pip" install -q $specs
  mv "$venv.partial" "$venv"
  # The venv was built under another name: point its scripts at the new one.
  grep -rlI --exclude-dir=site-packages "$venv.partial" "$venv" | xargs -r sed -i "s#$venv.partial#$venv#g"
  echo "$specs" >"$venv/.complete"
fi

if [ -z "$bin" ]; then
  bin=target/release/kvfabric
  if [ ! -x "$bin" ]; then
    command -v protoc >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq protobuf-compiler >/dev/null; }
    cargo build --release --bin kvfabric
  fi
fi
bin=$(realpath "$bin")
# NIXL's KVFABRIC backend (the nixl-kvfabric engine: NIXL's own API on kvfabric's agents).
plugin_dir=${KVFABRIC_NIXL_PLUGIN_DIR:-}
if [ -z "$plugin_dir" ]; then
  cargo build --release -p kvfabric-nixl
  plugin_dir=$PWD/target/release
fi

# Two hosts on one machine (the logic of shared/tools/netns-pair.sh, with names and a subnet of
# our own so a run beside other jobs' namespaces does not collide).
A=kvfpA B=kvfpB ipA=10.79.0.1 ipB=10.79.0.2
netns_down() { ip netns del $A 2>/dev/null || true; ip netns del $B 2>/dev/null || true; }
netns_up() {
  netns_down
  ip netns add $A && ip netns add $B &&
    ip link add v$A type veth peer name v$B &&
    ip link set v$A netns $A && ip link set v$B netns $B &&
    ip -n $A addr add $ipA/24 dev v$A && ip -n $B addr add $ipB/24 dev v$B &&
    for n in $A $B; do
      ip -n $n link set lo up && ip -n $n link set v$n up &&
        # DLSlime opens one TCP connection per block op: without reuse the namespace runs out
        # of ports in TIME-WAIT.
        ip netns exec $n sysctl -qw net.ipv4.tcp_tw_reuse=1 || return 1
    done
}
if [[ ",$paths," == *,veth,* ]]; then
  if netns_up; then
    trap netns_down EXIT
  else
    echo "peer-bench: network namespaces unavailable here; veth rows skipped" >&2
    netns_down
    paths=$(echo ",$paths," | sed 's/,veth,/,/; s/^,//; s/,$//')
  fi
fi
# DLSlime's connections per batch (one per block op) need more descriptors than the default.
ulimit -n 65536 2>/dev/null || true

PYTHONPATH=$PWD/bench/peers${PYTHONPATH:+:$PYTHONPATH} "$venv/bin/python" -m peers run \
  --kvfabric "$bin" --engines "$engines" --paths "$paths" --blocks "$blocks" --latency --seconds "$seconds" \
  --pool-bytes "$pool" --batch-bytes 64MiB --inflight 4 --netns "$A,$B" --veth-ips "$ipA,$ipB" \
  --nixl-plugin-dir "$plugin_dir" --out "$out"
