#!/usr/bin/env bash
# Fuzzes the wire-frame decoder for a bounded time: scripts/fuzz.sh [SECONDS]  (default 60).
# Installs cargo-fuzz when missing. cargo-fuzz needs nightly-only compiler flags; on the stable
# toolchain RUSTC_BOOTSTRAP=1 enables them for this build only. fuzz/seeds/ holds inputs that once
# found bugs; they are replayed first on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
mkdir -p fuzz/corpus/frame target
log=target/fuzz-frame.log
if RUSTC_BOOTSTRAP=1 cargo fuzz run frame --sanitizer none fuzz/corpus/frame fuzz/seeds/frame -- \
    -max_total_time="$secs" -max_len=4096 -print_final_stats=1 > "$log" 2>&1; then
  tail -n 6 "$log"
  echo "fuzz: frame decoder ran ${secs}s without a crash"
else
  grep -v '^#' "$log" | tail -n 60
  echo "fuzz: the frame decoder crashed; the input is under fuzz/artifacts/frame/" >&2
  exit 1
fi
