"""The peers by name. Each driver module has `name`, `version()`, `Target(link)` and
`Initiator(link)`; it is imported only when asked for, so a peer whose package is missing or
broken fails alone."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import Kind, PeerError

NAMES = ("nixl", "mooncake", "dlslime", "nixl-kvfabric")
# Engines that need kvfabric agents on the path (the runner starts them).
ON_KVFABRIC = ("nixl-kvfabric",)


def load(name: str) -> ModuleType:
    if name not in NAMES:
        raise PeerError(Kind.CONFIG, "engine", f"{name!r} is not one of {', '.join(NAMES)}")
    return importlib.import_module(f".{name.replace('-', '_')}_driver", __package__)
