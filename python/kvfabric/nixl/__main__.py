"""``python -m kvfabric.nixl``: prints the plugin directory (for ``NIXL_PLUGIN_DIR``); exits 1
saying why when the installed NIXL is not one the plugin was built for, or the plugin is missing."""

import sys

from . import NixlMismatch, plugin_dir

try:
    print(plugin_dir())
except (NixlMismatch, FileNotFoundError) as e:
    print(f"kvfabric.nixl: {e}", file=sys.stderr)
    sys.exit(1)
