"""End to end: two real vLLM CPU servers with KvmeshConnector on loopback (issue 14).

A computes a prefix; B, told by ``kv_transfer_params.remote_kv_source`` that A holds it, pulls
the prefix's full blocks from A over the kvmesh P2P protocol and computes only the suffix. Also:
a peer outside ``allowed_peers``, a peer with another fingerprint, and a holder killed in the
middle of the pull (its producer capped with ``serve_bytes_per_sec`` so that the pull lasts
seconds) all end in a recompute that the client cannot tell apart (HTTP 200, same greedy output),
each counted by reason in ``kvmesh_p2p_pulls_total``. And with a kvmesh ``sim`` engine in the
same router config (another ``kv_group``), the router never asks either kind to pull the other's
blocks.

Needs the environment of ``scripts/setup-vllm.sh`` and ``kvmesh_vllm`` installed; run through
``scripts/test-vllm.sh``. Every process it starts is in its own session and killed at the end.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import tiny_model  # noqa: E402

BLOCK = 32
# The tiny model's block: 2 layers x (2 KV heads x 32 tokens x 2*64 values) x 2 bytes (bf16).
TINY_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2
STARTUP_S = float(os.environ.get("KVMESH_VLLM_STARTUP_S", "420"))
REQUEST_S = 120
# Greedy tokens must match exactly; the chosen tokens' logprobs within this (bf16 KV, and the
# pulled-prefix run computes the suffix against cached KV while the cold run computes the
# whole prompt in one pass: the same math in another order).
LOGPROB_TOL = 0.05
# The adapter A and B serve besides the base model.
LORA = "tiny-lora"


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports are picked below the kernel's ephemeral range: a port the kernel handed out with
# bind(0) can be taken again by any outgoing connection (vLLM's, ZMQ's) before the server
# binds it, which once failed a CI run with EADDRINUSE. Below the range only another
# listener can take it, and each pick is remembered so one test run never repeats one.
_PICKED: set[int] = set()
_PORT_RNG = random.Random(os.getpid())


def free_port() -> int:
    high = min(_ephemeral_low(), 32768) - 2
    low = 20000 if high > 21000 else 1024
    for _ in range(1000):
        port = _PORT_RNG.randrange(low, high)
        if port in _PICKED or port + 1 in _PICKED or not bindable(port):
            continue
        _PICKED.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free ports, all reserved."""
    while True:
        first = free_port()
        rest = range(first + 1, first + n)
        if all(p not in _PICKED and bindable(p) for p in rest):
            _PICKED.update(rest)
            return first


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Server:
    def __init__(self, name: str, model: str, workdir: str, allowed_peers: list[str],
                 extra_config: dict | None = None, tp: int = 1,
                 extra_args: list[str] | None = None):
        self.name = name
        self.tp = tp
        self.http = free_port()
        # TP rank r serves on p2p + r, and its worker's metrics are on metrics + 1 + r.
        self.p2p = free_port_run(tp)
        self.metrics = free_port_run(tp + 1)
        # ipc: vLLM's publisher binds it (a tcp://host:port endpoint would make it connect).
        self.events = f"ipc://{workdir}/{name}-events.sock"
        extra = {
            "p2p_port": self.p2p,
            "cpu_bytes": "256MiB",
            "allowed_peers": allowed_peers,
            "metrics_port": self.metrics,
            "timeout_ms": 3000,
            **(extra_config or {}),
        }
        ktc = {
            "kv_connector": "KvmeshConnector",
            "kv_connector_module_path": "kvmesh_vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        env = dict(os.environ)
        env.update(
            # GiB of vLLM's CPU KV cache; benchmarks of long prefixes raise it.
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            PYTHONHASHSEED="0",
            VLLM_SERVER_DEV_MODE="1",
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        cmd = [
            "nice", "-n", "10", sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(self.http), "--block-size", str(BLOCK), "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256_cbor", "--enforce-eager",
            "--max-model-len", os.environ.get("KVMESH_VLLM_MAX_MODEL_LEN", "2048"), "--max-num-seqs", "4", "--dtype", "bfloat16",
            "--enable-prompt-tokens-details", *(extra_args or []),
            "--kv-transfer-config", json.dumps(ktc), "--tensor-parallel-size", str(tp),
            "--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": self.events, "topic": "kv",
            }),
        ]
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            cwd=workdir,
        )

    def wait_ready(self, deadline: float) -> None:
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited: see {self.log_path}\n{self.errors()}\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise TimeoutError(f"{self.name} not ready: {self.tail()}")

    def tail(self, n: int = 30) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def errors(self, n: int = 15) -> str:
        """The log's last lines that name an error (the root cause is rarely in the tail)."""
        with open(self.log_path) as f:
            lines = [ln for ln in f if re.search(r"Error|error:|Exception|ERROR", ln)]
        return "".join(lines[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.log.close()

    def complete(self, prompt: list[int], params: dict | None = None, salt: str | None = None,
                 model: str = "tiny") -> dict:
        body: dict = {
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "logprobs": 1, "seed": 0,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        if salt is not None:
            body["cache_salt"] = salt
        return post(f"http://127.0.0.1:{self.http}/v1/completions", body)

    def vllm_metric(self, name: str, **labels: str) -> float:
        return metric(get(f"http://127.0.0.1:{self.http}/metrics"), name, **labels)

    def kvmesh_scheduler_metric(self, name: str, **labels: str) -> float:
        return metric(get(f"http://127.0.0.1:{self.metrics}/"), name, **labels)

    def kvmesh_worker_metric(self, name: str, rank: int = 0, **labels: str) -> float:
        """From TP rank ``rank``'s worker (its own P2P node and tier)."""
        return metric(get(f"http://127.0.0.1:{self.metrics + 1 + rank}/"), name, **labels)

    def reset_prefix_cache(self) -> None:
        post(f"http://127.0.0.1:{self.http}/reset_prefix_cache", None)


def post(url: str, body: dict | None) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
        assert r.status == 200, r.status
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def tokens(seed: int, n: int, vocab: int = tiny_model.VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def answer(r: dict) -> tuple[str, list[float]]:
    c = r["choices"][0]
    return c["text"], list(c["logprobs"]["token_logprobs"])


def assert_same_answer(got: dict, want: dict) -> None:
    (t1, lp1), (t2, lp2) = answer(got), answer(want)
    assert t1 == t2, f"greedy output differs: {t1!r} vs {t2!r}"
    worst = max(abs(a - b) for a, b in zip(lp1, lp2, strict=True))
    print(f"  same greedy output; largest logprob difference {worst:.2e}")
    assert worst <= LOGPROB_TOL, f"logprobs differ by {worst} > {LOGPROB_TOL}: {lp1} vs {lp2}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    work = tmp_path_factory.mktemp("kvmesh-vllm")
    model = tiny_model.build(str(work / "tiny-llama"))
    # Both serve a LoRA adapter (test_9: adapters are key spaces of their own).
    lora = models.lora_adapter(model, str(work / "tiny-lora"))
    lora_args = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={lora}"]
    # A loads pulled prefixes layer by layer (load_mode layerwise), B whole (the default).
    a = Server("A", model, str(work), allowed_peers=["127.0.0.1"],
               extra_config={"load_mode": "layerwise"}, extra_args=lora_args)
    # B's tier holds 12 blocks, so the tests that make it compute evict from it; its CPU-tier
    # events also go to a publisher of their own (events_endpoint).
    b = Server("B", model, str(work), allowed_peers=["127.0.0.1"], extra_config={
        "cpu_bytes": 12 * TINY_BLOCK_BYTES,
        "events_endpoint": f"ipc://{work}/B-cpu-events.sock", "events_topic": "kv-cpu",
    }, extra_args=lora_args)
    try:
        deadline = time.time() + STARTUP_S
        a.wait_ready(deadline)
        b.wait_ready(deadline)
        yield a, b
    finally:
        for s in (a, b):
            s.kill()


def remote(server: Server, host: str = "127.0.0.1", port: int | None = None) -> dict:
    return {
        "remote_kv_source": {
            "kv_request_id": f"t-{time.time_ns()}",
            "remote_host": host,
            "remote_port": server.p2p if port is None else port,
        }
    }


def test_1_pull_from_peer_equals_recompute(servers):
    a, b = servers
    prefix = tokens(1, 8 * BLOCK)  # 8 full blocks
    s1, s2 = tokens(2, 20), tokens(3, 20)
    a.complete(prefix + s1)  # A computes and keeps the prefix
    assert a.kvmesh_worker_metric("kvmesh_cpu_tier_blocks") >= 8

    # The cold reference, on B itself; then B forgets it (its GPU-tier prefix cache; B's own
    # kvmesh tier keeps the blocks, which is harmless: B pulls from A, not from itself).
    cold = b.complete(prefix + s2)
    b.reset_prefix_cache()

    hits0 = b.vllm_metric("vllm:external_prefix_cache_hits_total")
    by_source = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
    src0 = b.vllm_metric(by_source[0], **by_source[1])
    pulled0 = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in")
    served0 = a.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out")
    in_vllm0 = b.vllm_metric("kvmesh_p2p_blocks_total", direction="in")
    t0 = time.time()
    warm = b.complete(prefix + s2, remote(a))
    took = time.time() - t0

    hits = b.vllm_metric("vllm:external_prefix_cache_hits_total") - hits0
    src = b.vllm_metric(by_source[0], **by_source[1]) - src0
    pulled = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in") - pulled0
    served = a.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out") - served0
    print(f"\npull: {hits:.0f} external hit tokens, {pulled:.0f} blocks in on B, "
          f"{served:.0f} out of A, request {took:.2f}s")
    assert hits == 8 * BLOCK, f"external hits {hits}, want {8 * BLOCK}"
    assert src == 8 * BLOCK, f"prompt tokens from external_kv_transfer {src}"
    assert pulled == 8 and served == 8
    assert b.kvmesh_worker_metric("kvmesh_p2p_pulls_total", outcome="complete") >= 1
    # The same counters in vLLM's own /metrics (connector stats, at B's engine steps).
    deadline = time.time() + 10
    while (b.vllm_metric("kvmesh_p2p_blocks_total", direction="in") - in_vllm0 < 8
           and time.time() < deadline):
        time.sleep(0.2)
    assert b.vllm_metric("kvmesh_p2p_blocks_total", direction="in") - in_vllm0 == 8
    assert b.vllm_metric("kvmesh_p2p_pulls_total", outcome="complete") >= 1
    assert_same_answer(warm, cold)


def test_2_cpu_tier_is_announced_with_kv_events(servers):
    """Blocks the connector keeps are announced as BlockStored, medium CPU, in vLLM's own event
    stream (vLLM's format, the kvmesh router's input), with their tokens and parents."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    a, _ = servers
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 500)
    sub.connect(a.events)
    time.sleep(1.5)  # the subscription must reach the publisher before the events
    prompt = tokens(40, 3 * BLOCK) + tokens(41, 5)
    a.complete(prompt)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    cpu: list[BlockStored] = []
    deadline = time.time() + 15
    while time.time() < deadline and len(cpu) < 3:
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            continue
        batch = decoder.decode(frames[-1])
        cpu += [e for e in batch.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    sub.close(0)
    blocks = [list(e.token_ids) for e in cpu]
    want = [prompt[i * BLOCK:(i + 1) * BLOCK] for i in range(3)]
    assert blocks[:3] == want, f"CPU BlockStored token blocks {blocks}"
    assert cpu[1].parent_block_hash == cpu[0].block_hashes[0]


def kvmesh_bin() -> str | None:
    path = os.environ.get("KVMESH_BIN")
    if path:
        return path
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    for profile in ("release", "debug"):
        cand = os.path.join(root, "target", profile, "kvmesh")
        if os.access(cand, os.X_OK):
            return cand
    return None


def wait_healthy(port: int, proc: subprocess.Popen, log_path: str, limit_s: float = 60) -> None:
    """Until ``/health`` on ``port`` answers; the log's tail if the process dies or is late."""
    deadline = time.time() + limit_s
    while True:
        try:
            get(f"http://127.0.0.1:{port}/health")
            return
        except (urllib.error.URLError, OSError):
            if time.time() > deadline or proc.poll() is not None:
                with open(log_path) as f:
                    raise RuntimeError(f.read()[-3000:]) from None
            time.sleep(0.3)


class Child:
    """A process started in its own session (``proc``, logging to ``log``), killed with it."""

    proc: subprocess.Popen
    log: Any

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.log.close()


class SimEngine(Child):
    """A kvmesh ``sim`` engine (``kvmesh engine --backend sim``) serving the same model name and
    block size as the vLLM servers, hashing blocks the same way (sha256_cbor, same seed): the
    router sees it hold the very block hashes a vLLM server would, yet its KV bytes are of
    another layout and fingerprint."""

    def __init__(self, binary: str, workdir: str):
        self.http, self.p2p, self.events_port = free_port(), free_port(), free_port()
        self.events = f"tcp://127.0.0.1:{self.events_port}"
        self.log_path = os.path.join(workdir, "S.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONHASHSEED="0")
        self.proc = subprocess.Popen(
            [binary, "engine", "--backend", "sim", "--served-model-name", "tiny",
             "--port", str(self.http), "--block-size", str(BLOCK), "--num-gpu-blocks", "1024",
             "--time-scale", "100", "--p2p-port", str(self.p2p),
             "--p2p-allowed-peers", "127.0.0.1",
             "--kv-events-config", json.dumps({
                 "enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://*:{self.events_port}", "topic": "kv"})],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        wait_healthy(self.http, self.proc, self.log_path)

    def complete(self, prompt: list[int]) -> dict:
        return post(f"http://127.0.0.1:{self.http}/v1/completions",
                    {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})

    def metric(self, name: str, **labels: str) -> float:
        return metric(get(f"http://127.0.0.1:{self.http}/metrics"), name, **labels)


class Router(Child):
    """``kvmesh router`` on a free loopback port, killed by ``kill``."""

    def __init__(self, binary: str, config_text: str, workdir: str, name: str):
        config = os.path.join(workdir, f"{name}.yaml")
        with open(config, "w") as f:
            f.write(config_text)
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [binary, "router", "--config", config, "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_healthy(self.port, self.proc, self.log_path)

    def complete(self, prompt: list[int]) -> dict:
        return post(f"http://127.0.0.1:{self.port}/v1/completions",
                    {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})

    def decisions(self, last: int) -> list[dict]:
        return json.loads(get(f"http://127.0.0.1:{self.port}/debug/decisions?last={last}"))

    def holders(self, prompt: list[int]) -> dict:
        """The router's index for ``prompt``: per endpoint, its cached tokens by tier."""
        return post(f"http://127.0.0.1:{self.port}/debug/prefix", {"prompt": prompt})["endpoints"]


def test_2b_router_names_the_holder_and_the_other_pulls(servers, tmp_path):
    """`kvmesh router` with the `load-p2p` profile of configs/router-load-p2p.yaml (queue and
    KV-utilization scorers over vLLM's own /metrics, weighted random pick, P2P source
    producer) in front of both: it indexes A's CPU tier from A's KV events and, for a request
    it places on B, names A in remote_kv_source; B pulls."""
    binary = kvmesh_bin()
    if binary is None:
        pytest.skip("no kvmesh binary (set KVMESH_BIN or cargo build -p kvmesh)")
    a, b = servers
    model_dir = os.path.join(os.path.dirname(a.log_path), "tiny-llama")
    config_text = f"""
block_size: {BLOCK}
tokenizer: {model_dir}
metrics_scrape_interval: 500ms
endpoints:
  - name: A
    url: http://127.0.0.1:{a.http}
    kv_events: {{endpoint: "{a.events}", topic: kv}}
    p2p: "127.0.0.1:{a.p2p}"
  - name: B
    url: http://127.0.0.1:{b.http}
    kv_events: {{endpoint: "{b.events}", topic: kv}}
    p2p: "127.0.0.1:{b.p2p}"
plugins:
  - {{type: queue-scorer, name: queue}}
  - {{type: kv-cache-utilization-scorer, name: kv-util}}
  - {{type: weighted-random-picker, name: weighted-random}}
  - type: p2p-source-producer
    name: p2p
    parameters: {{minCachedTokenDelta: {2 * BLOCK}}}
schedulingProfiles:
  - name: load-p2p
    plugins:
      - {{pluginRef: queue, weight: 3}}
      - {{pluginRef: kv-util, weight: 2}}
      - {{pluginRef: weighted-random}}
      - {{pluginRef: p2p}}
"""
    router = Router(binary, config_text, str(tmp_path), "router")
    try:
        time.sleep(2)  # the router's event subscriptions settle
        prefix = tokens(50, 8 * BLOCK)
        a.complete(prefix + tokens(51, 10))  # A computes and announces the prefix (CPU tier)
        time.sleep(2)  # A's events reach the router
        pulls0 = b.kvmesh_worker_metric("kvmesh_p2p_pulls_total", outcome="complete")
        hits0 = b.vllm_metric("vllm:external_prefix_cache_hits_total")
        url = f"http://127.0.0.1:{router.port}/v1/completions"
        for i in range(12):  # weighted random over two idle servers: one of these lands on B
            body = {"model": "tiny", "prompt": prefix + tokens(60 + i, 10), "max_tokens": 4,
                    "temperature": 0}
            post(url, body)
            if b.kvmesh_worker_metric("kvmesh_p2p_pulls_total", outcome="complete") > pulls0:
                break
        decisions = json.dumps(router.decisions(8))
        pulls = b.kvmesh_worker_metric("kvmesh_p2p_pulls_total", outcome="complete") - pulls0
        hits = b.vllm_metric("vllm:external_prefix_cache_hits_total") - hits0
        print(f"\nrouter: B pulled {pulls:.0f} time(s), {hits:.0f} external hit tokens")
        assert pulls == 1, f"B never pulled; router decisions: {decisions[-3000:]}"
        assert hits == 8 * BLOCK
        named = [d for d in router.decisions(12) if d["endpoint"] == "B"
                 and (d.get("p2p") or {}).get("source_endpoint") == "A"]
        assert named, f"no decision placed on B named A: {decisions[-3000:]}"
    finally:
        router.kill()


def test_4a_peer_not_allowed_recomputes(servers):
    a, b = servers
    prompt = tokens(10, 4 * BLOCK) + tokens(11, 10)
    cold = a.complete(prompt)  # A holds it; B must not be allowed to ask 127.0.0.2
    n0 = b.kvmesh_scheduler_metric("kvmesh_p2p_pulls_total", reason="not_allowed")
    hits0 = b.vllm_metric("vllm:external_prefix_cache_hits_total")
    got = b.complete(prompt, remote(a, host="127.0.0.2"))
    assert b.kvmesh_scheduler_metric("kvmesh_p2p_pulls_total", reason="not_allowed") == n0 + 1
    assert b.vllm_metric("vllm:external_prefix_cache_hits_total") == hits0
    assert_same_answer(got, cold)


def test_4b_fingerprint_mismatch_recomputes(servers):
    from kvmesh_vllm import _native

    import vllm

    a, b = servers
    # A peer that speaks the protocol with another block size (16), all else as A's:
    # refused at the handshake, and the refusal names the field.
    odd = _native.Node(
        model_id="tiny", kv_dtype=f"bf16:vllm-cpu:auto:{vllm.__version__}", block_size=16,
        num_layers=2,
        num_kv_heads=2, head_dim=64, hash_algo="sha256_cbor",
        none_hash=_native.none_hash("sha256_cbor", "0"), cpu_bytes=1 << 20,
        listen_host="127.0.0.1", listen_port=0,
    )
    prompt = tokens(20, 4 * BLOCK) + tokens(21, 10)
    cold = a.complete(prompt)
    n0 = b.kvmesh_scheduler_metric("kvmesh_p2p_pulls_total", reason="fingerprint_mismatch")
    hits0 = b.vllm_metric("vllm:external_prefix_cache_hits_total")
    got = b.complete(prompt, remote(a, port=odd.port))
    assert (
        b.kvmesh_scheduler_metric("kvmesh_p2p_pulls_total", reason="fingerprint_mismatch")
        == n0 + 1
    )
    assert b.vllm_metric("vllm:external_prefix_cache_hits_total") == hits0
    with open(b.log_path) as f:
        log = f.read()
    assert "fingerprint_mismatch(block_size)" in log, "B's log does not name the field"
    assert_same_answer(got, cold)
    odd.shutdown()


def test_3_holder_killed_during_the_pull_recomputes(servers):
    """A holder H whose producer is capped at one block a second (``serve_bytes_per_sec``) is
    SIGKILLed while B's pull of its 8-block prefix is on the wire, after its first block left:
    B answers 200 with the recompute's output, the failed pull is counted by reason."""
    a, b = servers
    workdir = os.path.dirname(a.log_path)
    # One block a second: B's pull of 8 blocks would take 8 s; each block still arrives well
    # inside B's per-step timeout (3 s), so only the kill can end it early.
    h = Server("H", os.path.join(workdir, "tiny-llama"), workdir, allowed_peers=["127.0.0.1"],
               extra_config={"serve_bytes_per_sec": TINY_BLOCK_BYTES})
    try:
        h.wait_ready(time.time() + STARTUP_S)
        prompt = tokens(30, 8 * BLOCK) + tokens(31, 10)
        cold = h.complete(prompt)  # H computes the prefix and keeps it in its CPU tier
        held = h.kvmesh_worker_metric("kvmesh_cpu_tier_blocks")
        assert held >= 8
        assert h.kvmesh_worker_metric("kvmesh_cpu_tier_used_bytes") == held * TINY_BLOCK_BYTES

        reasons = ("peer_closed", "connect")
        n0 = {r: b.kvmesh_worker_metric("kvmesh_p2p_pulls_total", reason=r) for r in reasons}
        hits0 = b.vllm_metric("vllm:external_prefix_cache_hits_total")
        in0 = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in")
        a_n0 = a.kvmesh_worker_metric("kvmesh_p2p_pulls_total", reason="peer_closed")
        result: dict = {}

        def ask(server: Server, key: str) -> None:
            try:
                result[key] = server.complete(prompt, remote(h))
            except BaseException as e:  # noqa: BLE001 (reported by the main thread)
                result[f"{key} error"] = e

        t0 = time.time()
        # B pulls whole (async), A layer by layer (layerwise), both from H at once.
        askers = [threading.Thread(target=ask, args=(s, k), daemon=True)
                  for s, k in ((b, "got"), (a, "layerwise"))]
        for t in askers:
            t.start()
        # Both pulls are under way once H serves two fetches and has sent a block of B's (a
        # layer-major fetch counts its blocks when it ends).
        out, fetches, deadline = 0.0, 0.0, time.time() + 60
        while time.time() < deadline and all(t.is_alive() for t in askers):
            out = h.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out")
            fetches = h.kvmesh_worker_metric("kvmesh_p2p_fetches_served_total")
            if out >= 1 and fetches >= 2:
                break
            time.sleep(0.05)
        h.kill()
        killed_at = time.time() - t0
        assert 1 <= out < 8, f"H had sent {out} blocks when killed (want mid-pull)"
        assert fetches == 2
        for t in askers:
            t.join(REQUEST_S)
            assert not t.is_alive(), "B or A did not answer"
        for key in ("got error", "layerwise error"):
            if key in result:
                raise result[key]
        took = time.time() - t0

        n1 = {r: b.kvmesh_worker_metric("kvmesh_p2p_pulls_total", reason=r) for r in reasons}
        hits = b.vllm_metric("vllm:external_prefix_cache_hits_total") - hits0
        pulled = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in") - in0
        print(f"\nH killed {killed_at:.2f}s into the request, after {out:.0f} of 8 blocks left it; "
              f"B got {pulled:.0f} blocks ({hits:.0f} external hit tokens), pull counted as "
              f"{ {r: n1[r] - n0[r] for r in reasons} }, answered in {took:.2f}s")
        # A mid-stream death reads as `peer_closed` (`connect` only if it died before the dial).
        assert n1["peer_closed"] == n0["peer_closed"] + 1, (n0, n1)
        # vLLM counts external hits when it schedules the load (the lookup found all 8 blocks),
        # as for its own connectors; the blocks that never arrived went through the load-error
        # path and were recomputed.
        assert pulled < 8 and hits <= 8 * BLOCK
        with open(b.log_path) as f:
            assert "recomputing" in f.read(), "B's worker reported no load error to vLLM"
        assert_same_answer(result["got"], cold)
        # A's layer-wise load died mid-layer: its blocks went through the same load-error path
        # (vLLM dropped that step's output and recomputed), counted by reason.
        a_n1 = a.kvmesh_worker_metric("kvmesh_p2p_pulls_total", reason="peer_closed")
        assert a_n1 == a_n0 + 1, (a_n0, a_n1)
        with open(a.log_path) as f:
            log = f.read()
        assert "layer-wise load for" in log and "recomputing" in log, \
            "A's worker reported no layer-wise load error to vLLM"
        assert_same_answer(result["layerwise"], cold)
    finally:
        h.kill()


def test_5_vllm_and_kvmesh_engines_in_one_router_never_exchange_blocks(servers, tmp_path):
    """vLLM servers A, B and a kvmesh sim engine S behind one `kvmesh router`. S holds prefix P,
    A holds prefix Q, and the router indexes both (same block hashes: S hashes as vLLM does).
    Requests for P and Q placed round robin on all three are never told to pull across the
    boundary (the router says why) and nobody counts a fingerprint refusal, both when the
    config says nothing (the router groups endpoints by the fingerprint id each exports in
    `kvmesh_p2p_fingerprint_info`) and with explicit `kv_group`s. Control: a config that puts
    all three in one `kv_group` (overriding what they export) makes the router name S as the
    source for a vLLM server, which refuses it (`fingerprint_mismatch`) and recomputes (200)."""
    binary = kvmesh_bin()
    if binary is None:
        pytest.skip("no kvmesh binary (set KVMESH_BIN or cargo build -p kvmesh)")
    a, b = servers
    model_dir = os.path.join(os.path.dirname(a.log_path), "tiny-llama")
    s = SimEngine(binary, str(tmp_path))
    routers: list[Router] = []
    try:
        def config(groups: dict[str, str] | None) -> str:
            def group(name: str) -> str:
                return f", kv_group: {groups[name]}" if groups else ""
            return f"""
block_size: {BLOCK}
tokenizer: {model_dir}
metrics_scrape_interval: 300ms
endpoints:
  - {{name: A, url: "http://127.0.0.1:{a.http}", p2p: "127.0.0.1:{a.p2p}"{group("A")},
     kv_events: {{endpoint: "{a.events}", topic: kv}}}}
  - {{name: B, url: "http://127.0.0.1:{b.http}", p2p: "127.0.0.1:{b.p2p}"{group("B")},
     kv_events: {{endpoint: "{b.events}", topic: kv}}}}
  - {{name: S, url: "http://127.0.0.1:{s.http}", p2p: "127.0.0.1:{s.p2p}"{group("S")},
     kv_events: {{endpoint: "{s.events}", topic: kv}}}}
plugins:
  - {{type: round-robin-picker, name: rr}}
  - {{type: p2p-source-producer, name: p2p, parameters: {{minCachedTokenDelta: {2 * BLOCK}}}}}
schedulingProfiles:
  - {{name: load-p2p, plugins: [{{pluginRef: rr}}, {{pluginRef: p2p}}]}}
"""
        # All routers from the start: each indexes only what it hears announced.
        learned = Router(binary, config(None), str(tmp_path), "router-learned")
        routers.append(learned)
        grouped = Router(binary, config({"A": "vllm-tiny", "B": "vllm-tiny", "S": "kvmesh-sim"}),
                         str(tmp_path), "router-grouped")
        routers.append(grouped)
        one_group = Router(binary, config({"A": "mesh", "B": "mesh", "S": "mesh"}),
                           str(tmp_path), "router-one-group")
        routers.append(one_group)
        # The learned router has scraped every endpoint's fingerprint id.
        deadline = time.time() + 20
        while True:
            eps = json.loads(get(f"http://127.0.0.1:{learned.port}/debug/endpoints"))
            groups = {e["name"]: e.get("kv_group") for e in eps}
            if all(g and g.startswith("fingerprint:") for g in groups.values()):
                break
            assert time.time() < deadline, f"learned groups: {groups}"
            time.sleep(0.3)
        print(f"\nlearned groups: {groups}")
        assert groups["A"] == groups["B"] != groups["S"], groups
        time.sleep(2)  # event subscriptions settle
        # Token ids every endpoint accepts (the sim engine's vocabulary is bytes: 257 ids).
        def ids(seed: int, n: int) -> list[int]:
            return tokens(seed, n, vocab=256)

        def hold_apart(router: Router, seed: int) -> tuple[list[int], list[int]]:
            """S computes a fresh prefix P, A a fresh Q; until ``router`` indexes both."""
            p, q = ids(seed, 8 * BLOCK), ids(seed + 1, 8 * BLOCK)
            s.complete(p + ids(seed + 2, 10))
            a.complete(q + ids(seed + 3, 10))  # A's CPU tier announces it
            deadline = time.time() + 20
            while True:
                held_p, held_q = router.holders(p), router.holders(q)
                s_p = sum(v for v in held_p.get("S", {}).values() if isinstance(v, (int, float)))
                a_q = held_q.get("A", {}).get("cpu_tokens", 0)
                if s_p >= 8 * BLOCK and a_q >= 8 * BLOCK:
                    return p, q
                assert time.time() < deadline, f"router index: P {held_p}, Q {held_q}"
                time.sleep(0.3)

        def counts() -> dict:
            return {
                "A mismatch": a.kvmesh_scheduler_metric("kvmesh_p2p_pulls_total",
                                                        reason="fingerprint_mismatch"),
                "B mismatch": b.kvmesh_scheduler_metric("kvmesh_p2p_pulls_total",
                                                        reason="fingerprint_mismatch"),
                "S in": s.metric("kvmesh_p2p_blocks_total", direction="in"),
                "S out": s.metric("kvmesh_p2p_blocks_total", direction="out"),
                "S pull failures": s.metric("kvmesh_p2p_pulls_total", outcome="failed"),
            }

        kind = {"A": "vllm", "B": "vllm", "S": "sim"}
        for name, router, seeds in (("learned", learned, 80), ("grouped", grouped, 90)):
            # Fresh prefixes per router: the first round leaves copies everywhere.
            p, q = hold_apart(router, seeds + 120)
            before = counts()
            sent = 0
            for i in range(3):  # round robin over 3 endpoints: each gets P and Q at least once
                for prefix, seed in ((p, seeds + i), (q, seeds + 5 + i)):
                    r = router.complete(prefix + ids(seed, 10))
                    assert r["choices"][0]["text"] is not None
                    sent += 1
            decisions = router.decisions(sent)
            assert len(decisions) == sent
            refused_across = 0
            for d in decisions:
                src = (d.get("p2p") or {}).get("source_endpoint")
                skipped = (d.get("p2p") or {}).get("skipped")
                if src and not skipped:
                    assert kind[src] == kind[d["endpoint"]], f"{name}: pull named across: {d}"
                if "other groups" in ((d.get("p2p") or {}).get("why") or ""):
                    refused_across += 1
            placed = {e: sum(d["endpoint"] == e for d in decisions) for e in kind}
            after = counts()
            print(f"{name}: placed {placed}, {refused_across} decisions skipped a holder in "
                  f"another group; counters {before} -> {after}")
            # Non-vacuous: the router saw holders across the boundary and declined them.
            assert refused_across >= 2, json.dumps(decisions)[-3000:]
            assert after == before, f"{name}: blocks crossed or were refused: {before} -> {after}"
        learned.kill()
        grouped.kill()

        # Control: one group for all. The router names S for a request it places on A or B;
        # the vLLM server refuses S's blocks at the handshake and recomputes. A prefix only S
        # holds.
        p = ids(74, 8 * BLOCK)
        s.complete(p + ids(75, 10))
        deadline = time.time() + 20
        while sum(v for v in one_group.holders(p).get("S", {}).values()
                  if isinstance(v, (int, float))) < 8 * BLOCK:
            assert time.time() < deadline, "the one-group router never indexed S"
            time.sleep(0.3)
        before = counts()
        for i in range(3):
            r = one_group.complete(p + ids(100 + i, 10))
            assert r["choices"][0]["text"] is not None
        after = counts()
        decisions = one_group.decisions(3)
        named_s = [d for d in decisions if d["endpoint"] in ("A", "B")
                   and (d.get("p2p") or {}).get("source_endpoint") == "S"]
        refusals = (after["A mismatch"] - before["A mismatch"]
                    + after["B mismatch"] - before["B mismatch"])
        print(f"one group: {len(named_s)} vLLM placements told to pull from S, {refusals:.0f} "
              f"fingerprint refusals counted, all answered 200")
        assert named_s, json.dumps(decisions)[-3000:]
        assert refusals == len(named_s)
        assert after["S out"] == before["S out"]
    finally:
        for r in routers:
            r.kill()
        s.kill()

def test_6_own_cpu_tier_serves_what_the_gpu_cache_dropped(servers):
    """A request with no source named, whose prefix A's GPU prefix cache dropped but A's kvmesh
    tier still holds, loads it from that tier (external hits, no P2P), same answer."""
    a, _ = servers
    prompt = tokens(120, 8 * BLOCK) + tokens(121, 10)
    cold = a.complete(prompt)
    a.reset_prefix_cache()  # the GPU tier forgets; the connector's tier keeps the blocks
    hits0 = a.vllm_metric("vllm:external_prefix_cache_hits_total")
    pulls0 = a.kvmesh_worker_metric("kvmesh_p2p_pulls_total")
    got = a.complete(prompt)
    hits = a.vllm_metric("vllm:external_prefix_cache_hits_total") - hits0
    print(f"\nown tier: {hits:.0f} external hit tokens")
    assert hits == 8 * BLOCK, f"external hits {hits}, want {8 * BLOCK} from A's own tier"
    assert a.kvmesh_worker_metric("kvmesh_p2p_pulls_total") == pulls0, "nothing goes over P2P"
    assert_same_answer(got, cold)


def test_7_evictions_from_a_full_tier_are_announced_on_events_endpoint(servers):
    """B's tier holds 12 blocks: computing two 8-block prefixes evicts at least 4. The
    connector's own publisher (`events_endpoint`) announces the stores and the evictions
    (BlockRemoved, medium CPU), and the tier's bytes stay within its budget."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    _, b = servers
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-cpu")
    sub.setsockopt(zmq.RCVTIMEO, 500)
    sub.connect(f"ipc://{os.path.dirname(b.log_path)}/B-cpu-events.sock")
    time.sleep(1.5)  # the subscription must reach the publisher before the events
    first, second = tokens(130, 8 * BLOCK), tokens(131, 8 * BLOCK)
    b.complete(first + tokens(132, 5))
    b.complete(second + tokens(133, 5))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    stored, removed = 0, 0
    deadline = time.time() + 15
    while time.time() < deadline and (stored < 16 or removed < 4):
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            continue
        for e in decoder.decode(frames[-1]).events:
            assert getattr(e, "medium", "CPU") == "CPU", f"a GPU event on the CPU stream: {e}"
            if isinstance(e, BlockStored):
                stored += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                removed += len(e.block_hashes)
    sub.close(0)
    print(f"\nB's events_endpoint: {stored} blocks stored, {removed} removed")
    assert stored >= 16 and removed >= 4, (stored, removed)
    assert b.kvmesh_worker_metric("kvmesh_cpu_tier_used_bytes") <= 12 * TINY_BLOCK_BYTES
    assert b.kvmesh_worker_metric("kvmesh_cpu_tier_blocks") <= 12


def test_8_layerwise_pull_equals_recompute(servers):
    """A (load_mode layerwise) pulls B's prefix layer-major straight into its KV tensors while
    it computes the suffix: same greedy output and logprobs as A's own cold run."""
    a, b = servers
    prefix = tokens(140, 8 * BLOCK)
    s1, s2 = tokens(141, 20), tokens(142, 20)
    b.complete(prefix + s1)  # B computes and keeps the prefix
    cold = a.complete(prefix + s2)
    a.reset_prefix_cache()
    hits0 = a.vllm_metric("vllm:external_prefix_cache_hits_total")
    pulled0 = a.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in")
    served0 = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out")
    complete0 = a.kvmesh_worker_metric("kvmesh_p2p_pulls_total", outcome="complete")
    t0 = time.time()
    warm = a.complete(prefix + s2, remote(b))
    took = time.time() - t0
    hits = a.vllm_metric("vllm:external_prefix_cache_hits_total") - hits0
    pulled = a.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in") - pulled0
    served = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out") - served0
    print(f"\nlayer-wise pull: {hits:.0f} external hit tokens, {pulled:.0f} blocks in on A, "
          f"{served:.0f} out of B, request {took:.2f}s")
    assert hits == 8 * BLOCK, f"external hits {hits}, want {8 * BLOCK}"
    assert pulled == 8 and served == 8
    assert a.kvmesh_worker_metric("kvmesh_p2p_pulls_total", outcome="complete") == complete0 + 1
    with open(a.log_path) as f:
        assert "layer-wise load of 8 blocks" in f.read(), "A did not load layer by layer"
    assert_same_answer(warm, cold)


def test_9_tenants_and_adapters_never_share_blocks(servers, tmp_path):
    """``cache_salt`` tenants and LoRA adapters are key spaces of their own, as vLLM hashes
    them: through the connector (a pull naming a holder of another key space moves nothing; of
    the same one, the whole prefix) and in the router's index (its predicted cached tokens per
    key space equal what vLLM then reports)."""
    binary = kvmesh_bin()
    if binary is None:
        pytest.skip("no kvmesh binary (set KVMESH_BIN or cargo build -p kvmesh)")
    a, b = servers
    work = os.path.dirname(a.log_path)
    config_text = f"""
block_size: {BLOCK}
tokenizer: {work}/tiny-llama
lora_adapters: [{{name: {LORA}, path: {work}/tiny-lora}}]
endpoints:
  - name: A
    url: http://127.0.0.1:{a.http}
    kv_events: {{endpoint: "{a.events}", topic: kv}}
"""
    router = Router(binary, config_text, str(tmp_path), "router-tenants")
    try:
        time.sleep(2)  # the router's event subscription settles
        prompt = tokens(70, 8 * BLOCK) + tokens(71, 10)
        spaces = {  # key space -> the request fields that select it
            "tenant-a": {"salt": "tenant-a"}, "tenant-b": {"salt": "tenant-b"},
            "unsalted": {}, "adapter": {"model": LORA},
            "adapter+tenant-a": {"model": LORA, "salt": "tenant-a"},
        }
        # Cold answers on B (a salt does not change the answer, an adapter does).
        ref = {"base": b.complete(prompt), "adapter": b.complete(prompt, model=LORA)}
        b.reset_prefix_cache()
        a.complete(prompt, **spaces["tenant-a"])
        a.complete(prompt, **spaces["adapter"])
        time.sleep(2)  # A's events reach the router

        def predicted(fields: dict) -> int:
            body = {"prompt": prompt, "model": fields.get("model", "tiny")}
            if "salt" in fields:
                body["cache_salt"] = fields["salt"]
            held = post(f"http://127.0.0.1:{router.port}/debug/prefix", body)["endpoints"]
            return int(held["A"]["any_tokens"])

        held = {name: 8 if name in ("tenant-a", "adapter") else 0 for name in spaces}
        for name, fields in spaces.items():
            want_ref = ref["adapter" if "model" in fields else "base"]
            in0 = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in")
            out0 = a.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out")
            hits0 = b.vllm_metric("vllm:external_prefix_cache_hits_total")
            got = b.complete(prompt, remote(a), **fields)
            b.reset_prefix_cache()
            pulled = b.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="in") - in0
            served = a.kvmesh_worker_metric("kvmesh_p2p_blocks_total", direction="out") - out0
            hits = b.vllm_metric("vllm:external_prefix_cache_hits_total") - hits0
            # The router's prediction for A, then what A itself reports for the same request.
            guess = predicted(fields)
            cached = a.complete(prompt, **fields)["usage"]["prompt_tokens_details"][
                "cached_tokens"]
            print(f"\n{name}: B pulled {pulled:.0f} blocks ({hits:.0f} external hit tokens), "
                  f"router predicts {guess} cached on A, A reports {cached}")
            assert pulled == served == held[name], f"{name}: pulled {pulled}, served {served}"
            assert hits == held[name] * BLOCK
            assert guess == cached == held[name] * BLOCK, f"{name}: {guess} vs {cached}"
            assert_same_answer(got, want_ref)
    finally:
        router.kill()
