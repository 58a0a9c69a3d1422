"""``KVFabricConnector``: vLLM V1's KV connector interface over kvfabric.

Loaded the standard way, no vLLM patch::

    kv_transfer_config={"kv_connector": "KVFabricConnector",
                        "kv_connector_module_path": "kvfabric.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"socket_dir": "/var/run/kvfabric"}}

Extra config: see settings.py and docs/vllm.md. This module translates vLLM's configuration into
the plain values the scheduler and worker sides take (``EngineInfo``, ``WorkerInfo``) and
refuses, at start, what the connector does not do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvfabric

from ..errors import Unsupported
from .layout import LayerSpec, kv_heads_of_rank
from .mailbox import Mailbox
from .metadata import KVFabricMetadata, WorkerSegments
from .scheduler import STATE, EngineInfo, Scheduler
from .settings import Settings
from .stats import KVFabricPromMetrics, KVFabricStats
from .worker import Worker, WorkerInfo

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _prefix(vllm_config: VllmConfig, settings: Settings) -> str:
    """What names the instance's segments: the engine id (vLLM appends ``_dp<rank>`` under
    data parallelism), or ``segment_prefix`` with the DP rank appended."""
    kv = vllm_config.kv_transfer_config
    if settings.segment_prefix is None:
        return str(kv.engine_id)
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        return f"{settings.segment_prefix}_dp{parallel.data_parallel_rank}"
    return settings.segment_prefix


def _groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[tuple[int, Any]]:
    """The transfer groups and their specs; Unsupported for what the connector cannot move."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise Unsupported(
            "KVFabricConnector does not move context-parallel KV caches "
            "(decode_context_parallel_size / prefill_context_parallel_size must be 1)"
        )
    out = []
    for g in kv_cache_config.transfer_group_ids:
        spec = kv_cache_config.kv_cache_groups[g].kv_cache_spec
        if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec | MambaSpec):
            raise Unsupported(
                f"KVFabricConnector does not move {type(spec).__name__} KV cache groups "
                "(chunked local attention): serve this model without the connector, or with "
                "NixlConnector"
            )
        out.append((g, spec))
    sizes = {spec.block_size for _, spec in out}
    if len(sizes) > 1:
        raise Unsupported(
            f"KVFabricConnector does not move KV cache groups of several block sizes "
            f"{sorted(sizes)} (attention and Mamba state in vLLM's 'none' Mamba cache mode)"
        )
    return out


def _window(spec: Any) -> int:
    """A group's window for the scheduler: the sliding window, 0 for full attention, STATE for
    a Mamba / linear-attention state."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return STATE
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0


def _dtype(spec: Any) -> str:
    dtypes = getattr(spec, "dtypes", None) or (spec.dtype,)
    return ",".join(str(d).removeprefix("torch.") for d in dtypes)


def _layer_views(vllm_config: VllmConfig) -> list[Any]:
    """Every tensor the model's layers hold as their KV cache. A Mamba layer holds views (its
    conv and SSM states) made from the buffer vLLM hands the connector: when that buffer's
    storage moves into kvfabric memory, these must move with it, or the model keeps reading
    and writing the old memory."""
    import torch

    out: list[Any] = []
    todo = [
        getattr(layer, "kv_cache", None)
        for layer in vllm_config.compilation_config.static_forward_context.values()
    ]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, list | tuple):
            todo.extend(x)
    return out


# Attention backends that pack each (block, head) of their [B, H, N, C] view for their kernel
# (vLLM's CPU attention stores K transposed, then V): rows are not tokens (layout.LayerSpec).
# The others split C at the head size, K then V per token.
_PACKED_BACKENDS = frozenset({"CPU_ATTN"})


def _packed(vllm_config: VllmConfig, layer: str) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    return any(
        b.get_name() in _PACKED_BACKENDS for b in get_current_attn_backends(vllm_config, [layer])
    )


class KVFabricConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over kvfabric (see the module docstring)."""

    # Blocks come from a peer instance: vLLM counts them as p2p prefix-cache hits.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        assert kv_cache_config is not None
        settings = Settings.of(vllm_config.kv_transfer_config.kv_connector_extra_config)
        groups = _groups(vllm_config, kv_cache_config)
        prefix = _prefix(vllm_config, settings)
        block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self._transfer_groups = tuple(g for g, _ in groups)
        self._scheduler: Scheduler | None = None
        self._worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            windows = tuple((g, _window(spec)) for g, spec in groups)
            info = EngineInfo(
                engine_id=str(vllm_config.kv_transfer_config.engine_id),
                prefix=prefix,
                block_size=block_size,
                tp_size=parallel.tensor_parallel_size,
                pp_size=parallel.pipeline_parallel_size,
                groups=windows,
                # A freed sliding-window block would hold a token the decode's recompute of
                # the last prompt token reads, and a state cannot be rewound to before it: the
                # prefill leaves that token to the decode.
                backoff=1 if any(w for _, w in windows) else 0,
            )
            client = kvfabric.Client(settings.socket_dir, timeout=settings.call_timeout_s)
            mailbox = Mailbox(client, f"{prefix}.mailbox", settings.max_held_requests, settings)
            self._scheduler = Scheduler(info, settings, mailbox)
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )
            from vllm.v1.kv_cache_interface import MambaSpec

            model = vllm_config.model_config
            rank, tp = get_tensor_model_parallel_rank(), parallel.tensor_parallel_size
            attention = any(not isinstance(spec, MambaSpec) for _, spec in groups)
            heads = (
                kv_heads_of_rank(model.get_total_num_kv_heads(), rank, tp, model.use_mla)
                if attention
                else None
            )
            layers = {
                name: LayerSpec(
                    i,
                    spec.block_size,
                    # A state has no heads to split: its blocks move whole, rank to rank.
                    None if isinstance(spec, MambaSpec) else heads,
                    _dtype(spec),
                    _packed(vllm_config, name),
                )
                for i, (g, spec) in enumerate(groups)
                for name in kv_cache_config.kv_cache_groups[g].layer_names
            }
            info = WorkerInfo(
                prefix=prefix,
                pp=get_pp_group().rank_in_group,
                tp_rank=rank,
                tp_size=tp,
                num_blocks=kv_cache_config.num_blocks,
                block_size=block_size,
                layers=layers,
            )
            self._worker = Worker(info, settings)

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, _layer_views(self._vllm_config))

    def get_handshake_metadata(self) -> WorkerSegments | None:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFabricMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Pulls finish before vLLM schedules the request (it waits in WAITING_FOR_REMOTE_KVS).
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Nothing to save: decode workers pull straight from this worker's KV cache.
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KVFabricStats | None:
        if self._worker is not None:
            return self._worker.get_stats()
        return self._scheduler.get_stats() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFabricStats | None:
        return KVFabricStats.from_dict(data) if data is not None else KVFabricStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVFabricPromMetrics:
        return KVFabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Head-major blocks (LBHNC, "HND") keep a head's tokens contiguous: reads between
        # instances of other TP sizes are then one range per head. MLA has no heads to split.
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return "LBHNC"

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ---------------------------------------------------------------------

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], WorkerSegments]
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.set_workers(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, WorkerSegments]) -> None:
        assert self._scheduler is not None
        self._scheduler.set_workers({(0, tp): m for tp, m in metadata.items()})

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.bind_null_block(gpu_block_pool.null_block.block_id)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A pull restores every transfer group, sliding-window ones included.
        return self._transfer_groups

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)
