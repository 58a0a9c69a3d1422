#!/usr/bin/env bash
# NIXL's UCX backend against its KVFABRIC backend on one GPU machine, through the same NIXL calls
# (bench/peers: engines nixl and nixl-kvfabric), GPU memory on cuda:0 between two processes (path
# ipc: UCX's cuda_ipc, kvfabric's agent over CUDA IPC) and host memory (path shm). Every row
# verifies every destination block after its timed phase; the table comes last.
#
#   bash scripts/nixl-gpu-bench.sh DIR [paths] [blocks] [seconds]
#
# DIR holds what the GPU machine lacks (no Rust, no network there): `kvfabric` (release build,
# default features), `libplugin_KVFABRIC.so` (cargo build --release -p kvfabric-nixl), the nixl
# and nixl-cu13 1.5.1 wheels for its Python and the Debian libraries UCX links
# (scripts/fetch-gpu-peer-wheels.sh writes both). Results go to $OUT/nixl (rows.jsonl, table.txt).
set -euo pipefail
dir=$(realpath "${1:?usage: nixl-gpu-bench.sh DIR [paths] [blocks] [seconds]}")
paths=${2:-ipc,shm} blocks=${3:-4K,16K,64K,256K,1M} seconds=${4:-2}
here="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0
OUT="${OUT:-$(mktemp -d)}"
site=/tmp/kvfabric-nixl-site libs=/tmp/kvfabric-nixl-libs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "$dir"/*.whl
for deb in "$dir"/*.deb; do [[ -f "$deb" ]] && dpkg -x "$deb" "$libs"; done
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
PYTHONPATH="$here/../bench/peers:$site${PYTHONPATH:+:$PYTHONPATH}" \
LD_LIBRARY_PATH="$libs/usr/lib/x86_64-linux-gnu:$libs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
PYTHONUNBUFFERED=1 python3 -m peers run --kvfabric "$dir/kvfabric" --engines nixl,nixl-kvfabric \
  --device 0 --paths "$paths" --blocks "$blocks" --pool-bytes 1GiB --batch-bytes 64MiB \
  --inflight 4 --seconds "$seconds" --latency --no-progress --nixl-plugin-dir "$dir" \
  --out "$OUT/nixl"
