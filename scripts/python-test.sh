#!/usr/bin/env bash
# The kvfabric Python package's checks: the cached venv (scripts/vllm-venv.sh), the agent binary,
# the wheel built with maturin and installed, ruff, the binding's Rust unit tests, then pytest:
# the binding against real agents, and the vLLM connector with real vLLM processes (CPU build).
# GPU tests skip without a GPU. PYTEST_ARGS passes extra arguments (e.g. "-k client").
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

venv=$(scripts/vllm-venv.sh | tail -n 1)
py=$venv/bin/python

# The agent binary the images carry (scripts/build-images.sh builds the same one, so the test
# command builds it once). The wheel is a debug build: it shares the test builds' compiled
# dependencies, and performance is the benchmark's business (python/benches).
cargo build --release -p kvfabric-cli --no-default-features --features rdma,cuda --bin kvfabric
(cd python && "$venv/bin/maturin" build --profile dev --quiet -o ../target/wheels)
wheel=$(ls -t target/wheels/kvfabric-*.whl | head -n 1)
"$py" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"

"$venv/bin/ruff" check python
"$venv/bin/ruff" format --check python

PYO3_PYTHON=$py cargo test -p kvfabric-python --lib

export KVFABRIC_BIN=$PWD/target/release/kvfabric
# From the repository root, so the installed package (with its compiled module) is the one
# imported, not python/kvfabric/ beside it.
# shellcheck disable=SC2086
"$venv/bin/pytest" -q -p no:cacheprovider ${PYTEST_ARGS:-python/tests}
echo "python-test.sh: $((SECONDS - start)) s"
