"""P/D disaggregation's ``kv_transfer_params`` as the connector reads and writes them
(``docs/protocols.md#pd-and-bi-directional-transfer``; the kvmesh engine's ``pd.rs`` speaks the
same dialect): which leg a request is, where its KV is to be read from, and the params a finished
leg hands to the next one. Block ids are kvmesh event hashes (the last 8 bytes of vLLM's block
digest), never vLLM's slot ids: peers name blocks by content.

Pure Python (no vLLM import), so it is unit-tested on its own.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RemoteRead:
    """Where a request's KV waits: the P2P producer at ``host:port``, retained for the reader
    ``request_id`` (sent as the pull's ``kv_request_id`` so the holder releases it)."""

    host: str
    port: int
    request_id: str
    block_ids: list[int]
    num_tokens: int | None
    expiry: float | None

    def expired(self, now: float | None = None) -> bool:
        return self.expiry is not None and self.expiry <= (time.time() if now is None else now)


@dataclass(frozen=True)
class Leg:
    """``kind``: ``prefill`` (``do_remote_decode``; ``read`` is the previous turn's decoder
    history the router attached, if any), ``decode`` (``do_remote_prefill``; ``read`` is the
    prefiller) or ``none``."""

    kind: str
    read: RemoteRead | None = None


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def remote_read(params: dict[str, Any]) -> RemoteRead | None:
    """The read the params name; ``None`` without a usable host, port and block list."""
    host, port = params.get("remote_host"), _int(params.get("remote_port"))
    ids = params.get("remote_block_ids")
    if not isinstance(host, str) or not host or port is None or not 0 < port < 65536:
        return None
    if not isinstance(ids, list):
        return None
    block_ids = [_int(b) for b in ids]
    if any(b is None for b in block_ids):
        return None
    expiry = params.get("remote_blocks_expiry_time")
    try:
        expiry = float(expiry) if expiry is not None else None
    except (TypeError, ValueError):
        expiry = None
    return RemoteRead(
        host=host, port=port, request_id=str(params.get("remote_request_id") or ""),
        block_ids=[b for b in block_ids if b is not None],
        num_tokens=_int(params.get("remote_num_tokens")), expiry=expiry,
    )


def classify(params: dict[str, Any] | None) -> Leg:
    """Which P/D leg ``params`` describe (a decode leg wins: it is the later one)."""
    if not params:
        return Leg("none")
    if params.get("do_remote_prefill") is True:
        return Leg("decode", remote_read(params))
    if params.get("do_remote_decode") is True:
        return Leg("prefill", remote_read(params))
    return Leg("none")


def matched_blocks(read: RemoteRead, own: list[int], block_size: int) -> int:
    """How many of the request's leading blocks ``own`` (event hashes) the holder has: the
    leading run equal to its ``block_ids``, no more than its ``num_tokens`` cover (a chat
    template that changed earlier text mismatches at the first differing block)."""
    n = 0
    for mine, theirs in zip(own, read.block_ids):
        if mine != theirs:
            break
        n += 1
    if read.num_tokens is not None:
        n = min(n, read.num_tokens // block_size)
    return n


def handoff_params(*, leg: str, host: str, port: int, request_id: str, block_ids: list[int],
                   num_tokens: int, expiry: float, tp_size: int = 1) -> dict[str, Any]:
    """What a finished leg returns. ``prefill``: the decoder's params (``do_remote_prefill``);
    ``decode``: the decoder's history for the next turn's prefill (``do_remote_decode``)."""
    return {
        "do_remote_prefill": leg == "prefill",
        "do_remote_decode": leg == "decode",
        "remote_engine_id": f"kvmesh-vllm-{host}:{port}",
        "remote_block_ids": block_ids,
        "remote_request_id": request_id,
        # Host and port apart, bare host: as vLLM's NIXL params carry them.
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "remote_blocks_expiry_time": expiry,
    }


class PdCounters:
    """P/D outcomes of one scheduler, as Prometheus counters on the connector's metrics port:
    ``kvmesh_pd_reads_total{leg, outcome}`` (each decode leg's read of the prompt, each prefill
    leg's read of a decoder's history) and ``kvmesh_pd_handoffs_total{role}`` (params returned
    for the next leg), with ``kvmesh_pd_read_tokens_total{leg}`` found at the holder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: Counter[tuple[str, str]] = Counter()
        self._read_tokens: Counter[str] = Counter()
        self._handoffs: Counter[str] = Counter()

    def read(self, leg: str, outcome: str, tokens: int = 0) -> None:
        with self._lock:
            self._reads[(leg, outcome)] += 1
            self._read_tokens[leg] += tokens

    def handoff(self, role: str) -> None:
        with self._lock:
            self._handoffs[role] += 1

    def text(self) -> str:
        with self._lock:
            reads = sorted(self._reads.items())
            tokens = sorted(self._read_tokens.items())
            handoffs = sorted(self._handoffs.items())
        out = [
            "# HELP kvmesh_pd_reads_total P/D reads: a decode leg's prompt, a prefill leg's "
            "decoder history, by outcome.",
            "# TYPE kvmesh_pd_reads_total counter",
            *(f'kvmesh_pd_reads_total{{leg="{leg}",outcome="{o}"}} {n}' for (leg, o), n in reads),
            "# HELP kvmesh_pd_read_tokens_total Tokens a P/D read found at the holder.",
            "# TYPE kvmesh_pd_read_tokens_total counter",
            *(f'kvmesh_pd_read_tokens_total{{leg="{leg}"}} {n}' for leg, n in tokens),
            "# HELP kvmesh_pd_handoffs_total Finished P/D legs that returned params naming "
            "their retained blocks (prefill: for the decoder; decode: history for the next turn).",
            "# TYPE kvmesh_pd_handoffs_total counter",
            *(f'kvmesh_pd_handoffs_total{{role="{r}"}} {n}' for r, n in handoffs),
        ]
        return "\n".join(out) + "\n"
