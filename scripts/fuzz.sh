#!/usr/bin/env bash
# Fuzzes the wire-frame decoder for a bounded time: scripts/fuzz.sh [SECONDS]  (default 60).
# Installs cargo-fuzz when missing. cargo-fuzz needs nightly-only compiler flags; on the stable
# toolchain RUSTC_BOOTSTRAP=1 enables them for this build only.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
mkdir -p fuzz/corpus/frame
RUSTC_BOOTSTRAP=1 cargo fuzz run frame --sanitizer none -- \
  -max_total_time="$secs" -max_len=4096 -print_final_stats=1 2>&1 | tail -n 20
echo "fuzz: frame decoder ran ${secs}s without a crash"
