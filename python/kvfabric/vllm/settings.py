"""The connector's settings, from ``kv_connector_extra_config`` (see connector.py)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Settings:
    socket_dir: str
    lease_s: float = 30.0
    load_timeout_s: float = 10.0
    ack_timeout_s: float = 2.0
    call_timeout_s: float = 30.0
    check_interval_s: float = 1.0
    max_held_requests: int = 1024
    max_hold_s: float = 600.0
    segment_prefix: str | None = None
    advertise_host: str = ""

    @classmethod
    def of(cls, extra: dict[str, Any]) -> Settings:
        def num(key: str, default: float) -> float:
            v = float(extra.get(key, default))
            if not v > 0:
                raise ValueError(f"kv_connector_extra_config.{key}: {v!r} must be > 0")
            return v

        return cls(
            socket_dir=str(
                extra.get("socket_dir")
                or os.environ.get("KVFABRIC_SOCKET_DIR")
                or "/var/run/kvfabric"
            ),
            lease_s=num("lease_s", 30.0),
            load_timeout_s=num("load_timeout_s", 10.0),
            ack_timeout_s=num("ack_timeout_s", 2.0),
            call_timeout_s=num("call_timeout_s", 30.0),
            check_interval_s=num("check_interval_s", 1.0),
            max_held_requests=int(num("max_held_requests", 1024)),
            max_hold_s=num("max_hold_s", 600.0),
            segment_prefix=extra.get("segment_prefix"),
            advertise_host=str(extra.get("advertise_host") or socket.gethostname()),
        )
