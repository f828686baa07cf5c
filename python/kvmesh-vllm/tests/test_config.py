"""Unit tests of the connector's config parsing (no servers): what an operator types in
``kv_connector_extra_config`` either means what it says or stops the server with a clear error."""

from __future__ import annotations

import pytest

from kvmesh_vllm.settings import KNOWN_KEYS, load_mode, parse_bytes, peer_list, tp_replicas


@pytest.mark.parametrize("text, want", [
    ("4GiB", 4 << 30), ("4G", 4 << 30), ("4g", 4 << 30), ("512MiB", 512 << 20),
    ("512MB", 512 * 10**6), ("1e9", 10**9), (" 2 KiB ", 2048), ("64B", 64), (0, 0),
    (4096, 4096),
])
def test_sizes_parse_binary_and_decimal_units(text, want):
    assert parse_bytes(text, "cpu_bytes") == want


@pytest.mark.parametrize("text", ["lots", "4XB", "-1GiB", -5, "inf", "nan", True, ""])
def test_bad_sizes_are_refused_naming_the_key(text):
    with pytest.raises(ValueError, match="cpu_bytes"):
        parse_bytes(text, "cpu_bytes")


def test_peers_are_a_list_or_one_comma_separated_string():
    assert peer_list(["10.0.0.5:7100", "10.0.0.6"], "allowed_peers") == [
        "10.0.0.5:7100", "10.0.0.6"]
    assert peer_list("10.0.0.5:7100, 10.0.0.6", "allowed_peers") == [
        "10.0.0.5:7100", "10.0.0.6"]
    assert peer_list(None, "allowed_peers") == []
    with pytest.raises(ValueError, match="allowed_peers"):
        peer_list(["10.0.0.5", 7100], "allowed_peers")


def test_the_issue_s_keys_are_known():
    for key in ("p2p_port", "cpu_bytes", "allowed_peers", "events_endpoint"):
        assert key in KNOWN_KEYS


def test_load_mode_is_async_or_layerwise():
    assert load_mode("async") == "async"
    assert load_mode("layerwise") == "layerwise"
    for bad in ("layer", "", None, True):
        with pytest.raises(ValueError, match="load_mode"):
            load_mode(bad)


class _Model:
    def __init__(self, kv_heads: int, mla: bool = False):
        self.use_mla = mla
        self._kv_heads = kv_heads

    def get_total_num_kv_heads(self) -> int:
        return self._kv_heads


@pytest.mark.parametrize("kv_heads, mla, tp, want", [
    (8, False, 1, 1),   # no TP
    (8, False, 2, 1),   # GQA, 4 heads per rank: every rank its own shard
    (2, False, 2, 1),   # one head per rank
    (2, False, 4, 2),   # 2 heads over 4 ranks: ranks 0-1 and 2-3 hold the same head
    (1, False, 4, 4),   # one KV head: every rank holds it
    (1, True, 2, 2),    # MLA: one latent, identical on every rank
    (1, True, 8, 8),
])
def test_tp_ranks_with_identical_kv_are_one_shard(kv_heads, mla, tp, want):
    # What the connector assumes before vLLM's KV cache exists (it then takes vLLM's
    # kv_tp_replicas); the fingerprint and the ports a rank pulls from follow from it.
    assert tp_replicas(_Model(kv_heads, mla), tp) == want
