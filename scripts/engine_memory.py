#!/usr/bin/env python3
"""Engine RSS over time under sustained load (issue 37, "the engine memory question").

    cargo build --release -p kvmesh
    python3 scripts/engine_memory.py                        # default 1 GiB CPU tier, 240 s
    python3 scripts/engine_memory.py --cpu-tier 64MiB --seconds 600
    python3 scripts/engine_memory.py --heaptrack /tmp/engine.heaptrack   # heap profile too

Starts one `kvmesh engine` (sim backend, --time-scale 100, otherwise its defaults: 4,096 GPU
blocks, 32 KV bytes per token, so a block is 512 B and a 1 GiB CPU tier holds 2,097,152 of them)
and keeps it busy with a closed loop of completions whose prompts are all new text (byte
tokenizer: one character, one token), so every block computed is a new one and the CPU tier fills,
then evicts. Every --interval seconds it prints the engine's VmRSS next to the tier's block count
from /metrics. With --heaptrack the engine runs under heaptrack (its RSS then includes
heaptrack's own few MiB) and is killed with SIGKILL at the end, so the profile's "leaked" list is
its live heap then; read it with `heaptrack_print FILE.zst`.

Only the standard library: run it with any python3.
"""

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_pid(proc, heaptrack):
    """The engine's pid: the child itself, or under heaptrack the kvmesh process it started."""
    if not heaptrack:
        return proc.pid
    for _ in range(200):
        out = subprocess.run(["pgrep", "-f", "-n", "kvmesh engine"], capture_output=True, text=True)
        for pid in out.stdout.split():
            if int(pid) != proc.pid and os.path.exists(f"/proc/{pid}"):
                return int(pid)
        time.sleep(0.1)
    raise RuntimeError("engine process not found under heaptrack")


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return -1


def metric(text, name):
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    body = r.read().decode()
    c.close()
    return r.status, body


def worker(port, prompt_tokens, stop, counts, seed):
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    conn = None
    while not stop.is_set():
        prompt = "".join(rng.choices(letters, k=prompt_tokens))
        body = json.dumps({"model": "sim", "prompt": prompt, "max_tokens": 4})
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            counts["ok" if r.status == 200 else "err"] += 1
            if r.status == 429:
                time.sleep(0.05)
        except (OSError, http.client.HTTPException):
            counts["err"] += 1
            conn = None
            time.sleep(0.1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/kvmesh")
    ap.add_argument("--cpu-tier", default="1GiB")
    ap.add_argument("--seconds", type=int, default=240)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--heaptrack", help="run the engine under heaptrack, writing FILE(.zst)")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (repeatable)")
    args = ap.parse_args()

    port = free_port()
    cmd = [args.bin, "engine", "--port", str(port), "--time-scale", "100",
           "--cpu-offload-bytes", args.cpu_tier, *args.engine_arg]
    if args.heaptrack:
        if not shutil.which("heaptrack"):
            sys.exit("heaptrack not found (apt-get install heaptrack)")
        cmd = ["heaptrack", "-o", args.heaptrack, *cmd]
    log = open(f"/tmp/engine_memory_{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                sys.exit(f"engine did not start (log /tmp/engine_memory_{port}.log)")
            time.sleep(0.2)
        pid = engine_pid(proc, args.heaptrack)
        stop = threading.Event()
        counts = {"ok": 0, "err": 0}
        threads = [threading.Thread(target=worker, args=(port, args.prompt_tokens, stop, counts, i), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        start = time.time()
        print(f"# engine pid {pid}, CPU tier {args.cpu_tier}, {args.clients} clients x "
              f"{args.prompt_tokens}-token new prompts, --time-scale 100", flush=True)
        print("| s | RSS MiB | CPU-tier blocks | tier used MiB | evicted blocks | requests ok / failed |")
        print("|---|---|---|---|---|---|", flush=True)
        while True:
            elapsed = time.time() - start
            try:
                text = get(port, "/metrics")[1]
            except OSError:
                text = ""
            print(f"| {elapsed:.0f} | {rss_mib(pid)} | {metric(text, 'kvmesh_engine_cpu_blocks'):.0f} | "
                  f"{metric(text, 'kvmesh_engine_cpu_used_bytes') / 2**20:.0f} | "
                  f"{metric(text, 'kvmesh_engine_cpu_evicted_blocks'):.0f} | {counts['ok']} / {counts['err']} |",
                  flush=True)
            if elapsed >= args.seconds:
                break
            time.sleep(args.interval)
        stop.set()
        if args.heaptrack:
            # SIGKILL, so that what heaptrack reports as "leaked" is the engine's live heap at the
            # end of the run (a graceful exit would free it first); heaptrack then finishes its file.
            os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
