#!/usr/bin/env bash
# The test command's closing line, from the output of `cargo test` (files named, or stdin):
#   tests: N passed, M failed, K skipped, I ignored
# passed, failed and ignored add up libtest's counts over every test binary; a binary that died
# without a result line (a crash, an abort) counts as one failure. skipped counts the lines
# `KVFABRIC-SKIP: <test>: <reason>` that tests print when they cannot run their check
# (kvfabric_testkit::skip); each is listed above the closing line.
#
# Exits 1 when a test or a build failed, when the output holds no test result at all, or in CI
# (CI=true) when a test skipped for any reason but a missing GPU or RDMA device.
#
#   cargo test --workspace --no-fail-fast 2>&1 | tee log; scripts/test-summary.sh log
set -euo pipefail

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cat "$@" > "$log"

read -r passed failed ignored results crashed <<<"$(awk '
  /^test result: / { p += $4; f += $6; i += $8; r++ }
  /^test result: FAILED\./ { fr++ }
  /^error: test failed, to rerun pass/ { e++ }
  END { c = e - fr; print p + 0, f + 0, i + 0, r + 0, (c > 0 ? c : 0) }' "$log")"
failed=$((failed + crashed))

# "KVFABRIC-SKIP: <test>: <reason>", wherever it landed in a line (parallel tests interleave).
skips=$(grep -o 'KVFABRIC-SKIP: .*' "$log" | sed 's/^KVFABRIC-SKIP: //' || true)
skipped=0
refused=()
if [ -n "$skips" ]; then
  skipped=$(printf '%s\n' "$skips" | wc -l)
  while IFS= read -r line; do
    echo "skipped: $line"
    reason=${line#*: }
    case "$reason" in
      "no GPU"* | "no RDMA device"*) ;;
      *) refused+=("$line") ;;
    esac
  done <<<"$skips"
fi

echo "tests: $passed passed, $failed failed, $skipped skipped, $ignored ignored"

status=0
if [ "$crashed" -gt 0 ]; then
  echo "test-summary: $crashed test binaries died without a result (counted as failures)" >&2
fi
if grep -q '^error: could not compile' "$log"; then
  echo "test-summary: a build failed" >&2
  status=1
fi
if [ "$results" -eq 0 ]; then
  echo "test-summary: no test results in the output" >&2
  status=1
fi
[ "$failed" -eq 0 ] || status=1
ci=${CI:-}
if [ "${ci,,}" = true ] || [ "$ci" = 1 ]; then
  if [ ${#refused[@]} -gt 0 ]; then
    echo "test-summary: in CI only a missing GPU or RDMA device may skip a test; these skipped:" >&2
    printf '  %s\n' "${refused[@]}" >&2
    status=1
  fi
fi
exit "$status"
