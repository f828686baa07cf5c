"""Crossover benchmark (not a test): time to first token of a prefix pulled whole (`load_mode
async`), pulled layer by layer (`load_mode layerwise`) and recomputed, on vLLM's CPU build with a
heavy-KV random model (``models.heavy_llama``: 128 KiB of KV per token, like Llama-3.1-8B).

Two servers with the connector: X loads layer by layer, Y whole. For each prefix size: X computes
a fresh prefix, then the same prefix with another suffix (the suffix alone: X holds the prefix);
Y pulls it (async; the pull alone is the worker's `kvmesh_p2p_pull_duration_seconds` for that
request); Y computes another fresh prefix cold (own recompute, timed) and X pulls that
(layer-wise). Each request asks for one token, so its latency is its TTFT. Issue 33's target:
layer-wise TTFT ≤ 1.1 × max(pull alone, suffix alone).

    bash scripts/test-vllm.sh --collect-only -q   # builds the connector into target/, once
    PYTHONPATH=$PWD/target/kvmesh-vllm-py ~/.cache/kvmesh/venv-vllm/bin/python \\
        python/kvmesh-vllm/tests/bench_crossover.py [TOKENS ...]

Takes several minutes (two vLLM starts) and several GB of memory; run it on an idle machine
(`flock /tmp/kvmesh-bench.lock ...`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import test_e2e  # noqa: E402
from test_e2e import BLOCK, Server, remote, tokens  # noqa: E402

KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


def timed(server: Server, prompt: list[int], params: dict | None = None) -> float:
    t0 = time.time()
    test_e2e.post(f"http://127.0.0.1:{server.http}/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        **({"kv_transfer_params": params} if params else {}),
    })
    return time.time() - t0


def pull_seconds(server: Server) -> tuple[float, float]:
    """The worker's pull-duration histogram: (sum of seconds, count)."""
    text = test_e2e.get(f"http://127.0.0.1:{server.metrics + 1}/metrics")
    return (test_e2e.metric(text, "kvmesh_p2p_pull_duration_seconds_sum"),
            test_e2e.metric(text, "kvmesh_p2p_pull_duration_seconds_count"))


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1024, 2048, 4096]
    longest = max(sizes)
    os.environ.setdefault("KVMESH_VLLM_MAX_MODEL_LEN", str(longest + 4 * BLOCK))
    # vLLM's KV cache and the tier each hold one prefix of the longest size with room to spare
    # (older ones are evicted; each step below needs only the newest): 16K tokens take ~13 GiB
    # over both servers.
    kv_gib = -(-5 * (longest + 64) * KV_BYTES_PER_TOKEN // (4 << 30))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kv_gib)))
    tier_mib = max(1024, 5 * longest * KV_BYTES_PER_TOKEN // (4 << 20))
    work = tempfile.mkdtemp(prefix="kvmesh-crossover-")
    model = models.heavy_llama(os.path.join(work, "heavy"))
    common = {"cpu_bytes": f"{tier_mib}MiB", "max_pull_ms": 120000, "timeout_ms": 30000}
    x = Server("X", model, work, ["127.0.0.1"], {**common, "load_mode": "layerwise"})
    y = Server("Y", model, work, ["127.0.0.1"], {**common, "load_mode": "async"})
    rows = []
    try:
        deadline = time.time() + 900
        x.wait_ready(deadline)
        y.wait_ready(deadline)
        # Warm both (first requests pay one-time costs).
        for s in (x, y):
            timed(s, tokens(1, 2 * BLOCK))
        for i, n in enumerate(sizes):
            suffix = tokens(1000 + i, 16)
            p1, p2 = tokens(2000 + i, n), tokens(3000 + i, n)
            timed(x, p1 + tokens(4000 + i, 16))  # X holds p1
            suffix_alone = timed(x, p1 + tokens(5000 + i, 16))
            before = pull_seconds(y)
            pull_async = timed(y, p1 + suffix, remote(x))
            after = pull_seconds(y)
            pull_alone = after[0] - before[0] if after[1] - before[1] == 1 else float("nan")
            recompute = timed(y, p2 + suffix)  # Y computes p2 cold: own recompute
            pull_layers = timed(x, p2 + suffix, remote(y))
            gb = n * KV_BYTES_PER_TOKEN / 1e9
            rows.append((n, gb, suffix_alone, pull_alone, pull_async, pull_layers, recompute))
            print(f"{n:6d} tokens ({gb:.2f} GB KV): suffix alone {suffix_alone:.2f}s, pull alone "
                  f"{pull_alone:.2f}s, async pull {pull_async:.2f}s, layer-wise pull "
                  f"{pull_layers:.2f}s, recompute {recompute:.2f}s", flush=True)
    finally:
        for s in (x, y):
            s.kill()
    # GB/s here is the prefix's KV over the whole TTFT (suffix compute included).
    print("\n| prefix tokens | KV GB | suffix alone | pull alone (GB/s) | TTFT async pull "
          "| TTFT layer-wise pull | TTFT recompute | layer-wise ÷ max(pull, suffix) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, gb, sa, pa, a, lw, r in rows:
        print(f"| {n} | {gb:.2f} | {sa:.2f} s | {pa:.2f} s ({gb / pa:.2f}) | {a:.2f} s "
              f"| {lw:.2f} s | {r:.2f} s | {lw / max(pa, sa):.2f} |")


if __name__ == "__main__":
    main()
