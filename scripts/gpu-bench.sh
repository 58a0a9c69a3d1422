#!/usr/bin/env bash
# GPU correctness and benchmark job for the 2-GPU machine. Needs no Rust toolchain: give it a
# prebuilt release binary (cargo build --release --bin kvfabric; the `cuda` feature is default).
#
#   NCCL_NVLS_ENABLE=0 bash scripts/gpu-bench.sh ./kvfabric [quick|sm|ipc|tables|peers|tcp]
#
# 1. correctness: `kvfabric gpu-selftest` (random sizes, unaligned offsets, both directions,
#    sm and ce), the engine's GPU tests when their binary travels along (engine-cuda-tests), and
#    every bench row verifies every destination byte after its timed phase;
# 2. the sweep: 4 KiB … 1 MiB blocks, 512 MiB per batch, read and write, sm and ce, then both
#    directions at once; the same batches as block tables (`--layout planes:64`: 64 planes, a
#    layer's K and V each, and block-id pairs shared by all, which the kernel expands itself),
#    one direction and both; then the single 4 KiB op latency (default and spinning completion).
#    `tables` runs the block-table rows, the op-list rows they compare with (sm, 4 KiB … 64 KiB)
#    and the latency rows only;
# 3. GPU memory over tcp (staged through pinned host buffers) next to host memory over tcp, same
#    shapes, one after the other: cuda:0 → host and host → host (and cuda:0 ↔ cuda:1), 64 KiB …
#    1 MiB blocks, read and write (`tcp` mode runs only these after the correctness steps);
#    `ipc` runs the cuda-ipc sweep and latency rows only, `peers` only step 4 (each fits one
#    10-minute device call);
# 4. the peers of shared/tools/gpu_baselines.py in the same job (PyTorch, NCCL); in `peers` mode
#    also the real peers on one GPU (bench/peers, as scripts/peer-bench.sh on the CPU): NIXL,
#    Mooncake TE and DLSlime next to kvfabric on exactly its work, GPU memory on cuda:0, two
#    processes — same GPU through CUDA IPC (path `ipc`) and GPU memory over tcp loopback
#    (`gpu-tcp`). Their wheels come from scripts/fetch-gpu-peer-wheels.sh (PEER_WHEELS, default
#    .whl beside scripts/); rows into $OUT/peers/ (rows.jsonl, table.txt);
# 5. a short table, last, with gpu-tcp / host-tcp ratios. JSON lines go to $OUT
#    (kvfabric.jsonl, baselines.jsonl). TESTS_BIN names the engine's GPU test binary if it is
#    not engine-cuda-tests beside this script.
set -uo pipefail
bin="$(realpath "${1:?usage: gpu-bench.sh path/to/kvfabric [quick|sm|tcp]}")"
mode="${2:-full}"
here="$(cd "$(dirname "$0")" && pwd)"
# NVLink multicast stays off: a program using it can take the host's shared GPUs down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
log="$OUT/log.txt"
rows="$OUT/kvfabric.jsonl"
: >"$rows"
failed=0

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m 2>&1 | head -8 | tee -a "$OUT/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)
peer=1
[[ "$ngpu" -ge 2 ]] || peer=0

step() { echo "== $*" | tee -a "$log" >&2; }

step "selftest"
rounds=8
[[ "$mode" == quick || "$mode" == tcp ]] && rounds=2
if ! "$bin" gpu-selftest --devices "0,$peer" --rounds "$rounds" 2>>"$log" | tee "$OUT/selftest.json"; then
  echo "SELFTEST FAILED" | tee -a "$log"
  failed=1
fi

# The engine's GPU tests, when their prebuilt binary travels beside this script
# (cargo test --release -p kvfabric-engine --features cuda --test cuda --no-run).
tests_bin="${TESTS_BIN:-$here/engine-cuda-tests}"
if [[ -x "$tests_bin" ]]; then
  step "engine GPU tests"
  if ! timeout 300 "$tests_bin" --test-threads=1 --nocapture >>"$log" 2>&1; then
    echo "ENGINE GPU TESTS FAILED" | tee -a "$log"
    failed=1
  fi
  grep -E "^test result|skipped" "$log" | tail -3
fi

# POOL (default 12GiB) sizes both pools; it goes into each JSON row as "pool".
bench() {
  local pool="${POOL:-12GiB}"
  step "bench $* (pool $pool)"
  if ! timeout 90 "$bin" bench --json --location cuda:0 --peer-location "cuda:$peer" \
      --pool-bytes "$pool" --duration 2 "$@" 2>>"$log" |
      sed "s/^{/{\"pool\":\"$pool\",/" >>"$rows"; then
    echo "BENCH FAILED: $*" | tee -a "$log"
    failed=1
  fi
}

# GPU memory over tcp against host memory over tcp on the same path (loopback), same shape,
# one right after the other. The label goes into each JSON row as "pair".
tcp_row() {
  local label=$1
  shift
  step "tcp $label $*"
  if ! timeout 120 "$bin" bench --json --transport tcp --pool-bytes 512MiB --duration 2 "$@" \
      2>>"$log" | sed "s/^{/{\"pair\":\"$label\",/" >>"$rows"; then
    echo "BENCH FAILED: tcp $label $*" | tee -a "$log"
    failed=1
  fi
}
tcp_rows() {
  for bs in 65536 262144 1048576; do
    local n=$(((16 << 20) / bs))
    for op in write read; do
      local shape=(--op "$op" --block-size "$bs" --blocks-per-batch "$n")
      tcp_row host-tcp --location host --peer-location host "${shape[@]}"
      tcp_row gpu-tcp --location cuda:0 --peer-location host "${shape[@]}"
      if [[ "$ngpu" -ge 2 ]]; then
        tcp_row gpu-gpu-tcp --location cuda:0 --peer-location "cuda:$peer" "${shape[@]}"
      fi
    done
  done
}

# Block sizes of the block-table rows (sm path, 64 planes).
table_sizes=(4096 16384 65536 1048576)
if [[ "$mode" == tcp || "$mode" == peers ]]; then
  sizes=()
  paths=()
  table_sizes=()
elif [[ "$mode" == quick ]]; then
  sizes=(65536)
  paths=(sm)
  table_sizes=(4096)
elif [[ "$mode" == sm ]]; then
  sizes=(4096 16384 65536 262144 1048576)
  paths=(sm)
elif [[ "$mode" == tables ]]; then
  sizes=(4096 16384 65536)
  paths=(sm)
else
  sizes=(4096 16384 65536 262144 1048576)
  paths=(sm ce)
fi
total=$((512 << 20))
for path in "${paths[@]}"; do
  for bs in "${sizes[@]}"; do
    bench --cuda-path "$path" --block-size "$bs" --blocks-per-batch $((total / bs)) \
      --concurrency 24 --no-latency
  done
done
if [[ "$mode" != tables ]]; then
  for path in "${paths[@]}"; do
    for bs in "${sizes[@]}"; do
      bench --cuda-path "$path" --block-size "$bs" --blocks-per-batch $((total / bs)) \
        --concurrency 24 --bidirectional --no-latency
    done
  done
fi
# The same 512 MiB batches as block tables of 64 planes (each a 1/64 of the pool), one
# direction, then both at once.
for bs in "${table_sizes[@]}"; do
  bench --layout planes:64 --cuda-path sm --block-size "$bs" --blocks-per-batch $((total / bs)) \
    --concurrency 24 --no-latency
done
for bs in "${table_sizes[@]}"; do
  bench --layout planes:64 --cuda-path sm --block-size "$bs" --blocks-per-batch $((total / bs)) \
    --concurrency 24 --bidirectional --no-latency
done
if [[ "$mode" != tcp && "$mode" != peers ]]; then
  # One 4 KiB op at random places of a 12 GiB pool (each op also pays cold GPU address
  # translations) and of a 1 GiB one; the ceiling copies at random places of same-sized pools.
  for pool in 12GiB 1GiB; do
    for op in read write; do
      POOL=$pool bench --cuda-path sm --block-size 4096 --blocks-per-batch 1 --concurrency 1 --op "$op"
      POOL=$pool bench --cuda-path sm --block-size 4096 --blocks-per-batch 1 --concurrency 1 --op "$op" --cuda-spin
    done
  done
fi
[[ "$mode" == quick || "$mode" == ipc || "$mode" == tables || "$mode" == peers ]] || tcp_rows

step "peers (gpu_baselines.py)"
if [[ "$ngpu" -ge 2 && "$mode" != tcp && "$mode" != ipc && "$mode" != tables ]]; then
  args=(--skip-nccl)
  [[ "$mode" == quick ]] && args=(--sizes 65536 --skip-nccl --iters 4)
  timeout 150 python3 "$here/gpu_baselines.py" "${args[@]}" >"$OUT/baselines.jsonl" 2>>"$log" ||
    echo "baselines failed (see log.txt)" | tee -a "$log"
  # NCCL with one op per block takes minutes at 4 KiB (10^5 ops a batch); its 1 MiB point only.
  if [[ "$mode" != quick ]]; then
    timeout 120 python3 "$here/gpu_baselines.py" --sizes 1048576 --iters 4 2>>"$log" |
      grep nccl >>"$OUT/baselines.jsonl" || echo "nccl baseline failed (see log.txt)" | tee -a "$log"
  fi
fi

if [[ "$mode" == peers ]]; then
  step "peer engines on cuda:0 (NIXL, Mooncake TE, DLSlime)"
  wheels="${PEER_WHEELS:-$here/../.whl}"
  site=/tmp/kvfabric-peers-site
  if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl >>"$log" 2>&1 || echo "peer wheels did not install (see log.txt)" | tee -a "$log"
  else
    echo "no peer wheels in $wheels (scripts/fetch-gpu-peer-wheels.sh): peers will fail to import" | tee -a "$log"
  fi
  # Libraries the engines link that the image may lack (Debian packages fetched with the wheels).
  libs=/tmp/kvfabric-peers-libs
  for deb in "$wheels"/*.deb; do [[ -f "$deb" ]] && dpkg -x "$deb" "$libs"; done
  peer_env=(PYTHONPATH="$here/../bench/peers:$site${PYTHONPATH:+:$PYTHONPATH}"
            LD_LIBRARY_PATH="$libs/usr/lib/x86_64-linux-gnu:$libs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            PYTHONUNBUFFERED=1)
  # 512 MiB batches (the GPU rows' shape) at random places of 4 GiB pools, 4 in flight.
  if ! timeout "${PEERS_TIMEOUT:-480}" env "${peer_env[@]}" python3 -m peers run --kvfabric "$bin" \
      --device 0 --paths "${PEER_PATHS:-ipc,gpu-tcp}" --blocks "${PEER_BLOCKS:-16K,64K,1M}" \
      --pool-bytes 4GiB --batch-bytes 512MiB --inflight 4 --seconds "${PEER_SECONDS:-3}" --latency \
      --no-progress --out "$OUT/peers" 2>>"$log"; then
    echo "PEERS RUN FAILED (see log.txt)" | tee -a "$log"
    failed=1
  fi
fi

python3 - "$rows" "$OUT/baselines.jsonl" <<'PY' | tee "$OUT/table.txt"
import json, sys
def load(p):
    try:
        return [json.loads(l) for l in open(p) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []
rows, peers = load(sys.argv[1]), load(sys.argv[2])
def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
print(f"{'transport':<14}{'op':<6}{'layout':<10}{'block':>8}{'pool':>7}{'Mops/s':>8}{'GB/s':>9}{'p50 us':>9}  {'ceiling':<29}{'ratio':>7}  verified")
for r in rows:
    ceil = f"{r['ceiling_p50_us']:.1f} us" if r.get("ceiling_p50_us") else f"{r['ceiling_gbps']:.1f} GB/s"
    print(f"{r.get('pair', r['transport']):<14}{r['op']:<6}{r.get('layout', 'ops'):<10}{size(r['block_size']):>8}{r.get('pool', ''):>7}"
          f"{r.get('ops_per_sec', 0) / 1e6:>8.2f}{r['gbps']:>9.2f}{r['p50_us']:>9.1f}  "
          f"{r['ceiling_name'][:18] + ' ' + ceil:<29}{r['ratio'] * 100:>6.0f}%  {'yes' if r['verified'] else 'NO'}")
tcp = {(r["pair"], r["op"], r["block_size"]): r["gbps"] for r in rows if "pair" in r}
shapes = sorted({(op, bs) for (_, op, bs) in tcp}, key=lambda k: (k[0], k[1]))
if shapes:
    print("GPU memory over tcp (pinned staging) / host memory over tcp, same path and shape (target >= 90%):")
    print(f"  {'op':<6}{'block':>8}{'host-tcp':>10}{'gpu-tcp':>9}{'ratio':>7}{'gpu-gpu':>9}{'ratio':>7}")
    for op, bs in shapes:
        h = tcp.get(("host-tcp", op, bs))
        cells = []
        for pair in ("gpu-tcp", "gpu-gpu-tcp"):
            g = tcp.get((pair, op, bs))
            cells.append(f"{g:>9.2f}{g / h * 100:>6.0f}%" if g and h else f"{'-':>9}{'-':>7}")
        print(f"  {op:<6}{size(bs):>8}{(h or 0):>10.2f}{cells[0]}{cells[1]}")
if peers:
    print("peers (same job):")
    for p in peers:
        print(f"  {p['baseline']:<16}{size(p['block_size']):>8}{p['gbps']:>9.1f} GB/s")
PY
[[ "$failed" == 0 ]] && echo "gpu-bench: all checks passed" || echo "gpu-bench: FAILURES (see $OUT/log.txt)"
exit "$failed"
