#!/usr/bin/env bash
# Puts what the connector's GPU test needs on a machine without a build toolchain into
# target/gpu/ (under 64 MiB): the kvfabric wheel and the agent binary without debug info.
# There (torch and pytest installed), from the repository root:
#   python3 -m pip install -q --no-deps target/gpu/kvfabric-*.whl
#   KVFABRIC_BIN=$PWD/target/gpu/kvfabric python3 -m pytest -v -p no:cacheprovider \
#     python/tests/test_worker.py -k cuda
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(scripts/vllm-venv.sh | tail -n 1)
cargo build --release -p kvfabric-cli --bin kvfabric
(cd python && "$venv/bin/maturin" build --release --quiet -o ../target/wheels)
rm -rf target/gpu && mkdir -p target/gpu
objcopy --strip-debug target/release/kvfabric target/gpu/kvfabric
cp "$(ls -t target/wheels/kvfabric-*.whl | head -n 1)" target/gpu/
du -sh target/gpu
