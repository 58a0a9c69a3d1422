"""vLLM's own ExampleConnector (KV through files), unchanged but for a log line with the time
its decode-side load finished, so vllm_transfer.py can time it as it times kvfabric."""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

log = logging.getLogger("vllm.kvfabric_bench")


class TimedExampleConnector(ExampleConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = [r for r in getattr(meta, "requests", []) if not r.is_store]
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        if loads:
            log.info(
                "example: loaded %d requests in %.2f ms (done at %.6f)",
                len(loads),
                (time.perf_counter() - t0) * 1e3,
                time.time(),
            )
