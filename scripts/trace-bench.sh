#!/usr/bin/env bash
# What tracing costs: `kvfabric bench --through-agent` at 64 KiB blocks with tracing off and on
# (every span exported over OTLP to an in-process receiver), alternating runs, medians compared.
#   scripts/trace-bench.sh [PAIRS] [SECONDS]    (defaults 5 and 6)
#   KVFABRIC_BIN=path/to/kvfabric uses that binary instead of building one (machines without Rust)
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-5}
secs=${2:-6}
bin=${KVFABRIC_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release -q --bin kvfabric
  bin=target/release/kvfabric
fi
args=(bench --through-agent --block-size 64KiB --blocks-per-batch 1024 --pool-bytes 512MiB
      --duration "$secs" --json)
out=$(mktemp)
for i in $(seq "$pairs"); do
  echo "pair $i/$pairs" >&2
  "$bin" "${args[@]}" | sed 's/^/off /' >>"$out"
  "$bin" "${args[@]}" --trace | sed 's/^/on /' >>"$out"
done
python3 - "$out" <<'PY'
import json, statistics, sys
runs = {"off": [], "on": []}
spans = 0
for line in open(sys.argv[1]):
    mode, _, doc = line.partition(" ")
    r = json.loads(doc)
    assert r["verified"], "a run failed verification"
    runs[mode].append(r["agent_median_gbps"])
    spans += r.get("spans_exported", 0)
off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
print("| tracing | runs GB/s (through the agents, 64 KiB blocks) | median GB/s |")
print("|---|---|---|")
for mode, med in (("off", off), ("on, 100% sampled", on)):
    key = mode.split(",")[0]
    print(f"| {mode} | {' '.join(f'{x:.2f}' for x in runs[key])} | {med:.2f} |")
print(f"\non / off = {on / off * 100:.1f}% (target ≥ 97%); {spans} spans exported in the traced runs")
PY
rm -f "$out"
