"""kvfabric as a NIXL backend: where the ``KVFABRIC`` plugin is, for ``NIXL_PLUGIN_DIR``.

An engine that moves KV through NIXL (vLLM's NixlConnector, SGLang, Dynamo) switches to kvfabric
with ``NIXL_PLUGIN_DIR=$(python -m kvfabric.nixl)`` and ``backends: ["KVFABRIC"]``; the node's
agent socket directory comes from ``KVFABRIC_SOCKET_DIR`` (default ``/var/run/kvfabric``, where
the Helm chart mounts it). See docs/nixl.md.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

PLUGIN = "libplugin_KVFABRIC.so"
# NIXL releases whose plugin ABI (API version 1, the engine class's layout) the plugin was
# built for and tested against.
TESTED_NIXL = ("1.5",)


class NixlMismatch(RuntimeError):
    """The installed NIXL is not one the plugin was built for."""


def nixl_version() -> str | None:
    """The installed NIXL wheel's version (``nixl``, or a CUDA-specific build of it)."""
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def plugin_dir(check: bool = True) -> Path:
    """The directory holding ``libplugin_KVFABRIC.so``: ``$KVFABRIC_NIXL_PLUGIN_DIR`` when set,
    else this package's own copy. ``check``: refuse a NIXL release the plugin was not built for
    (NIXL loads any plugin of API version 1, and a changed engine layout would crash)."""
    if check:
        have = nixl_version()
        if have is not None and ".".join(have.split(".")[:2]) not in TESTED_NIXL:
            raise NixlMismatch(
                f"NIXL {have} is installed; the KVFABRIC plugin is built for NIXL "
                f"{', '.join(TESTED_NIXL)} (plugin API version 1)"
            )
    env = os.environ.get("KVFABRIC_NIXL_PLUGIN_DIR")
    where = Path(env) if env else Path(__file__).resolve().parent
    if not (where / PLUGIN).is_file():
        raise FileNotFoundError(
            f"no {PLUGIN} in {where}: install a kvfabric wheel built with the plugin, or set "
            "KVFABRIC_NIXL_PLUGIN_DIR"
        )
    return where
