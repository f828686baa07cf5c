"""KvmeshConnector: vLLM's KV connector interface over kvmesh's P2P protocol (issue 14).

Serve: after each step the worker copies every newly computed full block (keyed by vLLM's own
block hash, as the kvmesh event-hash u64) into a bounded CPU tier held by Rust, which the kvmesh
P2P producer serves to peers on ``p2p_port``.

Reuse: a request with no source named whose next blocks this server's own CPU tier holds (its GPU
prefix cache dropped them) loads them from the tier, as an asynchronous load the worker serves at
once from memory (vLLM counts them as ``host`` hits).

Pull: a request whose ``kv_transfer_params`` carries ``remote_kv_source {kv_request_id,
remote_host, remote_port}`` makes the scheduler-side connector ask that peer which of the prefix
blocks it lacks the peer holds (a lookup: nothing moves; in the background, answering ``None``,
"ask again", meanwhile), then report that run as external hits with an asynchronous load. The
worker pulls those blocks straight from the peer and copies them into the block ids vLLM
allocated. Anything that did not arrive (evicted since the lookup, peer gone, checksum) is
reported through ``get_block_ids_with_load_errors`` so vLLM recomputes it.

With ``load_mode: layerwise`` a pull is instead a synchronous load that overlaps the step's
compute: the request is scheduled at once, ``start_load_kv`` starts a layer-major pull written
straight into vLLM's KV tensors (the peer sends every block's layer 0, then layer 1, ...), and
``wait_for_layer_load`` lets each layer's attention wait only for its own layer. A pull that fails
mid-stream reports the request's blocks through the same load-error path (vLLM drops the step's
output for that request and recomputes).

Saves go layer by layer: ``save_kv_layer`` copies each layer's part of the step's new full blocks
into a staging buffer as the layer finishes; ``wait_for_save`` only hands the staged blocks to the
CPU tier.

Hybrid models (vLLM's hybrid KV cache manager, ``SupportsHMA``): a block id names one KV cache
group's pages, so blocks are kept, served and pulled per ``(hash, group)``
(``kvmesh_vllm.groups``): every full-attention block, and a sliding-window group's blocks
while they are in the step that computed them (vLLM frees them once out of the window); a load
fills exactly the blocks vLLM allocated for the hit (its full-attention blocks and each sliding
group's last window). With several groups a load that misses anything fails the whole request
(``failed_recving``; vLLM refuses block-level failures there), which vLLM recomputes, and loads
are whole (no layer-wise mode). A state-space (mamba) group's block is the state after its
position: a hit loads the state at its last block.

Tensor parallel: every TP rank's worker keeps and serves its own shard of each block on
``p2p_port + rank`` (the shard is in its fingerprint) and pulls the same shard from the peer's
rank of the same number; vLLM counts a load done only when every rank's is, and any rank's
missing block is a load error, so a prefix is used only if every shard of it landed. Ranks whose
KV is identical (MLA's latent on every rank, or KV heads replicated over more ranks than heads)
form one shard: its first rank keeps and serves it once, the others keep no tier and read it
from that rank (theirs over loopback, a peer's from the peer's).

P/D disaggregation (``docs/vllm.md#pd-disaggregation``; the router's ``pd:`` route, the
dialect of vLLM's NIXL connector with block hashes as ``remote_block_ids``, ``kvmesh_vllm.pd``):

- Prefill leg (``kv_transfer_params.do_remote_decode``): the prompt's full blocks are saved as
  usual and *retained* in the worker's tier as they are saved (for ``decoder_kv_blocks_ttl``, or
  until the decoder's pull under this request's id releases them); ``request_finished`` frees
  vLLM's blocks at once and returns the decoder's params (``do_remote_prefill``, the blocks'
  event hashes, this server's producer address, ``remote_request_id``, expiry).
- Decode leg (``do_remote_prefill`` + address): a pull like ``remote_kv_source`` under
  ``remote_request_id``, of the leading run of ``remote_block_ids`` equal to the request's own
  block hashes; the last partial block is computed, and a failed pull is a recompute.
- Bi-directional (``bidirectional_kv_xfer``): a decode leg retains its prompt and output blocks
  and returns them (``do_remote_decode``) for the next turn's prefill leg, which, given them by
  the router, reads that history from the decoder's tier (expired params and reads shorter than
  ``kv_recompute_threshold`` are declined).

Counted as ``kvmesh_pd_*`` on the scheduler's metrics port, ``kvmesh_cpu_tier_retained_*`` and
``kvmesh_cpu_tier_handed_off_blocks_total`` (with the ``kvmesh_p2p_*`` counters) on the worker's.

Only the adaptation to vLLM lives here; the protocol, tier, checksums, pins, allow-list and
secret are the Rust crate ``kvmesh-py`` (``kvmesh_vllm._native``) over ``kvmesh-transfer``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmesh_vllm import pd
from kvmesh_vllm.extra_keys import event_extra_keys
from kvmesh_vllm.groups import SLIDING, GroupLayout
from kvmesh_vllm.settings import Settings
from kvmesh_vllm.stats import CounterDeltas, KvmeshPromMetrics, KvmeshStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so vLLM's logging configuration (handlers, level) applies.
logger = logging.getLogger("vllm.kvmesh")


def event_hash(block_hash: bytes) -> int:
    """kvmesh's BlockHash: the last 8 bytes of vLLM's digest, big-endian."""
    return int.from_bytes(bytes(block_hash)[-8:], "big")


@dataclass
class _Load:
    """Blocks to bring into ``block_ids`` (each of KV cache group ``groups[i]``, tier key
    ``hashes[i]``): from ``host:port`` (a pull), or from this server's own CPU tier when
    ``host`` is empty."""

    req_id: str
    hashes: list[int]
    block_ids: list[int]
    groups: list[int]
    host: str = ""
    port: int = 0
    kv_request_id: str = ""


@dataclass
class _Save:
    hashes: list[int]
    block_ids: list[int]
    groups: list[int]
    # A P/D hand-off's blocks: retained in the tier for the reader of this request id.
    retain_for: str = ""


@dataclass
class KvmeshConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass
class KvmeshWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: what the CPU tier stored and evicted this step (event hashes). With
    tensor parallel vLLM merges every rank's into one: ``stored`` keeps one list per rank that
    stored anything, because a block is held only once every shard's leader stored it."""

    stored: list[list[int]] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvmeshWorkerMetadata):
            self.stored.extend(other.stored)
            self.removed.extend(other.removed)
        return self


@dataclass
class _Tracked:
    """Scheduler-side state of one running request: its block ids per KV cache group."""

    request: Any
    block_ids: list[list[int]]
    saved: int = 0
    # A P/D leg whose blocks the worker retains as it saves them (see ``_retain_key``), and
    # when the first of them was asked (their retention ends a TTL after).
    retain_for: str = ""
    retained_at: float | None = None


def _hash_at(request: Any) -> Callable[[int], int]:
    """Position p's event hash of ``request``, computed when asked (a save or load reads only
    its own range, not the prompt's every block)."""
    return lambda p: event_hash(request.block_hashes[p])


def _kv_source(params: dict[str, Any]) -> tuple[str, int, str, int | None] | None:
    """llm-d's ``remote_kv_source {kv_request_id, remote_host, remote_port}`` as ``(host, port,
    kv_request_id, None)``; ``None`` when absent or malformed (logged)."""
    src = params.get("remote_kv_source")
    if not isinstance(src, dict):
        return None
    host, port = src.get("remote_host"), src.get("remote_port")
    try:
        port = int(port)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        logger.warning("kvmesh: malformed remote_kv_source %r: not pulling", src)
        return None
    if not isinstance(host, str) or not host:
        return None
    return host, port, str(src.get("kv_request_id") or ""), None


def _serve_metrics(port: int, texts: Any) -> None:
    """A Prometheus endpoint on ``port`` (loopback) serving ``texts()``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = texts().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as e:
        # The worker serves on metrics_port + 1: name both so the operator can pick a free pair.
        raise RuntimeError(
            f"kvmesh connector: cannot serve metrics on 127.0.0.1:{port} ({e}); "
            "metrics_port and metrics_port + 1 must both be free"
        ) from e
    threading.Thread(target=server.serve_forever, name="kvmesh-metrics", daemon=True).start()


def _layer_targets(
    layers: list[tuple[torch.Tensor, int]],
) -> list[tuple[int, int, int, list[tuple[int, int]]]] | None:
    """Per layer, where a layer-major pull writes a block: ``(data_ptr, bytes from it, block
    stride in bytes, [(offset, len) of each contiguous run of one block, in the order the tier
    stores a block])``; ``None`` when a layer is not in CPU memory or a block's bytes of it are
    not a few contiguous runs (the block dim first, or second behind a K/V dim)."""
    targets = []
    for kv, d in layers:
        if kv.device.type != "cpu":
            return None
        es = kv.element_size()
        per = kv.select(d, 0)
        nbytes = per.numel() * es
        if per.is_contiguous():
            chunks = [(0, nbytes)]
        elif d == 1 and all(per.select(0, i).is_contiguous() for i in range(per.shape[0])):
            part = nbytes // per.shape[0]
            chunks = [(i * kv.stride(0) * es, part) for i in range(per.shape[0])]
        else:
            return None
        span = kv.untyped_storage().nbytes() - kv.storage_offset() * es
        targets.append((kv.data_ptr(), span, kv.stride(d) * es, chunks))
    return targets


class KvmeshConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._s = Settings(vllm_config)
        self._block_size = self._s.block_size
        self._groups = GroupLayout.from_kv_cache_config(kv_cache_config, self._block_size)
        if self._groups.hybrid:
            # Servers exchange blocks only with the same group layout.
            self._s.set_group_layout(self._groups.signature())
            if self._s.load_mode == "layerwise":
                logger.warning("kvmesh: load_mode layerwise is not supported with several KV "
                               "cache groups (%s): pulls load whole", self._groups.signature())
                self._s.load_mode = "async"
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()
        self._deltas = CounterDeltas()

    # ------------------------------------------------------------------ vLLM's /metrics

    def get_kv_connector_stats(self) -> KvmeshStats | None:
        """What this process's P2P counters grew by since the last step (vLLM calls this every
        step in both processes and adds the two)."""
        grown = self._deltas.take(self._node.metrics_text())
        return KvmeshStats(data={"counters": grown}) if grown else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvmeshStats:
        return KvmeshStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvmeshPromMetrics:
        return KvmeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler side

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never a wrong answer.
        return False

    def _tp_replicas(self) -> int:
        """vLLM's count of TP ranks holding identical KV, when it has built the KV cache; the
        settings' own estimate from the model otherwise."""
        replicas = getattr(self._kv_cache_config, "kv_tp_replicas", None)
        if not isinstance(replicas, int) or replicas == self._s.tp_replicas:
            return self._s.tp_replicas
        logger.warning("kvmesh: vLLM holds KV identical across %d TP ranks, not %d as the model "
                       "suggested: using vLLM's (kvmesh_p2p_fingerprint_info may differ from "
                       "the P2P fingerprint)", replicas, self._s.tp_replicas)
        return replicas

    def _init_scheduler(self) -> None:
        s = self._s
        # The scheduler looks peers up on their rank 0 and speaks for rank 0's shard.
        s.set_tp_rank(0, self._tp_replicas())
        self._storing_ranks = s.tp_size // s.tp_replicas
        ktc = self._vllm_config.kv_transfer_config
        # vLLM's default policy fails a request whose load failed; a pull that did not arrive
        # must instead be recomputed (the client never sees it). The scheduler reads the policy
        # right after constructing its connector. `"load_failure_policy": "fail"` keeps vLLM's.
        policy = s.extra.get("load_failure_policy", "recompute")
        if ktc.kv_load_failure_policy != policy:
            logger.info("kvmesh: kv_load_failure_policy %s -> %s", ktc.kv_load_failure_policy,
                        policy)
            ktc.kv_load_failure_policy = policy
        # Looks peers up (no producer, no tier: the worker pulls and serves).
        self._node = s.node(
            listen_host=None, listen_port=0, cpu_bytes=0,
            allowed_peers=s.allowed_peers, allowed_consumers=None,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._lookup_start: dict[str, int] = {}
        # Per request: the peer named and, once the lookup ended, the run it holds
        # (first block index, blocks).
        self._sources: dict[str, tuple[str, int, str]] = {}
        self._found: dict[str, tuple[int, int]] = {}
        self._loads: list[_Load] = []
        # Requests whose load was handed to the worker (one load per request).
        self._loaded: set[str] = set()
        # KV events for the CPU tier, published by vLLM's own publisher (--kv-events-config):
        # saves asked of the worker, by event hash, until it reports them stored; then the
        # digest of each held block, until it reports the block evicted.
        # Both keyed by tier key (a block's hash, derived per group for the other groups).
        self._asked: dict[int, tuple[Any, ...]] = {}
        self._held: dict[int, tuple[bytes, int]] = {}
        # With TP: blocks some but not yet every shard leader reported stored -> how many did.
        self._stored_by: dict[int, int] = {}
        self._events: list[KVCacheEvent] = []
        self._publisher: ZmqEventPublisher | None = None
        if s.events_endpoint:
            dp_rank = getattr(self._vllm_config.parallel_config, "data_parallel_index", 0) or 0
            self._publisher = ZmqEventPublisher(
                data_parallel_rank=dp_rank, endpoint=s.events_endpoint,
                replay_endpoint=s.events_replay_endpoint, topic=s.events_topic,
            )
            logger.info("kvmesh: CPU-tier KV events also published on %s", s.events_endpoint)
        # Per request with external hits: where they come from (vLLM's prompt_tokens_by_source).
        self._hit_source: dict[str, CacheHitSource] = {}
        # P/D: each request's read, decided once (None: none); the reads whose lookup runs.
        self._pd = pd.PdCounters()
        self._pd_decided: dict[str, tuple[str, int, str, int | None] | None] = {}
        self._pd_reading: dict[str, str] = {}
        if s.metrics_port:
            _serve_metrics(s.metrics_port, lambda: self._node.metrics_text() + self._pd.text())
        logger.info("kvmesh connector (scheduler): fingerprint %s", self._node.fingerprint())

    def _want(self, request: "Request", num_computed_tokens: int) -> tuple[int, list[int]]:
        """The first block index to pull and the hashes after the local hit, never the block
        holding the last prompt token (vLLM always computes that token)."""
        start = num_computed_tokens // self._block_size
        last = (request.num_prompt_tokens - 1) // self._block_size
        hashes = [event_hash(h) for h in request.block_hashes[start:last]]
        return start, hashes

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._loaded:
            # Asked again after its load: that load failed with nothing usable (vLLM freed the
            # blocks and retries), so the request computes. Offering the same blocks again
            # would fail the same way, for ever (a peer rank that is refused, a block evicted
            # since the lookup).
            return 0, False
        params = request.kv_transfer_params or {}
        source = self._pd_source(request, params, num_computed_tokens) or _kv_source(params)
        if source is None:
            return self._local_hits(request, num_computed_tokens)
        host, port, kv_request_id, limit = source
        rid = request.request_id
        start, want = self._want(request, num_computed_tokens)
        if limit is not None:
            want = want[:max(0, limit - start)]
        if not want:
            leg = self._pd_reading.pop(rid, None)
            if leg is not None:  # this server's own prefix cache holds all the read offered
                self._pd.read(leg, "nothing_missing")
            return 0, False
        found = self._found.get(rid)
        if found is None:
            if self._node.is_pulling(rid) and not self._node.wait_pull(rid, self._s.poll_wait_ms):
                return None, False
            done = self._node.poll_pull(rid)
            if done is None:
                self._sources[rid] = (host, port, kv_request_id or rid)
                self._node.start_lookup(rid, host, port, kv_request_id or rid, want)
                self._lookup_start[rid] = start
                return None, False
            blocks, outcome, reason = done
            if reason is not None:
                log = logger.warning if outcome == "failed" else logger.info
                log("kvmesh: lookup of %d blocks on %s:%d for %s: %s, %d held (%s)",
                    len(want), host, port, rid, outcome, blocks, reason)
            leg = self._pd_reading.pop(rid, None)
            if leg is not None:
                self._pd.read(leg, "found" if blocks else f"not_found_{outcome}",
                              blocks * self._block_size)
            found = (self._lookup_start[rid], blocks)
            self._found[rid] = found
        # Asked again later (e.g. no room to allocate), the local hit may have grown: only the
        # found run past it is external; a local hit that shrank below the lookup's start has
        # an unknown gap, so nothing is.
        first, blocks = found
        k = first + blocks - start if start >= first else 0
        self._lookup_start[rid] = start
        n = max(0, k) * self._block_size
        if n > 0:
            self._hit_source[rid] = CacheHitSource.P2P
        # Layer-wise: a synchronous load, run inside the step that computes the suffix.
        return n, n > 0 and self._s.load_mode == "async"

    def _pd_source(self, request: "Request", params: dict[str, Any],
                   num_computed_tokens: int) -> tuple[str, int, str, int | None] | None:
        """The P/D read of this request, decided once: a decode leg reads the prompt from the
        prefiller; a prefill leg given a decoder's history (bi-directional) reads it from the
        decoder. ``(host, port, kv_request_id, blocks at most)`` or ``None`` (nothing to read,
        or declined: counted)."""
        rid = request.request_id
        if rid not in self._pd_decided:
            self._pd_decided[rid] = self._pd_decide(request, pd.classify(params),
                                                    num_computed_tokens)
        return self._pd_decided[rid]

    def _pd_decide(self, request: "Request", leg: pd.Leg,
                   num_computed_tokens: int) -> tuple[str, int, str, int | None] | None:
        if leg.kind == "none" or (leg.kind == "prefill" and leg.read is None):
            return None
        name = "decode" if leg.kind == "decode" else "history"
        read = leg.read
        if read is None:
            self._pd.read(name, "no_address")
            return None
        if name == "history" and not self._s.bidirectional:
            self._pd.read(name, "bidirectional_off")
            return None
        if read.expired():
            logger.info("kvmesh: declining expired remote read of %s from %s:%d",
                        request.request_id, read.host, read.port)
            self._pd.read(name, "expired")
            return None
        bs = self._block_size
        own = [event_hash(h) for h in request.block_hashes[:(request.num_prompt_tokens - 1) // bs]]
        n = pd.matched_blocks(read, own, bs)
        if n == 0:
            self._pd.read(name, "mismatch")
            return None
        # The decoder computes nothing it was handed; a short history is cheaper recomputed.
        threshold = self._s.kv_recompute_threshold if name == "history" else 0
        if n * bs - num_computed_tokens < threshold:
            self._pd.read(name, "below_threshold")
            return None
        self._pd_reading[request.request_id] = name
        return read.host, read.port, read.request_id, n

    def _local_hits(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """The run of the prompt's next blocks this server's CPU tier holds, as the worker last
        reported it (a block evicted since is a load error, recomputed)."""
        if not self._s.local_reuse:
            return 0, False
        start, want = self._want(request, num_computed_tokens)
        k = 0
        for h in want:
            if h not in self._held:
                break
            k += 1
        if self._groups.hybrid:
            # The hit must end where every sliding group holds its window too.
            def hash_at(p: int) -> int:
                return want[p - start]

            while k > 0 and any(key not in self._held
                                for key in self._groups.window_keys(hash_at, start + k, start)):
                k -= 1
        rid = request.request_id
        self._lookup_start[rid] = start
        if k == 0:
            self._hit_source.pop(rid, None)
            return 0, False
        self._hit_source[rid] = CacheHitSource.HOST
        return k * self._block_size, True

    def get_external_cache_hit_sources(
        self, request: "Request", num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if num_external_tokens <= 0:
            return {}
        return {self._hit_source.get(request.request_id, CacheHitSource.P2P): num_external_tokens}

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        rid = request.request_id
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        t = self._tracked.get(rid)
        if t is None:
            self._tracked[rid] = _Tracked(request=request, block_ids=block_ids,
                                          retain_for=self._retain_key(request))
        else:
            t.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        start = self._lookup_start.get(rid, 0)
        end = start + num_external_tokens // self._block_size
        # Every group's non-null blocks in the range: vLLM allocated a sliding group's window
        # before the hit's end only.
        where = self._groups.placements(_hash_at(request), block_ids, start, end)
        source = self._sources.get(rid)
        if source is not None:
            self._loads.append(_Load(rid, where.keys, where.block_ids, where.groups, *source))
            self._loaded.add(rid)
        elif self._hit_source.get(rid) == CacheHitSource.HOST:
            self._loads.append(_Load(rid, where.keys, where.block_ids, where.groups))
            self._loaded.add(rid)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvmeshConnectorMetadata(loads=self._loads)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = [list(ids) for ids in new.block_ids]
                self._add_save(meta, new.req_id, t, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    t.block_ids = [list(ids) for ids in new_ids]
                else:
                    for mine, more in zip(t.block_ids, new_ids, strict=False):
                        mine.extend(more)
            self._add_save(meta, rid, t, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _add_save(self, meta: KvmeshConnectorMetadata, rid: str, t: _Tracked,
                  num_computed: int, out: "SchedulerOutput") -> None:
        after = num_computed + out.num_scheduled_tokens.get(rid, 0)
        primary = t.block_ids[self._groups.primary] if t.block_ids else []
        full = min(after // self._block_size, len(t.request.block_hashes), len(primary))
        if full <= t.saved:
            return
        req = t.request
        # The tenant and adapter this request's blocks are hashed with, named in the CPU-tier
        # events as vLLM names them in its own (see kvmesh_vllm.extra_keys).
        lora = getattr(req, "lora_request", None)
        lora_key = (lora.lora_int_id, lora.lora_name) if lora is not None else (None, None)
        salt = getattr(req, "cache_salt", None)
        # Every group's blocks computed by now; a sliding group's out-of-window ones are
        # valid in this step only (vLLM frees them at the next), and this step saves them.
        where = self._groups.placements(_hash_at(req), t.block_ids, t.saved, full)
        for key, g, i in zip(where.keys, where.groups, where.positions, strict=True):
            if key in self._held:
                continue
            parent = bytes(req.block_hashes[i - 1]) if i > 0 else None
            tokens = list(req.all_token_ids[i * self._block_size:(i + 1) * self._block_size])
            extra = event_extra_keys(lora_key[1], salt, i)
            self._asked[key] = (bytes(req.block_hashes[i]), parent, tokens, lora_key, extra, g)
        meta.saves.append(_Save(where.keys, where.block_ids, where.groups, t.retain_for))
        if t.retain_for and t.retained_at is None:
            t.retained_at = time.time()
        t.saved = full

    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KvmeshWorkerMetadata):
            return
        before = len(self._events)
        for h in self._stored_everywhere(wm.stored):
            info = self._asked.pop(h, None)
            if info is None:
                continue
            digest, parent, tokens, (lora_id, lora_name), extra, g = info
            self._held[h] = (digest, g)
            self._events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(digest)],
                parent_block_hash=maybe_convert_block_hash(parent) if parent else None,
                token_ids=tokens, block_size=self._block_size, lora_id=lora_id,
                medium="CPU", lora_name=lora_name, extra_keys=[extra],
                **self._group_fields(g),
            ))
        # One BlockRemoved per group (vLLM's events name the group of a removal).
        removed: dict[int, list[bytes]] = {}
        for h in wm.removed:
            if h in self._held:
                digest, g = self._held.pop(h)
                removed.setdefault(g, []).append(digest)
        for g, digests in removed.items():
            self._events.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(d) for d in digests], medium="CPU",
                **({"group_idx": g} if self._groups.hybrid else {}),
            ))
        if self._publisher is not None and len(self._events) > before:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=self._events[before:]))
        if len(self._asked) > 65536:  # saves the worker never confirmed (e.g. no room)
            self._asked.clear()
            self._stored_by.clear()

    def _stored_everywhere(self, per_rank: list[list[int]]) -> list[int]:
        """The blocks that every shard's leader has now stored (with TP 1, or one shard: what
        the one storing rank stored). A block one leader could not keep is not announced: a
        pull of it would miss that shard."""
        if self._storing_ranks == 1:
            return [h for stored in per_rank for h in stored]
        done = []
        for stored in per_rank:
            for h in stored:
                n = self._stored_by.get(h, 0) + 1
                if n < self._storing_ranks:
                    self._stored_by[h] = n
                else:
                    self._stored_by.pop(h, None)
                    done.append(h)
        return done

    def _group_fields(self, g: int) -> dict[str, Any]:
        """A CPU-tier event's group, as vLLM's own events name it (none for a dense model, whose
        events never named one)."""
        if not self._groups.hybrid:
            return {}
        group = self._groups.groups[g]
        return {"group_idx": g, "kv_cache_spec_kind": group.kind,
                "kv_cache_spec_sliding_window": group.window if group.kind == SLIDING else None}

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        if events:
            logger.debug("kvmesh: %d CPU-tier KV events", len(events))
        return events

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call with HMA on (it replaces ``request_finished``): the blocks of every
        group were saved in the steps that computed them, so nothing is held back."""
        return self.request_finished(request, block_ids[self._groups.primary]
                                     if block_ids else [])

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        t = self._tracked.pop(rid, None)
        self._loaded.discard(rid)
        self._lookup_start.pop(rid, None)
        self._sources.pop(rid, None)
        self._found.pop(rid, None)
        self._hit_source.pop(rid, None)
        self._pd_decided.pop(rid, None)
        self._pd_reading.pop(rid, None)
        self._node.forget(rid)
        # The blocks stay in the worker's CPU tier (retained there as they were saved), not in
        # vLLM's: freeing vLLM's blocks at once is safe, the reader pulls from the tier.
        return False, self._handoff(request, t)

    def _retain_key(self, request: "Request") -> str:
        """The request id a P/D leg's blocks are retained for ("" for none): every prefill
        leg's prompt, and with ``bidirectional_kv_xfer`` a decode leg's prompt and output."""
        kind = pd.classify(request.kv_transfer_params).kind
        if kind == "prefill" or (kind == "decode" and self._s.bidirectional):
            return request.request_id
        return ""

    def _handoff(self, request: "Request", t: _Tracked | None) -> dict[str, Any] | None:
        """The params a finished P/D leg returns, naming the full blocks the worker retained:
        a prefill leg's prompt (for the decoder), or a decode leg's prompt and output (the
        history for the next turn's prefill)."""
        if t is None or not t.retain_for:
            return None
        if not self._s.p2p_port:
            logger.warning("kvmesh: P/D leg %s: p2p_port is 0 (picked at random by the worker), "
                           "so no peer can be told where to read; set it", request.request_id)
            return None
        prefill = pd.classify(request.kv_transfer_params).kind == "prefill"
        num_tokens = request.num_prompt_tokens if prefill else request.num_computed_tokens
        # Only blocks asked of the worker (hence saved and retained); none past the KV computed.
        n = min(num_tokens // self._block_size, t.saved, len(request.block_hashes))
        if n == 0:
            return None
        role = "prefill" if prefill else "decode"
        self._pd.handoff(role)
        return pd.handoff_params(
            leg=role, host=self._s.advertise_host, port=self._s.p2p_port,
            request_id=request.request_id,
            block_ids=[event_hash(h) for h in request.block_hashes[:n]], num_tokens=num_tokens,
            expiry=(t.retained_at or time.time()) + self._s.kv_blocks_ttl_s,
            tp_size=self._s.tp_size,
        )

    # ------------------------------------------------------------------ worker side

    def _init_worker(self) -> None:
        s = self._s
        rank = 0
        if s.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        s.set_tp_rank(rank, self._tp_replicas())
        # Only a shard's leader keeps a CPU tier and serves it (on p2p_port + rank): the other
        # ranks of its replica set (MLA's latent is the same on every rank) hold the same bytes,
        # so they keep none and read their leader's, over loopback, when reusing it.
        self._leads_shard = rank == s.shard_leader
        local = "127.0.0.1" if s.p2p_host in ("0.0.0.0", "::", "") else s.p2p_host
        self._leader_addr = (local, s.shard_port(s.p2p_port))
        allowed = s.allowed_peers
        if not self._leads_shard:
            allowed = [*allowed, f"{local}:{self._leader_addr[1]}"]
        # With KV identical on every TP rank, pulls from a peer are read by rank 0 alone and
        # handed to the others over the TP group's CPU (gloo) channel: (group, rank 0's rank).
        self._replica_group: tuple[Any, int] | None = None
        self._shared: dict[str, _Load] = {}
        if s.tp_size > 1 and s.tp_replicas == s.tp_size:
            from vllm.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
            self._replica_group = (tp.cpu_group, tp.ranks[0])
        self._node = s.node(
            listen_host=s.p2p_host if self._leads_shard else None,
            listen_port=s.p2p_port + rank, cpu_bytes=s.cpu_bytes if self._leads_shard else 0,
            allowed_peers=allowed, allowed_consumers=s.allowed_consumers,
            serve_bytes_per_sec=s.serve_bytes_per_sec,
        )
        self._layers: list[tuple[torch.Tensor, int]] = []
        self._layer_index: dict[str, int] = {}
        # Per layer: its bytes' offset and length inside a tier block.
        self._layer_bytes: list[tuple[int, int]] = []
        # Per layer, what a layer-major pull needs to write into its tensor (None: the layout
        # cannot be described, layer-wise loads then pull whole and copy).
        self._layer_targets: list[tuple[int, int, int, list[tuple[int, int]]]] | None = None
        self._block_bytes = 0
        self._loading: dict[str, _Load] = {}
        # Layer-wise loads of this step: request -> block ids; those whose pull failed.
        self._layer_loads: dict[str, list[int]] = {}
        self._layer_failed: set[str] = set()
        # This step's layer-by-layer save: (metadata it is for, hashes, block ids tensor,
        # staging buffer, layers copied).
        self._save_step: tuple[Any, ...] | None = None
        # Loads from this server's own tier, done in start_load_kv; reported at the next poll.
        self._loaded_locally: set[str] = set()
        self._load_errors: set[int] = set()
        # With several KV cache groups: requests whose load failed (reported whole).
        self._failed: set[str] = set()
        self._stored: list[int] = []
        if s.metrics_port:
            _serve_metrics(s.metrics_port + 1 + rank, self._node.metrics_text)
        if self._leads_shard:
            logger.info("kvmesh connector (worker, TP rank %d of %d): p2p producer on %s:%s%s",
                        rank, s.tp_size, s.p2p_host, self._node.port,
                        f", serving at most {s.serve_bytes_per_sec} B/s"
                        if s.serve_bytes_per_sec else "")
        else:
            logger.info("kvmesh connector (worker, TP rank %d of %d): KV identical to rank %d's, "
                        "which keeps and serves it", rank, s.tp_size, s.shard_leader)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        layers = []
        for name, kv in kv_caches.items():
            dim = 0
            if num_blocks is not None and kv.shape[0] != num_blocks and kv.shape[1] == num_blocks:
                dim = 1
            layers.append((kv, dim))
        self._layers = layers
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        # A block id names one group's pages: a tier block holds that group's layers only.
        group_of = {name: g for g, group in enumerate(self._groups.groups)
                    for name in group.layer_names}
        self._layer_group = [group_of.get(name, self._groups.primary) for name in kv_caches]
        self._group_layers = {g: [i for i, x in enumerate(self._layer_group) if x == g]
                              for g in set(self._layer_group)}
        self._layer_bytes = [(0, 0)] * len(layers)
        self._block_bytes = 0
        for members in self._group_layers.values():
            off = 0
            for i in members:
                kv, d = layers[i]
                nbytes = kv.select(d, 0).numel() * kv.element_size()
                self._layer_bytes[i] = (off, nbytes)
                off += nbytes
            self._block_bytes = max(self._block_bytes, off)
        self._layer_targets = None if self._groups.hybrid else _layer_targets(layers)
        if self._s.load_mode == "layerwise" and self._layer_targets is None:
            logger.warning("kvmesh: load_mode layerwise, but the KV tensors' layout cannot be "
                           "written block by block: pulls land whole, then are copied")
        kv0, d0 = layers[0]
        logger.info(
            "kvmesh: %d KV layers in %d group(s) (%s), layer shape %s (block dim %d, %s), "
            "%d bytes per block", len(layers), len(self._group_layers),
            self._groups.signature(), tuple(kv0.shape), d0, kv0.dtype, self._block_bytes,
        )

    def _by_group(self, groups: list[int]) -> list[tuple[int, torch.Tensor | None]]:
        """Per group present in ``groups``: the rows of it (``None``: every row)."""
        present = set(groups)
        if len(present) == 1:
            return [(groups[0], None)]
        return [(g, torch.tensor([i for i, x in enumerate(groups) if x == g], dtype=torch.long))
                for g in sorted(present)]

    def _gather(self, block_ids: list[int], groups: list[int]) -> torch.Tensor:
        """``(len(block_ids), block_bytes)`` uint8 on CPU: each block's group's layers, in
        order."""
        out = self._blocks_buffer(len(block_ids))
        for g, rows in self._by_group(groups):
            ids = block_ids if rows is None else [block_ids[i] for i in rows.tolist()]
            for layer in self._group_layers.get(g, []):
                kv, d = self._layers[layer]
                off, nbytes = self._layer_bytes[layer]
                idx = torch.tensor(ids, dtype=torch.long, device=kv.device)
                sel = kv.index_select(d, idx).movedim(d, 0).reshape(len(ids), -1)
                sel = sel.view(torch.uint8).cpu()  # no copy when already on the CPU
                if rows is None:
                    out[:, off:off + nbytes].copy_(sel)
                else:
                    out[rows, off:off + nbytes] = sel
        return out

    def _blocks_buffer(self, k: int) -> torch.Tensor:
        """``(k, block_bytes)`` uint8 on CPU, for Rust to fill with the GIL released."""
        return torch.empty((k, self._block_bytes), dtype=torch.uint8)

    def _scatter(self, buf: torch.Tensor, block_ids: list[int], groups: list[int]) -> None:
        """Copies ``buf``'s first ``len(block_ids)`` blocks into vLLM's blocks ``block_ids``
        (each of group ``groups[i]``: that group's layers)."""
        k = len(block_ids)
        for g, rows in self._by_group(groups[:k]):
            part = buf[:k] if rows is None else buf[rows]
            ids = block_ids if rows is None else [block_ids[i] for i in rows.tolist()]
            for layer in self._group_layers.get(g, []):
                kv, d = self._layers[layer]
                off, nbytes = self._layer_bytes[layer]
                per_block = kv.select(d, 0)
                # A strided view of this layer's bytes in every block (no copy on CPU):
                # index_copy_ reads it in place.
                src = part[:, off:off + nbytes].view(kv.dtype).unflatten(1, per_block.shape)
                src = src.to(kv.device).movedim(0, d)
                idx = torch.tensor(ids, dtype=torch.long, device=kv.device)
                kv.index_copy_(d, idx, src)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        for load in meta.loads:
            own_tier = not load.host
            if own_tier and self._leads_shard:
                self._load_locally(load)
                continue
            if own_tier:
                # This rank keeps no tier: its leader's holds the same bytes.
                load = _Load(load.req_id, load.hashes, load.block_ids, load.groups,
                             *self._leader_addr, load.req_id)
            else:
                load = _Load(load.req_id, load.hashes, load.block_ids, load.groups, load.host,
                             self._s.shard_port(load.port), load.kv_request_id)
            if self._s.load_mode == "layerwise":
                self._start_layerwise(load)
                continue
            if self._replica_group is not None and not own_tier:
                # A peer's copy, read once for the whole replica set (_finish_shared_loads).
                self._shared[load.req_id] = load
                if not self._leads_shard:
                    continue
            else:
                self._loading[load.req_id] = load
            self._node.start_pull(load.req_id, load.host, load.port, load.kv_request_id,
                                  load.hashes, self._block_bytes)

    def _start_layerwise(self, load: _Load) -> None:
        """A synchronous load: straight into the KV tensors, layer-major, waited for layer by
        layer in ``wait_for_layer_load`` and ended in ``get_block_ids_with_load_errors``."""
        if self._layer_targets is None:
            self._load_whole_now(load)
            return
        try:
            # The tensors in `_layer_targets` are `self._layers`, kept for the engine's life;
            # the blocks are this request's, allocated for this load (the pointer contract of
            # `start_layer_pull`). The pull ends before vLLM gets the blocks back.
            self._node.start_layer_pull(load.req_id, load.host, load.port, load.kv_request_id,
                                        load.hashes, self._layer_targets, load.block_ids)
        except Exception:  # a bug here must cost a recompute, never the request
            logger.exception("kvmesh: starting the layer-wise load of %s failed: recomputing",
                             load.req_id)
            self._fail(load.req_id, load.block_ids)
            return
        logger.info("kvmesh: layer-wise load of %d blocks for %s from %s:%d",
                    len(load.block_ids), load.req_id, load.host, load.port)
        self._layer_loads[load.req_id] = load.block_ids

    def _load_whole_now(self, load: _Load) -> None:
        """A synchronous load the tensors cannot take layer by layer: pull whole, then copy."""
        self._node.start_pull(load.req_id, load.host, load.port, load.kv_request_id,
                              load.hashes, self._block_bytes)
        self._node.wait_pull(load.req_id, self._s.max_pull_ms + self._s.timeout_ms)
        buf = self._blocks_buffer(len(load.block_ids))
        res = self._node.poll_pull(load.req_id, buf.numpy())
        blocks = res[0] if res is not None else 0
        if blocks:
            self._scatter(buf, load.block_ids[:blocks], load.groups)
        if blocks < len(load.block_ids):
            logger.warning("kvmesh: load for %s got %d of %d blocks (%s): recomputing",
                           load.req_id, blocks, len(load.block_ids),
                           res[2] if res is not None else "unfinished")
            self._fail(load.req_id, load.block_ids[blocks:])
            self._node.forget(load.req_id)

    def _load_locally(self, load: _Load) -> None:
        buf = self._blocks_buffer(len(load.block_ids))
        try:
            got = self._node.read_into(load.hashes, buf.numpy())
        except Exception:  # a bug here must cost a recompute, never the request
            logger.exception("kvmesh: reading %s from the CPU tier failed: recomputing",
                             load.req_id)
            got = 0
        if got:
            self._scatter(buf, load.block_ids[:got], load.groups)
        if got < len(load.block_ids):
            logger.info("kvmesh: %s: %d of %d blocks still in the CPU tier: recomputing the rest",
                        load.req_id, got, len(load.block_ids))
            self._fail(load.req_id, load.block_ids[got:])
        self._loaded_locally.add(load.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: wait for that layer of every layer-wise load
        of this step, bounded by the pull's own deadline. A failed pull is not waited for again;
        its blocks are reported as load errors when the step ends."""
        if not self._layer_loads:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        bound = self._s.max_pull_ms + self._s.timeout_ms
        for rid in self._layer_loads:
            if rid in self._layer_failed:
                continue
            state = self._node.wait_layer(rid, layer, bound)
            if state != "ready":
                logger.warning("kvmesh: layer-wise load for %s: layer %d %s: recomputing", rid,
                               layer, state)
                self._layer_failed.add(rid)

    def _end_layer_loads(self) -> None:
        """Ends this step's layer-wise pulls (none writes into the KV tensors afterwards) and
        reports what did not arrive whole as load errors."""
        for rid, block_ids in self._layer_loads.items():
            grace = 0 if rid in self._layer_failed else self._s.timeout_ms
            try:
                res = self._node.end_layer_pull(rid, grace)
            except Exception:  # a bug here must cost a recompute, never the request
                logger.exception("kvmesh: ending the layer-wise load of %s failed", rid)
                res = None
            blocks = res[0] if res is not None else 0
            if blocks < len(block_ids):
                logger.warning("kvmesh: layer-wise load for %s got %d of %d blocks (%s): "
                               "recomputing", rid, blocks, len(block_ids),
                               res[2] if res is not None else "unknown")
                self._fail(rid, block_ids[blocks:])
        self._layer_loads.clear()
        self._layer_failed.clear()

    def _save_plan(self) -> tuple[Any, list[int], dict[int, tuple[torch.Tensor | None,
                                                                  torch.Tensor]],
                                  torch.Tensor, set[int]] | None:
        """This step's blocks to save (those the tier lacks) and their staging buffer, made at
        the step's first ``save_kv_layer``."""
        meta = self._get_connector_metadata()
        step = self._save_step
        if step is not None and step[0] is meta:
            return step
        self._save_step = None
        if not isinstance(meta, KvmeshConnectorMetadata) or not meta.saves:
            return None
        hashes = [h for sv in meta.saves for h in sv.hashes]
        ids = [b for sv in meta.saves for b in sv.block_ids]
        groups = [g for sv in meta.saves for g in sv.groups]
        # Empty when the tier holds them all: remembered for the step all the same.
        missing = self._node.missing(hashes)
        kv0 = self._layers[0][0]
        # Per group: the staging rows of its blocks (None: all of them) and their block ids.
        plan = {}
        if missing:
            for g, rows in self._by_group([groups[i] for i in missing]):
                picked = missing if rows is None else [missing[i] for i in rows.tolist()]
                plan[g] = (rows, torch.tensor([ids[i] for i in picked], dtype=torch.long,
                                              device=kv0.device))
        staging = self._blocks_buffer(len(missing))
        self._save_step = (meta, [hashes[i] for i in missing], plan, staging, set())
        return self._save_step

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        """After layer ``layer_name``'s attention wrote this step's KV: copy that layer's part of
        the step's new full blocks into the staging buffer (the rest of the step's compute
        follows; ``wait_for_save`` only hands the staged blocks to the tier)."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._layers or not self._leads_shard:
            return
        step = self._save_plan()
        if step is None:
            return
        _, _, plan, staging, done = step
        done.add(layer)
        entry = plan.get(self._layer_group[layer])
        if entry is None:
            return
        rows, ids_t = entry
        kv, d = self._layers[layer]
        off, nbytes = self._layer_bytes[layer]
        sel = kv.index_select(d, ids_t).movedim(d, 0).reshape(len(ids_t), -1)
        sel = sel.view(torch.uint8).cpu()
        if rows is None:
            staging[:, off:off + nbytes].copy_(sel)
        else:
            staging[rows, off:off + nbytes] = sel

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        step, self._save_step = self._save_step, None
        if not meta.saves or not self._layers or not self._leads_shard:
            return
        self._store(meta, step)
        self._retain(meta)

    def _retain(self, meta: KvmeshConnectorMetadata) -> None:
        """Retains a P/D leg's blocks now, as they are saved: an idle prefiller runs no further
        step after the request finished, so nothing later could retain them in time."""
        ttl_ms = int(self._s.kv_blocks_ttl_s * 1000)
        for sv in meta.saves:
            if not sv.retain_for:
                continue
            n = self._node.retain(sv.retain_for, sv.hashes, ttl_ms)
            if n < len(sv.hashes):
                logger.warning("kvmesh: P/D leg %s: %d of %d blocks retained (the rest did not "
                               "fit in the CPU tier): the reader computes them", sv.retain_for,
                               n, len(sv.hashes))

    def _store(self, meta: KvmeshConnectorMetadata, step: Any) -> None:
        """Hands the step's new full blocks to the CPU tier (staged layer by layer, or copied
        whole now)."""
        if step is not None and step[0] is meta and len(step[4]) == len(self._layers):
            hashes, data = step[1], step[3]
            if not hashes:
                return
        else:
            # Not every layer went through save_kv_layer (e.g. a step without attention
            # metadata): copy the blocks whole now.
            hashes = [h for sv in meta.saves for h in sv.hashes]
            ids = [b for sv in meta.saves for b in sv.block_ids]
            missing = self._node.missing(hashes)
            if not missing:
                return
            groups = [g for sv in meta.saves for g in sv.groups]
            data = self._gather([ids[i] for i in missing], [groups[i] for i in missing])
            hashes = [hashes[i] for i in missing]
        stored, rejected = self._node.insert_blocks(hashes, data.numpy())
        self._stored.extend(stored)
        if rejected:
            logger.warning("kvmesh: cpu tier full of pinned blocks, %d blocks not kept", rejected)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._loaded_locally = self._loaded_locally, set()
        for rid, load in list(self._loading.items()):
            if self._collect_pull(load) is not None:
                del self._loading[rid]
                done.add(rid)
        if self._shared:
            done |= self._finish_shared_loads()
        return None, (done or None)

    def _collect_pull(self, load: _Load) -> tuple[torch.Tensor, int] | None:
        """A finished pull's blocks, copied into its block ids (what did not arrive is a load
        error): the buffer and the count that arrived; ``None`` while it is still running."""
        rid, block_ids = load.req_id, load.block_ids
        if self._node.is_pulling(rid) and not self._node.wait_pull(rid, self._s.poll_wait_ms):
            return None
        buf = self._blocks_buffer(len(block_ids))
        try:
            res = self._node.poll_pull(rid, buf.numpy())
        except Exception:  # a bug here must cost a recompute, never the request
            logger.exception("kvmesh: collecting the pull for %s failed: recomputing", rid)
            res = None
        blocks, reason = (res[0], res[2]) if res is not None else (0, "no result")
        if blocks:
            self._scatter(buf, block_ids[:blocks], load.groups)
        if blocks < len(block_ids):
            logger.warning("kvmesh: load for %s got %d of %d blocks (%s): recomputing",
                           rid, blocks, len(block_ids), reason)
            self._fail(rid, block_ids[blocks:])
        return buf, blocks

    def _finish_shared_loads(self) -> set[str]:
        """Pulls of KV every TP rank holds identically (MLA's latent): the first rank pulled
        it, and hands each finished pull to the other ranks over the TP group's CPU channel,
        so a peer serves it once per server, not once per rank. Every rank calls this at the
        same point of each step with the same pending loads (all ranks get the same metadata),
        so the broadcasts below pair up; nothing between them can raise."""
        assert self._replica_group is not None
        group, src = self._replica_group
        rids = sorted(self._shared)
        # Per load: blocks that arrived, or -1 while the leader's pull is still running.
        status = torch.full((len(rids),), -1, dtype=torch.long)
        bufs: dict[str, torch.Tensor] = {}
        if self._leads_shard:
            for i, rid in enumerate(rids):
                got = self._collect_pull(self._shared[rid])
                if got is not None:
                    bufs[rid], status[i] = got
        torch.distributed.broadcast(status, src=src, group=group)
        done = set()
        for i, rid in enumerate(rids):
            arrived = int(status[i])
            if arrived < 0:
                continue
            load = self._shared.pop(rid)
            block_ids = load.block_ids
            done.add(rid)
            if self._leads_shard:
                if arrived:
                    torch.distributed.broadcast(bufs[rid][:arrived], src=src, group=group)
                continue
            if arrived:
                buf = self._blocks_buffer(arrived)
                torch.distributed.broadcast(buf, src=src, group=group)
                self._scatter(buf, block_ids[:arrived], load.groups)
            if arrived < len(block_ids):
                self._fail(rid, block_ids[arrived:])
        return done

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        removed = self._node.take_removed()
        if not self._stored and not removed:
            return None
        meta = KvmeshWorkerMetadata(stored=[self._stored] if self._stored else [],
                                    removed=removed)
        self._stored = []
        return meta

    def _fail(self, rid: str, block_ids: list[int]) -> None:
        """Blocks of ``rid``'s load that did not arrive. With one KV cache group vLLM
        recomputes from the first of them and keeps the rest; with several it takes only a
        whole request's failure (a block-level report there stops the engine), and recomputes
        the request."""
        if self._groups.hybrid:
            self._failed.add(rid)
        else:
            self._load_errors.update(block_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        _, finished = self.get_finished(finished_req_ids)
        done = set(finished or ())
        failed = self._failed & done
        self._failed -= failed
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # The step's forward is over: its layer-wise pulls end here, before vLLM reads the
        # errors (it calls this after every step with a connector).
        self._end_layer_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.shutdown()
        node = getattr(self, "_node", None)
        if node is not None:
            if getattr(self, "_layer_loads", None):
                self._end_layer_loads()
            node.shutdown()
