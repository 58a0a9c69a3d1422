"""vLLM V1 KV connector over kvfabric: ``kv_connector_module_path: "kvfabric.vllm"``."""

from .connector import KVFabricConnector

__all__ = ["KVFabricConnector"]
