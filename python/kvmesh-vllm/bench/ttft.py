"""TTFT with a P2P pull vs a recompute on vLLM's CPU build (issue 14's benchmark, first slice).

Builds a random-weight Llama (size from the flags), starts two vLLM servers with KvmeshConnector
(tests/test_e2e.py's Server), lets A compute a prefix of --prefix tokens, then on B measures the
time to the first token (max_tokens=1) of prefix + a fresh suffix: cold (B computes everything)
with the prefix in B's own CPU tier only (its GPU prefix cache reset, no source named), and with
remote_kv_source naming A (B pulls the prefix). Loopback only; servers killed at the end.

  PYTHONPATH=$PWD/target/kvmesh-vllm-py ~/.cache/kvmesh/venv-vllm/bin/python \
      python/kvmesh-vllm/bench/ttft.py --prefix 1984,8128,16320 --layers 8 --hidden 1536 --kv-heads 2
  (several prefixes share one pair of servers, measured in the order given; max_model_len
  follows the largest; --cpu-bytes sizes both CPU tiers)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import test_e2e as e2e  # noqa: E402
import tiny_model  # noqa: E402


def measure(a: "e2e.Server", b: "e2e.Server", n: int, args: argparse.Namespace) -> None:
    cold_t, reuse_t, pull_t, hops = [], [], [], []
    dur = "kvmesh_p2p_pull_duration_seconds_sum"
    for i in range(args.repeat):
        prefix = e2e.tokens(1000 + 100 * n + i, n)
        a.complete(prefix + e2e.tokens(2000 + i, 16))
        # cold: B computes everything (and keeps the prefix in its own CPU tier); reuse: the
        # same prefix again once B's GPU prefix cache forgot it, no source named (B's own tier);
        # pull: named source A.
        for label, params, out in (("cold", None, cold_t), ("reuse", None, reuse_t),
                                   ("pull", e2e.remote(a), pull_t)):
            prompt = prefix + e2e.tokens(3000 + 10 * i + len(out), 16)
            h0 = b.kvmesh_worker_metric(dur)
            t0 = time.time()
            e2e.post(f"http://127.0.0.1:{b.http}/v1/completions",
                     {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                      **({"kv_transfer_params": params} if params else {})})
            out.append(time.time() - t0)
            if params:
                # The transfer itself: peer -> B's worker (kvmesh_p2p_pull_duration_seconds).
                hops.append(b.kvmesh_worker_metric(dur) - h0)
            b.reset_prefix_cache()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"prefix {n} tokens, {args.layers} layers, hidden {args.hidden}, "
          f"{args.kv_heads or max(1, args.hidden // 128)} KV heads: "
          f"TTFT cold {med(cold_t):.3f}s, own-tier reuse {med(reuse_t):.3f}s, "
          f"pull {med(pull_t):.3f}s, ratio {med(pull_t) / med(cold_t):.3f} "
          f"(reuse {med(reuse_t) / med(cold_t):.3f}; median of {args.repeat}; "
          f"cold {['%.3f' % x for x in cold_t]}, reuse {['%.3f' % x for x in reuse_t]}, "
          f"pull {['%.3f' % x for x in pull_t]}; "
          f"peer->worker transfer {['%.3f' % x for x in hops]})",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default="1984", help="prefix tokens, comma-separated")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="KV heads of 64 (default hidden/128); fewer = less KV per FLOP (GQA)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu-bytes", default="1GiB", help="each server's CPU tier")
    args = ap.parse_args()
    prefixes = [int(p) for p in args.prefix.split(",") if p.strip()]
    need = max(prefixes) + 64
    if int(os.environ.get("KVMESH_VLLM_MAX_MODEL_LEN", "2048")) < need:
        os.environ["KVMESH_VLLM_MAX_MODEL_LEN"] = str(need)
    work = tempfile.mkdtemp(prefix="kvmesh-ttft-")
    heads, kv_heads = args.hidden // 64, args.kv_heads or max(1, args.hidden // 128)
    inter = args.hidden * 11 // 4
    model = tiny_model.build(os.path.join(work, "model"), layers=args.layers,
                             hidden=args.hidden, heads=heads, kv_heads=kv_heads,
                             intermediate=inter)
    # What decides pull vs recompute: KV bytes moved per token against compute per token
    # (~2 FLOP per parameter). Llama-3-8B: 128 KiB per token over 8.0 B parameters.
    kv_per_token = args.layers * 2 * kv_heads * 64 * 2
    params = 2 * tiny_model.VOCAB * args.hidden + args.layers * (
        args.hidden * (heads + 2 * kv_heads) * 64 + heads * 64 * args.hidden
        + 3 * args.hidden * inter)
    print(f"model: {args.layers} layers, hidden {args.hidden}, {heads} heads, {kv_heads} KV heads "
          f"of 64, {params / 1e6:.0f} M parameters, {kv_per_token} B of KV per token "
          f"({kv_per_token / params * 1e6:.1f} B per M parameters; Llama-3-8B 16.3)", flush=True)
    extra = {"cpu_bytes": args.cpu_bytes}
    a = e2e.Server("A", model, work, allowed_peers=["127.0.0.1"], extra_config=extra)
    b = e2e.Server("B", model, work, allowed_peers=["127.0.0.1"], extra_config=extra)
    try:
        deadline = time.time() + e2e.STARTUP_S
        a.wait_ready(deadline)
        b.wait_ready(deadline)
        for n in prefixes:
            measure(a, b, n, args)
    finally:
        a.kill()
        b.kill()
        shutil.rmtree(work, ignore_errors=True)  # the model: ~180 MB at 8 layers / hidden 1024


if __name__ == "__main__":
    main()
