#!/usr/bin/env bash
# Two builds of kvfabric side by side on one machine: `kvfabric bench` (its default rows) and
# `kvfabric bench --through-agent`, alternating before/after ROUNDS times (default 3), then a
# table of medians with after/before (scripts/before_after.py). Needs no Rust toolchain, so it
# runs on the GPU machine with binaries built here.
#   scripts/before-after.sh path/to/kvfabric-before path/to/kvfabric-after [out-dir]
set -uo pipefail
before=$(realpath "${1:?usage: before-after.sh BEFORE AFTER [OUT]}")
after=$(realpath "${2:?usage: before-after.sh BEFORE AFTER [OUT]}")
out=${3:-$(mktemp -d)}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
for i in $(seq 1 "${ROUNDS:-3}"); do
  for b in before after; do
    bin=$before
    [ "$b" = after ] && bin=$after
    timeout 120 "$bin" bench --duration 2 --json >"$out/${b}_direct_$i.jsonl" 2>"$out/${b}_direct_$i.err" ||
      echo "$b direct round $i failed (see $out/${b}_direct_$i.err)"
    timeout 120 "$bin" bench --duration 2 --json --through-agent >"$out/${b}_agent_$i.jsonl" \
      2>"$out/${b}_agent_$i.err" || echo "$b through-agent round $i failed"
  done
done
python3 "$here/before_after.py" "$out"
