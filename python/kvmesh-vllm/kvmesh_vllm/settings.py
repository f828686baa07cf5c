"""The connector's settings: ``kv_connector_extra_config`` with its defaults, checked (a misspelt
key or a bad size stops the server with a clear error), plus the fingerprint fields every server
of a mesh must agree on, read from vLLM's config. Used by the connector (both processes) and by
its metrics (``kvmesh_p2p_fingerprint_info``), so it depends on neither."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from kvmesh_vllm import _native

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under "vllm." so vLLM's logging configuration (handlers, level) applies.
logger = logging.getLogger("vllm.kvmesh")

_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
}


_UNITS = {
    "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "B": 1,
}


def parse_bytes(v: Any, key: str = "size") -> int:
    """``4GiB``, ``4G`` (binary), ``512MB`` (decimal), ``1e9`` or an int; >= 0."""
    if isinstance(v, bool):
        raise ValueError(f"kvmesh connector: {key} must be a size like 4GiB, not {v!r}")
    if isinstance(v, int):
        n = v
    else:
        s = str(v).strip().upper().replace(" ", "")
        number, mult = s, 1
        # Longest unit first: "GIB" before "B".
        for u in sorted(_UNITS, key=len, reverse=True):
            if s.endswith(u):
                number, mult = s[: -len(u)], _UNITS[u]
                break
        try:
            n = int(float(number) * mult)
        except (ValueError, OverflowError):
            raise ValueError(
                f"kvmesh connector: {key} must be a size like 4GiB, 512MiB or 1e9, not {v!r}"
            ) from None
    if n < 0:
        raise ValueError(f"kvmesh connector: {key} must be >= 0, not {v!r}")
    return n


def peer_list(v: Any, key: str) -> list[str]:
    """A list of ``host`` / ``host:port`` strings, or one comma-separated string of them."""
    if v is None:
        return []
    if isinstance(v, str):
        return [p.strip() for p in v.split(",") if p.strip()]
    if isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v):
        return list(v)
    raise ValueError(f"kvmesh connector: {key} must be a list of host[:port] strings, not {v!r}")


def load_mode(v: Any) -> str:
    """One of ``LOAD_MODES`` (see ``Settings.load_mode``)."""
    if v not in LOAD_MODES:
        raise ValueError(f"kvmesh connector: load_mode must be one of {list(LOAD_MODES)}, "
                         f"not {v!r}")
    return str(v)


_LOOPBACK = ("127.", "localhost", "::1", "[::1]")

# Every key of ``kv_connector_extra_config`` the connector reads (a misspelt key is refused,
# not ignored: a silently default ``cpu_bytes`` is a tier of the wrong size).
KNOWN_KEYS = {
    "p2p_host", "p2p_port", "cpu_bytes", "allowed_peers", "allowed_consumers",
    "p2p_secret_file", "timeout_ms", "max_pull_ms", "poll_wait_ms", "serve_bytes_per_sec",
    "metrics_port", "model_id", "load_failure_policy", "events_endpoint", "events_topic",
    "events_replay_endpoint", "local_reuse", "load_mode", "bidirectional_kv_xfer",
    "decoder_kv_blocks_ttl", "kv_recompute_threshold", "p2p_advertise_host",
}

LOAD_MODES = ("async", "layerwise")


def tp_replicas(model: Any, tp_size: int) -> int:
    """Consecutive TP ranks holding identical KV, from the model alone (vLLM's own value,
    ``KVCacheConfig.kv_tp_replicas``, is checked against it once the KV cache exists): every
    rank holds MLA's whole latent; with fewer KV heads than ranks each head is replicated."""
    if tp_size <= 1:
        return 1
    if getattr(model, "use_mla", False):
        return tp_size
    heads = model.get_total_num_kv_heads()
    return tp_size // heads if 0 < heads < tp_size else 1


class Settings:
    """``kv_connector_extra_config`` with defaults, plus the fingerprint fields."""

    def __init__(self, vllm_config: "VllmConfig"):
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"kvmesh connector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known: {sorted(KNOWN_KEYS)}"
            )
        self.extra = extra
        self.p2p_host: str = str(extra.get("p2p_host", "127.0.0.1"))
        self.p2p_port: int = int(extra.get("p2p_port", 7100))
        self.cpu_bytes = parse_bytes(extra.get("cpu_bytes", "1GiB"), "cpu_bytes")
        self.allowed_peers: list[str] = peer_list(extra.get("allowed_peers"), "allowed_peers")
        consumers = extra.get("allowed_consumers")
        self.allowed_consumers: list[str] | None = (
            None if consumers is None else peer_list(consumers, "allowed_consumers")
        )
        secret_file = extra.get("p2p_secret_file")
        self.secret: bytes | None = None
        if secret_file:
            with open(secret_file, "rb") as f:
                self.secret = f.read().rstrip(b"\r\n") or None
        self.timeout_ms = int(extra.get("timeout_ms", 5000))
        self.max_pull_ms = int(extra.get("max_pull_ms", 30000))
        # While a pull runs, vLLM polls the connector once per engine step; each poll sleeps up
        # to this long for it (GIL released) instead of letting an idle engine loop spin.
        self.poll_wait_ms = int(extra.get("poll_wait_ms", 10))
        # Cap on what the producer serves to peers, all of them together (bytes/s, `64MiB`…);
        # 0 or absent: no cap. Enforced block by block in Rust (kvmesh-py's pacer).
        self.serve_bytes_per_sec = parse_bytes(extra.get("serve_bytes_per_sec", 0),
                                               "serve_bytes_per_sec")
        self.metrics_port: int | None = (
            int(extra["metrics_port"]) if extra.get("metrics_port") else None
        )
        # The CPU tier's events also go to a publisher of their own (vLLM's ZMQ format) when
        # this is set; they always go into vLLM's own stream (--kv-events-config) as well.
        self.events_endpoint: str | None = extra.get("events_endpoint") or None
        self.events_topic: str = str(extra.get("events_topic", ""))
        self.events_replay_endpoint: str | None = extra.get("events_replay_endpoint") or None
        # Requests with no source named reuse this server's own CPU tier (default on).
        self.local_reuse: bool = bool(extra.get("local_reuse", True))
        # How a pulled prefix reaches vLLM (docs/vllm.md#load-modes). `async` (default): the
        # request waits outside the batch until the whole prefix arrived, then computes; a slow
        # or dying peer delays only that request. `layerwise`: the request runs at once and each
        # layer's attention waits for that layer's KV (written straight into vLLM's KV
        # tensors), so the pull overlaps compute, but a slow pull stalls the whole step, every
        # request in the batch, up to `max_pull_ms`.
        self.load_mode: str = load_mode(extra.get("load_mode", "async"))
        # P/D (docs/vllm.md#pd-disaggregation). Blocks a prefill leg (or, bi-directional, a
        # decode leg) hands off stay retained in the CPU tier this long unless their reader
        # fetched them first; vLLM's NIXL default is 480 s.
        self.kv_blocks_ttl_s: float = float(extra.get("decoder_kv_blocks_ttl", 480))
        if not self.kv_blocks_ttl_s > 0:
            raise ValueError("kvmesh connector: decoder_kv_blocks_ttl must be > 0 seconds")
        # A decoder also retains prompt + output and hands them to the next turn's prefill
        # (vLLM's `bidirectional_kv_xfer`); a prefiller reads such history only with it on.
        self.bidirectional: bool = bool(extra.get("bidirectional_kv_xfer", False))
        # A history read shorter than this many tokens is computed instead (vLLM's default).
        self.kv_recompute_threshold: int = int(extra.get("kv_recompute_threshold", 64))
        # The producer's host as peers reach it, named in the params a P/D leg returns.
        self.advertise_host: str = str(extra.get("p2p_advertise_host") or self.p2p_host)
        if self.advertise_host in ("0.0.0.0", "::", "[::]"):
            logger.warning("kvmesh connector: p2p_host %s is a wildcard: P/D legs would name "
                           "it to their peers; set p2p_advertise_host", self.advertise_host)
        remote = [p for p in self.allowed_peers if not p.startswith(_LOOPBACK)]
        if self.p2p_host.startswith(_LOOPBACK) and remote:
            logger.warning(
                "kvmesh connector: allowed_peers names remote peers %s but the producer listens "
                "on %s only, so they cannot pull from this server: set p2p_host (with "
                "allowed_consumers or p2p_secret_file) to serve them", remote, self.p2p_host,
            )

        cache = vllm_config.cache_config
        model = vllm_config.model_config
        par = vllm_config.parallel_config
        self.block_size: int = cache.block_size
        algo = cache.prefix_caching_hash_algo
        if algo not in ("sha256_cbor", "xxhash_cbor"):
            raise ValueError(
                f"KvmeshConnector needs --prefix-caching-hash-algo sha256_cbor (or xxhash_cbor "
                f"with PYTHONHASHSEED set): block hashes must be reproducible across servers, "
                f"and {algo!r} is not"
            )
        if algo == "xxhash_cbor" and os.environ.get("PYTHONHASHSEED") is None:
            raise ValueError(
                "KvmeshConnector: with --prefix-caching-hash-algo xxhash_cbor vLLM seeds block "
                "hashes randomly per process unless PYTHONHASHSEED is set; set it (the same on "
                "every server) or use sha256_cbor"
            )
        self.hash_algo: str = algo
        if par.pipeline_parallel_size != 1:
            raise ValueError(
                "KvmeshConnector: pipeline parallel size > 1 is not supported (tensor parallel "
                "is): each pipeline stage would hold a different slice of the layers"
            )
        self.tp_size: int = par.tensor_parallel_size
        dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
        dt = _DTYPES.get(dtype, str(dtype)) if isinstance(dtype, torch.dtype) else str(dtype)
        from vllm.platforms import current_platform

        # The layout is vLLM's per-layer block layout, which its attention backend chooses
        # per device and version; on the CPU build (num_blocks, kv_heads, block_size,
        # 2*head_size). Servers exchange blocks only when device, forced backend (if any) and
        # vLLM version agree; the worker also logs the layer shape it registered.
        import vllm

        attn = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        backend = getattr(attn, "name", None) or (str(attn) if attn else "auto")
        self._layout = f"{dt}:vllm-{current_platform.device_type}:{backend}:{vllm.__version__}"
        self.model_id: str = str(extra.get("model_id") or model.served_model_name or model.model)
        if isinstance(model.served_model_name, list):
            self.model_id = str(extra.get("model_id") or model.served_model_name[0])
        self.num_layers: int = model.get_num_layers(par)
        self.num_kv_heads: int = model.get_num_kv_heads(par)
        self.head_dim: int = model.get_head_size()
        self.none_hash: str = _native.none_hash(algo, os.environ.get("PYTHONHASHSEED"))
        self.set_tp_rank(0, tp_replicas(model, self.tp_size))

    def set_tp_rank(self, rank: int, replicas: int) -> None:
        """This process's tensor-parallel rank and ``replicas``, the number of consecutive ranks
        that hold identical KV (vLLM's ``kv_tp_replicas``: the TP size for MLA's latent, or
        ranks / KV heads when there are fewer KV heads than ranks). Ranks of one replica set
        hold one *shard*; its first rank, the shard's leader, keeps and serves it for all of
        them. The scheduler process speaks for rank 0."""
        if replicas < 1 or self.tp_size % replicas:
            replicas = 1
        self.tp_rank = rank
        self.tp_replicas = replicas
        self.tp_shard = rank // replicas
        # A rank's bytes are its shard's: the fingerprint names the shard, so rank 1 of one
        # server can only ever read rank 1's shard of another. It names the TP size even when
        # every rank holds the same bytes (MLA): a latent computed at TP 2 is not the bytes TP 1
        # computes (the all-reduces sum in another order), and a random test model already
        # answers differently from the second token (docs/notes-vllm-models.md §6).
        shards = self.tp_size // replicas
        if self.tp_size == 1:
            self.kv_dtype = self._layout
        elif shards == 1:
            self.kv_dtype = f"{self._layout}:tp{self.tp_size}"
        else:
            self.kv_dtype = f"{self._layout}:tp{self.tp_size}-shard{self.tp_shard}"

    def set_group_layout(self, signature: str) -> None:
        """The model's KV cache groups (vLLM's hybrid KV cache manager): a block's bytes are
        per group, so servers exchange them only with the same layout."""
        self._layout = f"{self._layout}:groups[{signature}]"
        self.set_tp_rank(self.tp_rank, self.tp_replicas)

    @property
    def shard_leader(self) -> int:
        """The rank that keeps and serves this rank's shard (in every server of the mesh)."""
        return self.tp_shard * self.tp_replicas

    def shard_port(self, rank0_port: int) -> int:
        """The P2P port serving this rank's shard on a server whose rank 0 listens on
        ``rank0_port`` (rank r listens on ``p2p_port + r``)."""
        return rank0_port + self.shard_leader

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id, "kv_dtype": self.kv_dtype, "block_size": self.block_size,
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hash_algo": self.hash_algo, "none_hash": self.none_hash,
        }

    def fingerprint_id(self) -> str:
        return _native.fingerprint_id(**self.fingerprint_fields())

    def node(self, *, listen_host: str | None, listen_port: int, cpu_bytes: int,
             allowed_peers: list[str], allowed_consumers: list[str] | None,
             serve_bytes_per_sec: int = 0) -> Any:
        return _native.Node(
            **self.fingerprint_fields(),
            cpu_bytes=cpu_bytes,
            listen_host=listen_host,
            listen_port=listen_port,
            allowed_peers=allowed_peers,
            allowed_consumers=allowed_consumers,
            secret=self.secret,
            timeout_ms=self.timeout_ms,
            max_pull_ms=self.max_pull_ms,
            serve_bytes_per_sec=serve_bytes_per_sec,
        )
