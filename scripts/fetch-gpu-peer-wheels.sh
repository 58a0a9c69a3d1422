#!/usr/bin/env bash
# Downloads what `scripts/gpu-bench.sh BIN peers` needs on the GPU machine, which has no network:
# the peers' wheels for its Python (3.12, x86_64) and the Debian libraries their engines link
# that a CUDA image may lack (libibverbs1 and its mlx5 provider, libnl, libnuma).
#
#   scripts/fetch-gpu-peer-wheels.sh [DIR]      (default .whl; keep it ignored, carry it along)
#
# The device tool carries at most 64 MiB per call, and NIXL's and Mooncake's wheels hold large
# parts the benchmark never loads (NIXL's expert-parallel kernels for three torch versions,
# Mooncake's store, master, client and process-group libraries): those files are left out of
# the copies written here (and out of their RECORD), everything else is the published wheel.
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
dl="$(mktemp -d)"
trap 'rm -rf "$dl"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" \
  nixl==1.5.1 nixl-cu13==1.5.1 mooncake-transfer-engine-cuda13==0.3.14 dlslime==0.1.23
python3 - "$dl" "$dir" <<'PY'
import pathlib, re, sys, zipfile
src, dst = map(pathlib.Path, sys.argv[1:])
# Members never loaded by bench/peers (matched against the path inside the wheel).
unused = re.compile(r"^(nixl_ep_cu13/.*\.so|mooncake/(_store|_ep)\..*\.so|mooncake/(mooncake_client"
                    r"|mooncake_master|transfer_engine_bench)|mooncake/libmooncake_(pg|pg_device|ep_device)"
                    r"\.so|nixl_cu13\.libs/ucx/libucx_perftest.*)$")
for whl in sorted(src.glob("*.whl")):
    out = dst / whl.name
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if unused.match(item.filename):
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(keepends=True)
                                if not unused.match(l.split(b",")[0].decode()))
            zout.writestr(item, data)
    print(f"{out.name}: {whl.stat().st_size >> 20} -> {out.stat().st_size >> 20} MiB")
PY
apt-get update -qq
(cd "$dir" && apt-get download -qq libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1)
du -sh "$dir"
