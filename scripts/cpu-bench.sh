#!/usr/bin/env bash
# The CPU-side benchmark sweep behind the README's results table: kvfabric over tcp (loopback and
# between two network namespaces joined by veth) and shm, each row against its bound (the best raw
# variant of the path, measured in the same run: raw tcp ×1…N on hot buffers, memcpy on the
# engine's copy threads, the faster raw ping-pong), with iperf3 and UCX ucp_put_bw run in the same
# job on the same paths. Prints JSON lines to $OUT/rows.jsonl and a table last; a row above its
# bound is flagged CEILING BUG.
#   scripts/cpu-bench.sh [SECONDS_PER_ROW]      (needs root for the namespaces)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
out=${OUT:-target/cpu-bench}; mkdir -p "$out"; rows="$out/rows.jsonl"; : > "$rows"
need=(); command -v iperf3 >/dev/null || need+=(iperf3); command -v ucx_perftest >/dev/null || need+=(ucx-utils)
if [ ${#need[@]} -gt 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; fi
cargo build --release --bin kvfabric
bin=$PWD/target/release/kvfabric
A=kvfA; B=kvfB; ipA=10.77.0.1; ipB=10.77.0.2

netns_up() {
  ip netns del $A 2>/dev/null || true; ip netns del $B 2>/dev/null || true
  ip netns add $A; ip netns add $B
  ip link add v$A type veth peer name v$B
  ip link set v$A netns $A; ip link set v$B netns $B
  ip -n $A addr add $ipA/24 dev v$A; ip -n $B addr add $ipB/24 dev v$B
  for n in $A $B; do ip -n $n link set lo up; ip -n $n link set v$n up; done
}
netns_down() { ip netns del $A 2>/dev/null || true; ip netns del $B 2>/dev/null || true; }

on() { local ns=$1; shift; if [ -n "$ns" ]; then ip netns exec "$ns" "$@"; else "$@"; fi; }

# path label, server namespace, client namespace, server ip
bench_path() {
  local label=$1 sns=$2 cns=$3 ip=$4
  on "$sns" "$bin" bench --serve "$ip:7711" > "$out/serve.out" 2> "$out/serve.err" & local srv=$!
  for _ in $(seq 100); do grep -q control "$out/serve.out" 2>/dev/null && break; sleep 0.1; done
  for shape in "16KiB 1024" "32KiB 2048" "64KiB 512" "1MiB 64"; do
    set -- $shape
    for op in write read; do
      on "$cns" "$bin" bench --connect "$ip:7711" --transport tcp --op $op --block-size $1 \
        --blocks-per-batch $2 --duration "$secs" --json | sed "s/^{/{\"path\":\"$label\",/" >> "$rows"
    done
  done
  on "$cns" "$bin" bench --connect "$ip:7711" --transport tcp --op read --block-size 4096 \
    --blocks-per-batch 1 --concurrency 1 --duration "$secs" --json | sed "s/^{/{\"path\":\"$label\",/" >> "$rows"
  # `ip netns exec` may fork: signal the bench itself, not the wrapper.
  pkill -TERM -f -- "bench --serve $ip:7711" || true; wait $srv || true
  # Peers on the same path, in the same job.
  on "$sns" iperf3 -s -1 -p 5299 >/dev/null 2>&1 & local s=$!; sleep 1
  on "$cns" iperf3 -c "$ip" -p 5299 -t "$secs" -J | python3 -c '
import json,sys; d=json.load(sys.stdin)
print(json.dumps({"path":sys.argv[1],"peer":"iperf3","gbps":round(d["end"]["sum_received"]["bits_per_second"]/8e9,3)}))' "$label" >> "$rows"
  wait $s || true
  for size in 16384 65536 1048576; do
    on "$sns" env UCX_TLS=tcp,self ucx_perftest -p 13399 -t ucp_put_bw -s $size -n 20000 >/dev/null 2>&1 & s=$!; sleep 1
    mbs=$(on "$cns" env UCX_TLS=tcp,self ucx_perftest "$ip" -p 13399 -t ucp_put_bw -s $size -n 20000 2>/dev/null | awk '/^Final:/{print $(NF-2)}')
    wait $s || true
    echo "{\"path\":\"$label\",\"peer\":\"ucx-tcp-put_bw\",\"block_size\":$size,\"gbps\":$(python3 -c "print(round(${mbs:-0}*1048576/1e9,3))")}" >> "$rows"
  done
}

bench_path loopback "" "" 127.0.0.1
if netns_up 2>/dev/null; then
  trap netns_down EXIT
  bench_path veth $B $A $ipB
else
  echo "network namespaces unavailable here; veth rows skipped" >&2
fi
# shm on one node: kvfabric against memcpy of the same blocks and contiguous memcpy.
for shape in "32KiB 2048" "1MiB 64"; do
  set -- $shape
  for op in write read; do
    "$bin" bench --transport shm --op $op --block-size $1 --blocks-per-batch $2 --duration "$secs" --json \
      | sed 's/^{/{"path":"same node",/' >> "$rows"
  done
done
python3 scripts/bench-table.py "$rows"
