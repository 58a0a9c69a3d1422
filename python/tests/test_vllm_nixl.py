"""vLLM's own NixlConnector on the KVFABRIC backend, as a deployment switches to it: the wheel
installed, ``NIXL_PLUGIN_DIR`` set to its plugin directory, ``backends: ["KVFABRIC"]`` in
``kv_connector_extra_config``, nothing else changed. Real vLLM processes (CPU build, vLLM's
defaults: prefix caching on), a decode instance smaller than its prefill, each talking to its
own node's kvfabric agent (etcd, a fabric token, tcp between them); the same run with NIXL's
own UCX backend as the control.

Every decode output is compared token for token with the decode instance computing the prompt
itself (a ``cache_salt`` keeps its prefix cache out); vLLM counts the prompt's tokens as taken
from the connector, and the decode node's agent counts the bytes it moved.
"""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("nixl")

from fabric import Agent, Etcd  # noqa: E402
from tiny_llama import write  # noqa: E402
from vllm_server import (  # noqa: E402
    BLOCK_SIZE,
    HITS,
    VllmServer,
    nixl_connector,
    prefill,
    prompt,
    start,
    tokens,
)

from kvfabric.nixl import plugin_dir  # noqa: E402

pytestmark = pytest.mark.vllm

TOKEN = ["--peer-token", "pytest-vllm-nixl-token-0123456789"]
# Shorter than a block, whole blocks, blocks and a part.
LENGTHS = (7, 3 * BLOCK_SIZE, 4 * BLOCK_SIZE + 5)
NEW_TOKENS = 10
# The tiny model's KV per token: K and V × 2 layers × 2 KV heads × 32 × fp32.
KV_PER_TOKEN = 2 * 2 * 2 * 32 * 4
BACKENDS = ("KVFABRIC", "UCX")


def nixl_server(name: str, model, root, role: str, backend: str, agent: Agent) -> VllmServer:
    """A vLLM instance with NixlConnector, configured as vLLM's docs configure it on CPU; the
    only kvfabric-specific things are the backend's name and the two environment variables."""
    args = nixl_connector({"backends": [backend]} if backend == "KVFABRIC" else None)
    # vLLM's default when a load fails (VllmServer's configuration recomputes otherwise).
    args["connector"]["kv_load_failure_policy"] = None
    # NIXL_PLUGIN_DIR replaces NIXL's own plugin directory: the control must not inherit it
    # (test_nixl.py sets it for this process).
    args["env"]["NIXL_PLUGIN_DIR"] = None
    if backend == "KVFABRIC":
        args["env"] |= {
            "NIXL_PLUGIN_DIR": str(plugin_dir()),
            "KVFABRIC_SOCKET_DIR": agent.socket_dir,
        }
    return VllmServer(
        name, model, root, role, kv_bytes=64 << 20 if role == "kv_producer" else 32 << 20, **args
    )


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-nixl")
    model = write(root / "model", seed=0)
    etcd = Etcd()
    agents = {
        side: Agent(f"agent-{side}", etcd=etcd.endpoint, extra=[*TOKEN, "--transports", "tcp"])
        for side in ("p", "d")
    }
    servers = {}
    for backend in BACKENDS:
        for side, role in (("p", "kv_producer"), ("d", "kv_consumer")):
            name = f"{backend.lower()}-{side}"
            servers[(backend, side)] = nixl_server(name, model, root, role, backend, agents[side])
    try:
        start(*servers.values())
        yield {"agents": agents, **servers}
    finally:
        for s in servers.values():
            s.stop()
        for a in agents.values():
            a.kill()
        etcd.stop()


def moved_bytes(agent: Agent) -> float:
    """Bytes the agent moved for its workers (every series of ``kvfabric_agent_bytes``)."""
    url = f"http://{agent.ready['metrics']}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^kvfabric_agent_bytes_total(?:\{.*\})? (\S+)$", text, re.M)
    )


def hand_over(pd, backend: str, p: list[int]) -> tuple[list[int], list[int], float]:
    """Prefill on the backend's prefill instance, decode on its decode instance: the decode's
    tokens, the tokens the decode computes itself, and the prompt tokens vLLM took from the
    connector."""
    prefill_server, decode = pd[(backend, "p")], pd[(backend, "d")]
    params = prefill(prefill_server, p)
    assert params and params.get("do_remote_prefill"), params
    before = decode.metric(HITS)
    out = decode.complete(p, NEW_TOKENS, params)
    hits = decode.metric(HITS) - before
    own = decode.complete(p, NEW_TOKENS, cache_salt=f"own-{backend}-{p[:4]}")
    return tokens(out), tokens(own), hits


@pytest.mark.parametrize("backend", BACKENDS)
def test_nixlconnector_decodes_as_the_instance_itself(pd, backend):
    agent = pd["agents"]["d"]
    for i, n in enumerate(LENGTHS):
        before = moved_bytes(agent)
        p = prompt(n, 10 * i + len(backend))
        got, own, hits = hand_over(pd, backend, p)
        assert got == own, (backend, n)
        # The prompt's KV came from the prefill (vLLM's count), the last partial block too.
        assert hits == n, (backend, n, hits)
        moved = moved_bytes(agent) - before
        if backend == "KVFABRIC":
            # Through the decode node's agent: at least the prompt's KV (NIXL reads blocks).
            assert moved >= n * KV_PER_TOKEN, (n, moved)
        else:
            assert moved == 0, "the control must not touch kvfabric"


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompts_sharing_a_prefix_and_concurrent_requests(pd, backend):
    """The decode's prefix cache holds a shared prefix: only the rest is read, into the blocks
    vLLM allocated; then eight requests at once."""
    base = prompt(2 * BLOCK_SIZE, 500)
    first = base + prompt(BLOCK_SIZE + 3, 501)
    second = base + prompt(2 * BLOCK_SIZE + 9, 502)
    got, own, hits = hand_over(pd, backend, first)
    assert got == own and hits == len(first), (backend, hits)
    got, own, hits = hand_over(pd, backend, second)
    assert got == own, backend
    assert hits == len(second) - 2 * BLOCK_SIZE, (backend, hits)

    prompts = [prompt(BLOCK_SIZE * (1 + i % 3) + i, 600 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: hand_over(pd, backend, p), prompts))
    for p, (got, own, _) in zip(prompts, results, strict=True):
        assert got == own, (backend, len(p))
