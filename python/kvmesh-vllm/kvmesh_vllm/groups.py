"""vLLM's KV cache groups as the connector sees them (issue 36 part 1).

With its hybrid KV cache manager (HMA) vLLM splits a model's layers into groups: full-attention
groups keep every block of a prompt, sliding-window groups only the blocks of the last window.
A block id names one group's pages (the groups alias one allocation), so a block is stored per
``(hash, group)``: the tier key of the first full-attention group is the block's own event
hash, other groups' keys are derived from it. A prefix of ``k`` blocks is usable where vLLM
would count it cached: every full-attention block, plus each sliding group's blocks of the
window before block ``k`` (docs/notes-vllm-models.md §5). vLLM allocates exactly those (the rest
of a sliding group's list is the null block, id 0), so what a load fills, and what a save keeps,
is every non-null block id in range.

A state-space (mamba) group holds one block per boundary, the state after it: a hit of ``k``
blocks needs the state at block ``k - 1`` (vLLM allocates that one only). Plain data, no vLLM
import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_window"
MAMBA = "mamba"

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Group:
    kind: str
    window: int | None
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    """Blocks to move for one request: tier keys, vLLM block ids, their groups and their
    positions in the prompt, in order."""

    keys: list[int]
    block_ids: list[int]
    groups: list[int]
    positions: list[int]


class GroupLayout:
    def __init__(self, groups: list[Group], block_size: int):
        fulls = [i for i, g in enumerate(groups) if g.kind == FULL]
        if not fulls:
            raise ValueError("kvmesh connector: a model without a full-attention KV cache group "
                             "is not supported")
        self.groups = groups
        self.block_size = block_size
        self.primary = fulls[0]

    @classmethod
    def dense(cls, block_size: int) -> GroupLayout:
        """One full-attention group holding every layer (HMA off, or a dense model)."""
        return cls([Group(FULL, None, ())], block_size)

    @classmethod
    def from_kv_cache_config(cls, config: Any, block_size: int) -> GroupLayout:
        groups = getattr(config, "kv_cache_groups", None) if config is not None else None
        if not groups:
            return cls.dense(block_size)
        out = []
        for i, g in enumerate(groups):
            spec = g.kv_cache_spec
            # By class, base classes included (MLA's spec is a full-attention one).
            kinds = {c.__name__ for c in type(spec).__mro__}
            layers = tuple(g.layer_names)
            if "MambaSpec" in kinds:
                out.append(Group(MAMBA, None, layers))
            elif "SlidingWindowSpec" in kinds and getattr(spec, "sliding_window", None):
                out.append(Group(SLIDING, int(spec.sliding_window), layers))
            elif "FullAttentionSpec" in kinds:
                out.append(Group(FULL, None, layers))
            else:
                raise ValueError(f"kvmesh connector: KV cache group {i} is of a kind it cannot "
                                 f"move ({type(spec).__name__})")
        return cls(out, block_size)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def signature(self) -> str:
        """The group layout for the fingerprint: ``f`` full, ``s<window>`` sliding, ``m`` mamba,
        in order."""
        names = {FULL: "f", MAMBA: "m"}
        return ",".join(names.get(g.kind) or f"s{g.window}" for g in self.groups)

    def key(self, block_hash: int, group: int) -> int:
        """The tier key of ``group``'s pages of a block: the block's hash for the primary
        full-attention group (so dense and hybrid tiers key alike), a hash of both otherwise."""
        if group == self.primary:
            return block_hash
        x = (block_hash ^ ((group + 1) * 0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        return x ^ (x >> 31)

    def need(self, group: int) -> int:
        """Blocks of ``group`` a prefix hit needs before its end: vLLM's
        ``cdiv(window - 1, block_size)`` for a sliding group, the last block's state for a
        mamba group."""
        g = self.groups[group]
        if g.kind == MAMBA:
            return 1
        if g.kind != SLIDING or g.window is None:
            return 0
        return -(-(g.window - 1) // self.block_size)

    def placements(self, hash_at: Callable[[int], int], ids_by_group: list[list[int]], lo: int,
                   hi: int) -> Placement:
        """Every non-null block of positions ``lo … hi - 1`` (``hash_at(p)`` is position p's
        event hash, asked only for those positions) in every group, primary group first: what
        a load of that range fills and what a save of it keeps."""
        keys, ids, groups, positions = [], [], [], []
        order = [self.primary] + [g for g in range(len(self.groups)) if g != self.primary]
        for g in order:
            table = ids_by_group[g] if g < len(ids_by_group) else []
            for p in range(lo, min(hi, len(table))):
                if table[p] != 0:
                    keys.append(self.key(hash_at(p), g))
                    ids.append(table[p])
                    groups.append(g)
                    positions.append(p)
        return Placement(keys, ids, groups, positions)

    def window_keys(self, hash_at: Callable[[int], int], end: int, lo: int) -> list[int]:
        """The non-primary keys a hit ending before block ``end`` needs at positions ≥ ``lo``
        (below ``lo`` the request's own local hit provides them)."""
        keys = []
        for g, group in enumerate(self.groups):
            if g == self.primary:
                continue
            first = lo if group.kind == FULL else max(lo, end - self.need(g))
            keys.extend(self.key(hash_at(p), g) for p in range(first, end))
        return keys
