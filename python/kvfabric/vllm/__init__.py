"""vLLM V1 KV connector over kvfabric: ``kv_connector_module_path: "kvfabric.vllm"``."""

__all__ = ["KVFabricConnector"]


def __getattr__(name: str):
    # Imported on first use, so the worker side (kvfabric.vllm.worker) imports without vLLM.
    if name == "KVFabricConnector":
        from .connector import KVFabricConnector

        return KVFabricConnector
    raise AttributeError(name)
