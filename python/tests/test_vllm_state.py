"""A model whose KV cache is a state, not tokens: a tiny Mamba2 served by real vLLM processes
(CPU build, vLLM's defaults), prefill and decode of other KV cache sizes. The decode takes the
prefill's state after all but the last prompt token (a state cannot be rewound, and the decode
computes the last prompt token itself) and decodes as it would itself, token for token."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from fabric import Agent  # noqa: E402
from tiny_llama import write_mamba2  # noqa: E402
from vllm_server import HITS, VllmServer, prefill, prompt, pulls, start, tokens, trail  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    model, other = write_mamba2(root / "mamba2", seed=0), write_mamba2(root / "other", seed=5)
    agent = Agent("agent-state")
    servers = {
        "p": VllmServer("mamba-p", model, root, "kv_producer", agent.socket_dir),
        "control": VllmServer("mamba-control", other, root, "kv_producer", agent.socket_dir),
        "d": VllmServer("mamba-d", model, root, "kv_consumer", agent.socket_dir, kv_bytes=32 << 20),
    }
    try:
        start(*servers.values())
        yield servers
    finally:
        for s in servers.values():
            s.stop()
        agent.kill()


def test_a_mamba_state_is_handed_over_and_decoded_as_the_decode_would(state):
    d = state["d"]
    for i, n in enumerate((7, 100, 333)):
        p = prompt(n, 9000 + i)
        want = tokens(d.complete(p, 12, cache_salt=f"own-{i}"))
        params = prefill(state["p"], p)
        assert params["remote_num_tokens"] == n - 1  # the last token is left to the decode
        before = d.metric(HITS)
        out = d.complete(p, 12, params)
        assert tokens(out) == want, n
        assert pulls(d, out) == 1 and d.metric(HITS) - before == n - 1, (n, trail(d, out))
        # Another model's state changes the output: the decode computes on what it pulled.
        params = prefill(state["control"], p)
        out = d.complete(p, 12, params)
        assert pulls(d, out) == 1 and tokens(out) != want, (n, trail(d, out))
