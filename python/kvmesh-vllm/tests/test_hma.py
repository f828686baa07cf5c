"""Hybrid KV cache groups (vLLM's HMA) through the connector, on real vLLM CPU servers (issue 36
part 1).

A random Gemma 3 (6 layers: sliding-window attention, window 64, on two of every three, full
attention on the third) keeps its sliding layers' KV for the last window only when vLLM's
hybrid KV cache manager is on, which it leaves on only for connectors that declare
``SupportsHMA``. vLLM groups the layers as sliding(64), sliding(64), full, 2 layers each; a
prefix hit needs every full-attention block plus each sliding group's 2 blocks before its end.

``KVMESH_HMA_MODEL=gpt_oss`` runs the same cases on a gpt-oss-shaped model instead (MoE,
attention sinks, window 128 on every other layer, unquantized bf16: groups sliding(128), full),
``KVMESH_HMA_MODEL=qwen3_next`` on a hybrid SSM (three gated-delta-net groups and one
full-attention group; vLLM raises its block size to 544 tokens so that pages match).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from test_e2e import (  # noqa: E402
    Server,
    assert_same_answer,
    remote,
    tokens,
)
from test_tp import (  # noqa: E402
    assert_router_predicts_vllm,
    block_size,
    external_hits,
    indexing_router,
    start,
)

HMA_OFF = "Turning off hybrid kv cache manager"
MODEL = os.environ.get("KVMESH_HMA_MODEL", "gemma3")


def group_layout(server: Server) -> list[str]:
    """The groups the connector saw, from its log: ``f`` full, ``s<window>`` sliding."""
    with open(server.log_path) as f:
        m = re.search(r"KV layers in \d+ group\(s\) \(([^)]*)\)", f.read())
    assert m, f"{server.name}: the connector logged no KV cache groups"
    return m.group(1).split(",")


def group_blocks(layout: list[str], hit: int, block: int) -> int:
    """Blocks a hit of ``hit`` blocks moves: all of each full-attention group's, a sliding
    group's cdiv(window - 1, block) before its end, a mamba group's state at its last one."""
    need = {"f": hit, "m": 1}
    return sum(need.get(g) or -(-(int(g[1:]) - 1) // block) for g in layout)


def prefix_blocks(server: Server) -> tuple[int, int]:
    """(block size, blocks of the test's shared prefix): 8 blocks, or 2 of a hybrid SSM's
    larger ones."""
    bs = block_size(server)
    return bs, 8 if bs <= 64 else 2


def moved(server: Server, direction: str) -> float:
    return server.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction=direction)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    work = tmp_path_factory.mktemp("kvmesh-vllm-hma")
    model = models.BUILDERS[MODEL](str(work / MODEL))
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
    layout = group_layout(g)
    assert len(layout) > 1 and "f" in layout, f"not a hybrid layout: {layout}"

    bs, n = prefix_blocks(g)
    prefix = tokens(141, n * bs)
    s1, s2 = tokens(142, 20), tokens(143, 20)
    g.complete(prefix + s1)
    cold = h.complete(prefix + s2)
    h.reset_prefix_cache()
    out0, in0, hits0 = moved(g, "out"), moved(h, "in"), external_hits(h)
    warm = h.complete(prefix + s2, remote(g))
    served, pulled = moved(g, "out") - out0, moved(h, "in") - in0
    hits = external_hits(h) - hits0
    print(f"\nHMA pull ({MODEL}, groups {layout}): {served:.0f} blocks out of G, "
          f"{pulled:.0f} into H, {hits:.0f} external hit tokens")
    # 8 full-attention blocks and, per sliding group, the window before block 8 (gemma3: 2 x 2
    # blocks, 12 in all where every layer's KV would be 24).
    assert served == pulled == group_blocks(layout, n, bs)
    assert hits == n * bs
    assert_same_answer(warm, cold)
    assert_router_predicts_vllm(router, g, prefix + s1)


def test_hma2_own_tier_serves_every_group(gemma):
    g, _, _ = gemma
    bs, n = prefix_blocks(g)
    prompt = tokens(151, n * bs) + tokens(152, 20)
    first = g.complete(prompt)
    g.reset_prefix_cache()
    hits0 = external_hits(g)
    again = g.complete(prompt)
    hits = external_hits(g) - hits0
    print(f"\nHMA own tier: {hits:.0f} external hit tokens")
    assert hits == n * bs
    assert_same_answer(again, first)

