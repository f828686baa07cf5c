"""Hybrid KV cache groups (vLLM's HMA) through the connector, on real vLLM CPU servers (issue 36
part 1).

A random Gemma 3 (6 layers: sliding-window attention, window 64, on two of every three, full
attention on the third) keeps its sliding layers' KV for the last window only when vLLM's
hybrid KV cache manager is on, which it leaves on only for connectors that declare
``SupportsHMA``. vLLM groups the layers as sliding(64), sliding(64), full, 2 layers each; a
prefix hit needs every full-attention block plus each sliding group's 2 blocks before its end.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from test_e2e import (  # noqa: E402
    BLOCK,
    Server,
    assert_same_answer,
    remote,
    tokens,
)
from test_tp import (  # noqa: E402
    assert_router_predicts_vllm,
    external_hits,
    indexing_router,
    start,
)

HMA_OFF = "Turning off hybrid kv cache manager"


def moved(server: Server, direction: str) -> float:
    return server.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction=direction)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    work = tmp_path_factory.mktemp("kvmesh-vllm-hma")
    model = models.gemma3(str(work / "gemma3"))
    g = Server("G", model, str(work), allowed_peers=["127.0.0.1"])
    h = Server("H", model, str(work), allowed_peers=["127.0.0.1"])
    router = None
    try:
        start([g, h])
        router = indexing_router(g, model, str(work))
        yield g, h, router
    finally:
        for s in (g, h, router):
            if s is not None:
                s.kill()


def test_hma1_stays_on_and_a_pull_moves_every_group(gemma):
    g, h, router = gemma
    for s in (g, h):
        with open(s.log_path) as f:
            log = f.read()
        assert HMA_OFF not in log, f"{s.name}: vLLM turned its hybrid KV cache manager off"
        assert "3 group(s) (s64,s64,f)" in log, f"{s.name}: the connector saw no groups"

    prefix = tokens(141, 8 * BLOCK)
    s1, s2 = tokens(142, 20), tokens(143, 20)
    g.complete(prefix + s1)
    cold = h.complete(prefix + s2)
    h.reset_prefix_cache()
    out0, in0, hits0 = moved(g, "out"), moved(h, "in"), external_hits(h)
    warm = h.complete(prefix + s2, remote(g))
    served, pulled = moved(g, "out") - out0, moved(h, "in") - in0
    hits = external_hits(h) - hits0
    print(f"\nHMA pull: {served:.0f} blocks out of G, {pulled:.0f} into H, {hits:.0f} external "
          "hit tokens")
    # 8 full-attention blocks and, per sliding group, the 2 blocks of the window before block
    # 8: 12 group blocks, not 3 x 8.
    assert served == pulled == 8 + 2 * 2
    assert hits == 8 * BLOCK
    assert_same_answer(warm, cold)
    assert_router_predicts_vllm(router, g, prefix + s1)


def test_hma2_own_tier_serves_every_group(gemma):
    g, _, _ = gemma
    prompt = tokens(151, 8 * BLOCK) + tokens(152, 20)
    first = g.complete(prompt)
    g.reset_prefix_cache()
    hits0 = external_hits(g)
    again = g.complete(prompt)
    hits = external_hits(g) - hits0
    print(f"\nHMA own tier: {hits:.0f} external hit tokens")
    assert hits == 8 * BLOCK
    assert_same_answer(again, first)

