"""P/D params as the connector reads them (kvmesh_vllm.pd): which leg, where to read, how much."""

from __future__ import annotations

import time

from kvmesh_vllm import pd


def decoder_params(**over: object) -> dict:
    p = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "10.0.0.1",
         "remote_port": 7100, "remote_request_id": "cmpl-1", "remote_block_ids": [5, 6, 7],
         "remote_num_tokens": 100, "remote_blocks_expiry_time": time.time() + 60}
    p.update(over)
    return p


def test_the_router_prefill_leg_reads_nothing_and_a_decode_leg_names_the_prefiller():
    # The router's prefill leg: do_remote_decode with null address fields.
    leg = pd.classify({"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_host": None, "remote_port": None, "remote_block_ids": None})
    assert leg == pd.Leg("prefill", None)
    assert pd.classify(None).kind == "none"
    assert pd.classify({"remote_kv_source": {}}).kind == "none"
    dec = pd.classify(decoder_params())
    assert dec.kind == "decode" and dec.read is not None
    assert (dec.read.host, dec.read.port, dec.read.request_id) == ("10.0.0.1", 7100, "cmpl-1")
    assert not dec.read.expired()
    # A bad port or a non-integer block id is no address at all.
    assert pd.classify(decoder_params(remote_port=70000)).read is None
    assert pd.classify(decoder_params(remote_block_ids=["x"])).read is None


def test_only_the_leading_run_equal_to_the_own_blocks_is_read():
    read = pd.remote_read(decoder_params(remote_block_ids=[5, 6, 7, 8], remote_num_tokens=90))
    assert read is not None
    assert pd.matched_blocks(read, [5, 6, 9, 8], 32) == 2
    # remote_num_tokens (90) covers two full blocks of 32 only.
    assert pd.matched_blocks(read, [5, 6, 7, 8], 32) == 2
    assert pd.matched_blocks(read, [1], 32) == 0
    assert pd.remote_read(decoder_params(remote_blocks_expiry_time=time.time() - 1)).expired()


def test_handoff_params_are_what_the_next_leg_classifies():
    out = pd.handoff_params(leg="prefill", host="127.0.0.1", port=7100, request_id="r",
                            block_ids=[1, 2], num_tokens=70, expiry=time.time() + 60)
    back = pd.classify(out)
    assert back.kind == "decode" and back.read is not None
    assert back.read.block_ids == [1, 2] and back.read.request_id == "r"
    history = pd.handoff_params(leg="decode", host="127.0.0.1", port=7101, request_id="d",
                                block_ids=[1, 2, 3], num_tokens=100, expiry=time.time() + 60)
    # Attached to the next turn's prefill leg, it is a prefill leg that reads history.
    nxt = pd.classify(history)
    assert nxt.kind == "prefill" and nxt.read is not None and nxt.read.port == 7101


def test_counters_render_as_prometheus_text():
    c = pd.PdCounters()
    c.read("decode", "found", 256)
    c.read("history", "expired")
    c.handoff("prefill")
    text = c.text()
    assert 'kvmesh_pd_reads_total{leg="decode",outcome="found"} 1' in text
    assert 'kvmesh_pd_read_tokens_total{leg="decode"} 256' in text
    assert 'kvmesh_pd_handoffs_total{role="prefill"} 1' in text
