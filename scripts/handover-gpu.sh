#!/usr/bin/env bash
# Builds what the hand-over benchmark (python/benches/handover.py, issue 25 item 4) needs on the
# GPU machine into target/gpu/ (scripts/python-gpu-bundle.sh: the kvfabric wheel, abi3 for
# CPython >= 3.11, and the agent binary without debug info), then prints the commands to run
# there, from the repository root (torch with CUDA installed; no vLLM, no Rust needed).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/python-gpu-bundle.sh
cat <<'CMDS'
On the GPU machine, from the repository root:
  python3 -m pip install -q --no-deps target/gpu/kvfabric-*.whl
  KVFABRIC_BIN=$PWD/target/gpu/kvfabric python3 python/benches/handover.py --json
CMDS
