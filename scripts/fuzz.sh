#!/usr/bin/env bash
# Fuzzes every target under fuzz/fuzz_targets for a bounded time in all, split evenly:
#   scripts/fuzz.sh [SECONDS]   (default 60)
# Targets: frame (wire decoder, handshake frames), ops (op::validate + coalescing), plan (the
# batch planner, then the rdma and cuda-ipc planners), serve (the tcp target's checks of a peer's
# manifests and block tables), chunks (the tcp link's cut of a batch into chunks), authority
# (the local API's HTTP/2 :authority rewriter).
# Installs cargo-fuzz when missing.
# cargo-fuzz needs nightly-only compiler flags; on the stable toolchain RUSTC_BOOTSTRAP=1 enables
# them for this build only. fuzz/seeds/<target>/ holds committed inputs (real frames, inputs that
# once found bugs); they are replayed first on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=$(cd fuzz/fuzz_targets && ls ./*.rs | sed 's|^\./||; s|\.rs$||' | sort)
n=$(echo "$targets" | wc -w)
each=$(( secs / n > 0 ? secs / n : 1 ))
mkdir -p target
failed=()
for t in $targets; do
  mkdir -p "fuzz/corpus/$t" "fuzz/seeds/$t"
  log="target/fuzz-$t.log"
  if RUSTC_BOOTSTRAP=1 cargo fuzz run "$t" --sanitizer none "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
      -max_total_time="$each" -max_len=4096 -print_final_stats=1 > "$log" 2>&1; then
    grep -E '^stat::number_of_executed_units|^stat::new_units_added' "$log" | tr '\n' ' '
    echo
    echo "fuzz: $t ran ${each}s without a crash"
  else
    grep -v '^#' "$log" | tail -n 60
    echo "fuzz: $t crashed; the input is under fuzz/artifacts/$t/" >&2
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashed: ${failed[*]}" >&2
  exit 1
fi
