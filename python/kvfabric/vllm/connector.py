"""``KVFabricConnector``: vLLM V1's KV connector interface over kvfabric.

Loaded the standard way, no vLLM patch::

    kv_transfer_config={"kv_connector": "KVFabricConnector",
                        "kv_connector_module_path": "kvfabric.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"socket_dir": "/var/run/kvfabric"}}

Extra config (all optional): ``socket_dir`` (else ``$KVFABRIC_SOCKET_DIR``, else
``/var/run/kvfabric``), ``lease_s`` (30: how long a prefill holds blocks nobody pulls),
``load_timeout_s`` (10: one pull), ``max_held_requests`` (1024), ``segment_prefix`` (the
engine id), ``advertise_host`` (echoed as ``remote_host`` for routers that expect one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .metadata import KVFabricMetadata, WorkerSegments
from .scheduler import Scheduler
from .settings import Settings
from .stats import KVFabricStats
from .worker import Worker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KVFabricConnector(KVConnectorBase_V1):
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
        settings = Settings.of(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self._scheduler: Scheduler | None = None
        self._worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = Scheduler(vllm_config, settings)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            assert kv_cache_config is not None
            self._worker = Worker(
                vllm_config, settings, kv_cache_config.num_blocks, get_tensor_model_parallel_rank()
            )

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def get_kv_connector_stats(self) -> KVFabricStats | None:
        return self._worker.get_stats() if self._worker else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFabricStats | None:
        return KVFabricStats.from_dict(data) if data is not None else KVFabricStats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side ---------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self._scheduler is not None
        self._scheduler.set_workers(metadata)

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
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)
