"""kvmesh-vllm: a vLLM KV connector that makes a vLLM server a member of the kvmesh mesh.

Load it with ``--kv-transfer-config '{"kv_connector": "KvmeshConnector",
"kv_connector_module_path": "kvmesh_vllm", "kv_role": "kv_both", ...}'`` (see docs/vllm.md).
``KvmeshConnector`` is imported lazily so the native module works without vLLM installed.
"""

from typing import Any

__all__ = ["KvmeshConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KvmeshConnector", "KvmeshConnectorMetadata"):
        from kvmesh_vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
