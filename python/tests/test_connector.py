"""What the connector takes from vLLM's configuration, on vLLM's own spec classes: which KV cache
groups it moves and what it refuses at start (with the reason, never mid-request), and the
names an instance's segments get under data parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvfabric.errors import Unsupported  # noqa: E402
from kvfabric.vllm.connector import _groups, _prefix  # noqa: E402
from kvfabric.vllm.settings import Settings  # noqa: E402

FULL = FullAttentionSpec(32, num_kv_heads=2, head_size=32, dtype=torch.float32)
WINDOW = SlidingWindowSpec(32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
MAMBA = MambaSpec(32, shapes=((4, 8),), dtypes=(torch.float32,))
# vLLM's default Mamba cache mode ("none"): one state block as large as the longest request.
MAMBA_NONE = MambaSpec(8192, shapes=((4, 8),), dtypes=(torch.float32,))


def config(dp: int = 1, dp_rank: int = 0, dcp: int = 1, pcp: int = 1, engine: str = "e"):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine),
        parallel_config=SimpleNamespace(
            data_parallel_size=dp,
            data_parallel_rank=dp_rank,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
        ),
    )


def kv_config(*specs):
    groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups, transfer_group_ids=tuple(range(len(specs))))


def test_full_attention_sliding_window_and_state_groups_are_moved():
    got = _groups(config(), kv_config(FULL, WINDOW, MAMBA))
    assert [(g, type(s).__name__) for g, s in got] == [
        (0, "FullAttentionSpec"),
        (1, "SlidingWindowSpec"),
        (2, "MambaSpec"),
    ]
    assert [g for g, _ in _groups(config(), kv_config(MAMBA_NONE))] == [0]


@pytest.mark.parametrize(
    ("specs", "cfg", "says"),
    [
        ((FULL, MAMBA_NONE), config(), "several block sizes"),
        ((FULL,), config(dcp=2), "context-parallel"),
        ((FULL,), config(pcp=2), "context-parallel"),
    ],
)
def test_what_the_connector_does_not_move_is_refused_at_start(specs, cfg, says):
    with pytest.raises(Unsupported, match=says):
        _groups(cfg, kv_config(*specs))


def test_each_data_parallel_rank_names_its_own_segments():
    settings = Settings.of({"socket_dir": "/x"})
    # vLLM appends _dp<rank> to the engine id itself under data parallelism.
    assert _prefix(config(engine="e_dp1"), settings) == "e_dp1"
    named = Settings.of({"socket_dir": "/x", "segment_prefix": "llama"})
    assert _prefix(config(dp=2, dp_rank=1), named) == "llama_dp1"
    assert _prefix(config(), named) == "llama"
