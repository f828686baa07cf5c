"""The extra keys a ``BlockStored`` event carries for a tenant's or an adapter's blocks.

vLLM hashes a request's LoRA adapter into every block and its ``cache_salt`` into block 0 (later
blocks inherit it through the parent chain), and publishes them untagged, one entry per block:
the adapter name, then the salt in block 0, or ``None`` for a block with neither. The connector's
CPU-tier events must say the same, or a router that keys blocks by their tokens would file a
salted block 0 under the unsalted prompt and predict hits no tenant can have. Kept free of vLLM
imports so it is testable without a server.
"""

from __future__ import annotations


def event_extra_keys(lora_name: str | None, cache_salt: str | None,
                     block_index: int) -> tuple[str, ...] | None:
    """Block ``block_index``'s untagged extra keys (multimodal and prompt-embeds keys are not
    produced: the connector does not handle such requests' keys)."""
    keys: list[str] = []
    if lora_name is not None:
        keys.append(lora_name)
    if block_index == 0 and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None
