"""The scheduler side of the connector: which requests pull blocks (decode), which hold theirs
for a peer to pull (prefill), and the ``kv_transfer_params`` between the two.

The request protocol is NixlConnector's, so P/D proxies written for it route kvfabric
deployments unchanged: a prefill request with ``{"do_remote_decode": true}`` finishes with
``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ... in its output params, and
a decode request given those pulls the blocks. kvfabric's own part is one entry, ``kvfabric``:
the prefill workers' segment names and keys, the mailbox slot and nonce that acknowledge the
pull, and the layout the decode side checks before reading.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from .metadata import Hold, KVFabricMetadata, Load, WorkerSegments

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvfabric")

# A pull must start this long before the lease ends (clock skew between nodes, the pull itself).
EXPIRY_MARGIN_S = 1.0


class Scheduler:
    def __init__(self, vllm_config: VllmConfig, settings: Any) -> None:
        self.settings = settings
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.workers: dict[int, WorkerSegments] = {}
        self.free_slots = list(range(settings.max_held_requests - 1, -1, -1))
        self.slot_of: dict[str, int] = {}
        self.loads: dict[str, Load] = {}
        self.holds: dict[str, Hold] = {}

    def set_workers(self, metadata: dict[int, WorkerSegments]) -> None:
        self.workers = dict(metadata)

    def _layout(self) -> list[list[int]] | None:
        w = self.workers.get(0)
        return [list(p) for p in w.layout] if w else None

    def _pullable(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The kvfabric entry of a decode request's params, when it is one this engine can read."""
        if not params or not params.get("do_remote_prefill"):
            return None
        fab = params.get("kvfabric")
        if not isinstance(fab, dict):
            return None
        if fab.get("layout") != self._layout() or len(fab.get("workers", ())) != self.tp_size:
            log.warning(
                "kvfabric: remote engine %s has another KV layout or TP size; recomputing",
                params.get("remote_engine_id"),
            )
            return None
        if time.time() > float(fab.get("expires_at", 0)) - EXPIRY_MARGIN_S:
            # The prefill frees the blocks when its lease ends; reading them later could read
            # another request's KV.
            log.warning(
                "kvfabric: the lease on request %s's blocks has ended; recomputing",
                params.get("remote_request_id"),
            )
            return None
        return fab

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self._pullable(request.kv_transfer_params) is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        fab = self._pullable(params)
        if fab is None:
            return
        local: list[int] = []
        remote: list[int] = []
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()[0]
            computed = (request.num_computed_tokens) // self.block_size
            first = computed
            total = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
            remote_ids = params.get("remote_block_ids") or [[]]
            remote_ids = remote_ids[0] if remote_ids and isinstance(remote_ids[0], list) else []
            total = min(total, len(ids), len(remote_ids))
            local = list(ids[first:total])
            remote = list(remote_ids[first:total])
        self.loads[request.request_id] = Load(
            remote=fab["workers"],
            slot=int(fab["slot"]),
            nonce=int(fab["nonce"], 16),
            local_block_ids=local,
            remote_block_ids=remote,
        )
        # One pull per request.
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        meta = KVFabricMetadata(loads=self.loads, holds=self.holds)
        self.loads, self.holds = {}, {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_sending or ():
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.free_slots.append(slot)

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # A decode request that never got to pull: acknowledge, so the prefill side frees
            # its blocks now rather than at the end of the lease.
            fab = self._pullable(params)
            if fab is not None:
                self.loads[request.request_id] = Load(
                    fab["workers"], int(fab["slot"]), int(fab["nonce"], 16), [], []
                )
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        # One KV cache group (a flat list), or one list per group (hybrid models).
        block_ids = list(block_ids)
        groups = (
            [block_ids]
            if all(isinstance(b, int) for b in block_ids)
            else [list(g) for g in block_ids]
        )
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ) or not any(groups):
            return False, None
        if len(self.workers) != self.tp_size:
            log.warning(
                "kvfabric: no worker segments known; request %s is not handed over",
                request.request_id,
            )
            return False, None
        if not self.free_slots:
            log.warning(
                "kvfabric: %d requests already hold blocks (max_held_requests); %s is not "
                "handed over",
                len(self.slot_of),
                request.request_id,
            )
            return False, None
        slot = self.free_slots.pop()
        nonce = secrets.randbits(63) | 1
        self.slot_of[request.request_id] = slot
        self.holds[request.request_id] = Hold(slot, nonce, self.settings.lease_s)
        workers = [
            {
                "kv": w.kv,
                "kv_key": f"{w.kv_key:016x}",
                "acks": w.acks,
                "acks_key": f"{w.acks_key:016x}",
            }
            for _, w in sorted(self.workers.items())
        ]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            # NixlConnector's side channel, which kvfabric does not use; routers copy them.
            "remote_host": self.settings.advertise_host,
            "remote_port": 0,
            "tp_size": self.tp_size,
            "remote_num_tokens": request.num_computed_tokens,
            "kvfabric": {
                "workers": workers,
                "slot": slot,
                "nonce": f"{nonce:016x}",
                "layout": self._layout(),
                "lease_s": self.settings.lease_s,
                # Wall clock: the decode side, another machine, stops trusting the blocks then.
                "expires_at": time.time() + self.settings.lease_s,
            },
        }
