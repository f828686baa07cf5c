"""End to end: P/D disaggregation and bi-directional KV transfer on real vLLM CPU servers
(issue 36 part 5).

``kvmesh router`` with a ``pd:`` config in front of two vLLM servers with KvmeshConnector in one
``kv_group``: P (``role: prefill``) and D (``role: decode``), both with ``bidirectional_kv_xfer``.

Turn 1: the router's prefill leg runs on P, whose connector retains the prompt's full blocks in
its CPU tier and returns the decoder's params; the decode leg on D pulls them from P's producer
(under P's request id, which releases P's retention) and computes only the rest. Turn 2 of the
same conversation: the router hands D's returned params (prompt + output blocks, retained in D's
tier) to the next prefill leg, and P pulls that history from D. Each turn's answer (greedy
tokens and logprobs) equals a cold run of the same prompt on one server.

Needs what ``test_e2e.py`` needs (its helpers are imported from there); run through
``scripts/test-vllm.sh``.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tiny_model  # noqa: E402
from test_e2e import (  # noqa: E402
    BLOCK,
    STARTUP_S,
    Router,
    Server,
    assert_same_answer,
    kvmesh_bin,
    post,
    tokens,
)

# Turn 1's prompt: 8 full blocks and 30 tokens; 8 generated tokens then fill block 8 (the
# decoder computes tokens up to 286 + 7 = 293 > 9 blocks), which the prefiller never saw.
PROMPT_BLOCKS = 8
TAIL = 30
MAX_TOKENS = 8


def router_config(model_dir: str, p: Server, d: Server) -> str:
    return f"""
block_size: {BLOCK}
tokenizer: {model_dir}
metrics_scrape_interval: 500ms
endpoints:
  - {{name: P, role: prefill, kv_group: tiny, url: "http://127.0.0.1:{p.http}",
     p2p: "127.0.0.1:{p.p2p}", kv_events: {{endpoint: "{p.events}", topic: kv}}}}
  - {{name: D, role: decode, kv_group: tiny, url: "http://127.0.0.1:{d.http}",
     p2p: "127.0.0.1:{d.p2p}", kv_events: {{endpoint: "{d.events}", topic: kv}}}}
plugins:
  - {{type: queue-scorer, name: queue}}
  - {{type: max-score-picker, name: max}}
scheduling_profiles:
  - {{name: prefill, plugins: [{{plugin_ref: queue}}, {{plugin_ref: max}}]}}
  - {{name: decode, plugins: [{{plugin_ref: queue}}, {{plugin_ref: max}}]}}
pd:
  prefill_profile: prefill
  decode_profile: decode
  decider: always
  bidirectional: true
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    binary = kvmesh_bin()
    if binary is None:
        pytest.skip("no kvmesh binary (set KVMESH_BIN or cargo build -p kvmesh)")
    work = tmp_path_factory.mktemp("kvmesh-pd")
    model = tiny_model.build(str(work / "tiny-llama"))
    pd_config = {"bidirectional_kv_xfer": True}
    p = Server("P", model, str(work), allowed_peers=["127.0.0.1"], extra_config=pd_config)
    d = Server("D", model, str(work), allowed_peers=["127.0.0.1"], extra_config=pd_config)
    router = None
    try:
        deadline = time.time() + STARTUP_S
        p.wait_ready(deadline)
        d.wait_ready(deadline)
        router = Router(binary, router_config(model, p, d), str(work), "router-pd")
        yield p, d, router
    finally:
        if router is not None:
            router.kill()
        for s in (p, d):
            s.kill()


def body(prompt: list[int], **extra: object) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "seed": 0, "ignore_eos": True, "return_token_ids": True, **extra}


def cold(server: Server, prompt: list[int], salt: str) -> dict:
    """The whole prompt computed on one server: a salt of its own shares no block with any
    other request, so nothing is reused or pulled."""
    return post(f"http://127.0.0.1:{server.http}/v1/completions", body(prompt, cache_salt=salt))


class Counters:
    """P's and D's counters now, to compare with later."""

    def __init__(self, p: Server, d: Server):
        self.values = {
            "P_out": p.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out"),
            "P_in": p.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in"),
            "P_retained": p.kvmesh_worker_metric("kvmesh_cpu_tier_retained_blocks_total"),
            "P_handed": p.kvmesh_worker_metric("kvmesh_cpu_tier_handed_off_blocks_total"),
            "P_handoffs": p.kvmesh_scheduler_metric("kvmesh_pd_handoffs_total", role="prefill"),
            "P_history": p.kvmesh_scheduler_metric("kvmesh_pd_reads_total", leg="history",
                                                   outcome="found"),
            "P_hits": p.vllm_metric("vllm:external_prefix_cache_hits_total"),
            "D_out": d.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out"),
            "D_in": d.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in"),
            "D_pulls": d.kvmesh_worker_metric("kvmesh_p2p_pulls_total", outcome="complete"),
            "D_retained": d.kvmesh_worker_metric("kvmesh_cpu_tier_retained_blocks_total"),
            "D_handed": d.kvmesh_worker_metric("kvmesh_cpu_tier_handed_off_blocks_total"),
            "D_handoffs": d.kvmesh_scheduler_metric("kvmesh_pd_handoffs_total", role="decode"),
            "D_reads": d.kvmesh_scheduler_metric("kvmesh_pd_reads_total", leg="decode",
                                                 outcome="found"),
            "D_hits": d.vllm_metric("vllm:external_prefix_cache_hits_total"),
        }

    def grown(self, p: Server, d: Server) -> dict[str, float]:
        now = Counters(p, d).values
        return {k: now[k] - v for k, v in self.values.items()}


CONVERSATION: dict[str, list[int]] = {}


def test_1_decode_leg_pulls_the_prompt_from_the_prefiller(fleet):
    p, d, router = fleet
    prompt = tokens(500, PROMPT_BLOCKS * BLOCK + TAIL)
    want = cold(p, prompt, "reference-1")
    before = Counters(p, d)
    t0 = time.time()
    got = post(f"http://127.0.0.1:{router.port}/v1/completions",
               body(prompt, conversation_id="chat-1"))
    took = time.time() - t0
    g = before.grown(p, d)
    print(f"\nturn 1 through the router in {took:.2f}s: {g}")
    # The decoder pulled every full prompt block but the last token's from the prefiller...
    assert g["D_pulls"] == 1 and g["D_in"] == PROMPT_BLOCKS and g["P_out"] == PROMPT_BLOCKS
    assert g["D_reads"] == 1, "the decode leg's read is counted on the decoder"
    assert g["D_hits"] == PROMPT_BLOCKS * BLOCK, "vLLM counts them as external hits"
    # ... which the prefiller had retained for it, and the decoder's read released.
    assert g["P_handoffs"] == 1
    assert g["P_retained"] == PROMPT_BLOCKS and g["P_handed"] == PROMPT_BLOCKS
    # With bidirectional_kv_xfer the decoder retained prompt + output for the next turn: 9 full
    # blocks (286 prompt + 7 computed output tokens).
    assert g["D_handoffs"] == 1 and g["D_retained"] == PROMPT_BLOCKS + 1
    assert_same_answer(got, want)
    CONVERSATION["prompt"] = prompt
    CONVERSATION["output"] = list(got["choices"][0]["token_ids"])


def test_2_next_turn_prefill_pulls_the_history_from_the_decoder(fleet):
    p, d, router = fleet
    if "output" not in CONVERSATION:
        pytest.skip("turn 1 failed")
    prompt = CONVERSATION["prompt"] + CONVERSATION["output"] + tokens(501, 20)
    want = cold(d, prompt, "reference-2")
    # The prefiller forgets the conversation's blocks it computed (its vLLM prefix cache): all
    # of the history comes from the decoder's tier.
    p.reset_prefix_cache()
    history = PROMPT_BLOCKS + 1
    before = Counters(p, d)
    t0 = time.time()
    got = post(f"http://127.0.0.1:{router.port}/v1/completions",
               body(prompt, conversation_id="chat-1"))
    took = time.time() - t0
    g = before.grown(p, d)
    print(f"\nturn 2 through the router in {took:.2f}s: {g}")
    assert g["P_history"] == 1, "the prefill leg read the decoder's history"
    assert g["P_in"] == history and g["D_out"] == history
    assert g["P_hits"] == history * BLOCK, "vLLM on the prefiller counts external hits"
    # The read was the one D retained the blocks for: it released them.
    assert g["D_handed"] == history
    assert_same_answer(got, want)
