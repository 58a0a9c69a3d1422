"""NIXL (PyPI `nixl`) on kvfabric's backend plugin, `libplugin_KVFABRIC.so`: the same NIXL calls,
descriptors and process layout as the `nixl` driver (UCX), only the backend's name differs. Each
side's NIXL agent talks to its node's kvfabric agent (`KVFABRIC_SOCKET_DIR`), which the runner
starts for the path (`fabric.py`); `NIXL_PLUGIN_DIR` names the plugin's directory."""

from __future__ import annotations

from importlib import metadata

from . import nixl_driver

name = "nixl-kvfabric"


def version() -> str:
    return f"{metadata.version('nixl')}+KVFABRIC"


class Target(nixl_driver.Target):
    backend = "KVFABRIC"


class Initiator(nixl_driver.Initiator):
    backend = "KVFABRIC"
