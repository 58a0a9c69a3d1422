#!/usr/bin/env bash
# The kvfabric Python package's checks: the cached venv (scripts/vllm-venv.sh), the agent binary,
# the wheel built with maturin and installed, ruff, the binding's Rust unit tests, then pytest:
# the binding against real agents, the NIXL plugin inside the real nixl wheel, and the vLLM
# connector with real vLLM processes (CPU build).
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
# The NIXL plugin ships in the wheel (kvfabric.nixl.plugin_dir()); its line tables stay behind.
cargo build -p kvfabric-nixl
strip --strip-debug -o python/kvfabric/nixl/libplugin_KVFABRIC.so target/debug/libplugin_KVFABRIC.so
(cd python && "$venv/bin/maturin" build --profile dev --quiet -o ../target/wheels)
wheel=$(ls -t target/wheels/kvfabric-*.whl | head -n 1)
"$py" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"

"$venv/bin/ruff" check python bench/peers
"$venv/bin/ruff" format --check python bench/peers

PYO3_PYTHON=$py cargo test -p kvfabric-python --lib

# NIXL from PyPI (its UCX runs on CPU): the KVFABRIC plugin is tested inside it, and
# NixlConnector is the peer of the serving benchmark. --no-deps: its CUDA libraries are not
# needed on CPU. (Asked of pip: from the repository root `import nixl` finds the crate's folder.)
"$py" -m pip show -q nixl >/dev/null 2>&1 ||
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps nixl==1.5.1 nixl-cu13==1.5.1

# The peer benchmark's engine-free parts (contents, verification, control channel, table).
PYTHONPATH=$PWD/bench/peers "$venv/bin/pytest" -q -p no:cacheprovider bench/peers/tests

export KVFABRIC_BIN=$PWD/target/release/kvfabric
# From the repository root, so the installed package (with its compiled module) is the one
# imported, not python/kvfabric/ beside it.
# shellcheck disable=SC2086
"$venv/bin/pytest" -q -p no:cacheprovider ${PYTEST_ARGS:-python/tests}
echo "python-test.sh: $((SECONDS - start)) s"
