"""TTFT with a P2P pull vs a recompute on vLLM's CPU build (issue 14's benchmark, first slice).

Builds a random-weight Llama (size from the flags), starts two vLLM servers with KvmeshConnector
(tests/test_e2e.py's Server), lets A compute a prefix of --prefix tokens, then on B measures the
time to the first token (max_tokens=1) of prefix + a fresh suffix: cold (B computes everything)
and with remote_kv_source naming A (B pulls the prefix). Loopback only; servers killed at the end.

  .venv-vllm/bin/python python/kvmesh-vllm/bench/ttft.py --prefix 1984 --layers 8 --hidden 1024
  (max_model_len follows --prefix)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1984)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    need = args.prefix + 64
    if int(os.environ.get("KVMESH_VLLM_MAX_MODEL_LEN", "2048")) < need:
        os.environ["KVMESH_VLLM_MAX_MODEL_LEN"] = str(need)
    work = tempfile.mkdtemp(prefix="kvmesh-ttft-")
    model = tiny_model.build(os.path.join(work, "model"), layers=args.layers,
                             hidden=args.hidden, heads=args.hidden // 64,
                             kv_heads=max(1, args.hidden // 128),
                             intermediate=args.hidden * 11 // 4)
    a = e2e.Server("A", model, work, allowed_peers=["127.0.0.1"])
    b = e2e.Server("B", model, work, allowed_peers=["127.0.0.1"])
    try:
        deadline = time.time() + e2e.STARTUP_S
        a.wait_ready(deadline)
        b.wait_ready(deadline)
        cold_t, pull_t = [], []
        for i in range(args.repeat):
            prefix = e2e.tokens(1000 + i, args.prefix)
            a.complete(prefix + e2e.tokens(2000 + i, 16))
            for label, params, out in (("cold", None, cold_t), ("pull", e2e.remote(a), pull_t)):
                prompt = prefix + e2e.tokens(3000 + 10 * i + len(out), 16)
                t0 = time.time()
                e2e.post(f"http://127.0.0.1:{b.http}/v1/completions",
                         {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                          **({"kv_transfer_params": params} if params else {})})
                out.append(time.time() - t0)
                b.reset_prefix_cache()
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        print(f"prefix {args.prefix} tokens, {args.layers} layers, hidden {args.hidden}: "
              f"TTFT cold {med(cold_t):.3f}s, pull {med(pull_t):.3f}s, "
              f"ratio {med(pull_t) / med(cold_t):.3f} (median of {args.repeat}; "
              f"cold {['%.3f' % x for x in cold_t]}, pull {['%.3f' % x for x in pull_t]})")
    finally:
        a.kill()
        b.kill()
        shutil.rmtree(work, ignore_errors=True)  # the model: ~180 MB at 8 layers / hidden 1024


if __name__ == "__main__":
    main()
