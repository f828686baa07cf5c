"""Unit tests of the connector's view of vLLM's KV cache groups (no servers): which blocks of
which group a load fills and a save keeps, against the block tables vLLM handed a debug
connector (docs/notes-vllm-models.md §3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmesh_vllm.groups import FULL, SLIDING, Group, GroupLayout

# Gemma 3 as vLLM groups it: sliding(64) x2, full, 2 layers each, 32-token blocks.
GEMMA3 = GroupLayout([
    Group(SLIDING, 64, ("l0", "l3")), Group(SLIDING, 64, ("l1", "l4")),
    Group(FULL, None, ("l2", "l5")),
], 32)


def spec(name: str, window: int | None = None) -> object:
    cls = type(name, (), {})
    obj = cls()
    obj.sliding_window = window
    return obj


def test_layout_is_read_from_vllm_s_groups_and_named_in_the_fingerprint():
    cfg = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec("SlidingWindowSpec", 128), layer_names=["a"]),
        SimpleNamespace(kv_cache_spec=spec("FullAttentionSpec"), layer_names=["b"]),
    ])
    layout = GroupLayout.from_kv_cache_config(cfg, 32)
    assert layout.hybrid and layout.primary == 1
    assert layout.signature() == "s128,f"
    assert layout.need(0) == 4  # gpt-oss: cdiv(127, 32)
    assert not GroupLayout.from_kv_cache_config(None, 32).hybrid


def test_a_state_space_hit_needs_the_state_at_its_last_block():
    # Qwen3-Next: three gated-delta-net groups and one full-attention group, 544-token blocks.
    cfg = SimpleNamespace(kv_cache_groups=[
        *[SimpleNamespace(kv_cache_spec=spec("MambaSpec"), layer_names=[f"m{i}"])
          for i in range(3)],
        SimpleNamespace(kv_cache_spec=spec("FullAttentionSpec"), layer_names=["b"]),
    ])
    layout = GroupLayout.from_kv_cache_config(cfg, 544)
    assert layout.signature() == "m,m,m,f" and layout.primary == 3
    # vLLM's tables for a fake hit of 2 blocks (notes §3): one state block per mamba group.
    where = layout.placements([7, 8].__getitem__, [[0, 1], [0, 2], [0, 3], [4, 5]], 0, 2)
    assert where.block_ids == [4, 5, 1, 2, 3] and where.positions == [0, 1, 1, 1, 1]
    assert layout.window_keys([7, 8].__getitem__, 2, 0) == [layout.key(8, g) for g in range(3)]


def test_kinds_it_cannot_move_are_refused_with_a_clear_error():
    cfg = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec("ChunkedLocalAttentionSpec"), layer_names=["c"]),
        SimpleNamespace(kv_cache_spec=spec("FullAttentionSpec"), layer_names=["b"]),
    ])
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        GroupLayout.from_kv_cache_config(cfg, 32)


def test_the_primary_group_keys_by_the_block_hash_and_others_do_not_collide():
    assert GEMMA3.key(12345, 2) == 12345
    keys = {GEMMA3.key(h, g) for h in range(1000) for g in range(3)}
    assert len(keys) == 3000


def test_a_load_fills_every_full_block_and_the_sliding_groups_last_window():
    # vLLM's tables for a fresh request with an external hit of 9 blocks (notes §3).
    tables = [[0, 0, 0, 0, 0, 0, 0, 1, 2], [0, 0, 0, 0, 0, 0, 0, 3, 4],
              [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    hashes = list(range(100, 109))
    where = GEMMA3.placements(hashes.__getitem__, tables, 0, 9)
    assert where.block_ids == [5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2, 3, 4]
    assert where.groups == [2] * 9 + [0, 0, 1, 1]
    assert where.positions == list(range(9)) + [7, 8, 7, 8]
    assert where.keys[:9] == hashes
    assert where.keys[9] == GEMMA3.key(107, 0)


def test_a_hit_after_a_local_one_loads_only_past_it():
    # Local hit of 9 blocks, external 6 (positions 9-14): the sliding window before block 15.
    tables = [[0] * 13 + [16, 15], [0] * 13 + [18, 17], list(range(5, 14)) + list(range(18, 24))]
    where = GEMMA3.placements(list(range(15)).__getitem__, tables, 9, 15)
    assert where.block_ids == list(range(18, 24)) + [16, 15, 18, 17]
    assert where.positions == list(range(9, 15)) + [13, 14, 13, 14]


def test_a_hit_needs_each_sliding_groups_window_before_its_end():
    hashes = list(range(200, 210))
    keys = GEMMA3.window_keys(hashes.__getitem__, 9, 0)
    assert keys == [GEMMA3.key(h, g) for g in (0, 1) for h in (207, 208)]
    # Below the local hit's end the request's own blocks provide the window.
    want = [GEMMA3.key(208, 0), GEMMA3.key(208, 1)]
    assert GEMMA3.window_keys(hashes.__getitem__, 9, 8) == want
