//! `kvmesh_vllm._native`: the Python face of [`Node`]. Arguments are converted here; everything
//! that waits on a socket, copies blocks or checksums them runs with the GIL released
//! (`Python::detach`), so vLLM's threads keep running while a pull is on the wire.

use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::hashing::none_hash_for_seed;
use kvmesh_core::{BlockDigest, BlockHash, Fingerprint, HashAlgo};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffers;

use crate::kv_memory::{KvDestination, LayerTarget};
use crate::node::{LayerWait, Node, NodeConfig, PullDone};
use crate::tier::Inserted;

fn hashes(v: &[u64]) -> Vec<BlockHash> {
    v.iter().copied().map(BlockHash).collect()
}

/// One KV tensor as Python describes it: `(data_ptr, bytes, block_stride, [(offset, len), …])`
/// ([`LayerTarget`]).
type PyLayerTarget = (usize, usize, usize, Vec<(usize, usize)>);

/// `(blocks, outcome, reason)`: outcome `complete`/`partial`/`failed`, reason `None` when
/// complete.
type PullTuple = (usize, &'static str, Option<String>);

/// Reports a finished pull; with `dest`, first copies its blocks there (GIL released): the one
/// copy of a pulled prefix on this side, from the transport's buffers into the tensor the
/// connector scatters into vLLM's blocks.
fn finish_pull(py: Python<'_>, done: PullDone, dest: Option<PyBuffer<u8>>) -> PyResult<PullTuple> {
    if let Some(mut dest) = dest {
        let out = buffers::bytes_mut(&mut dest)?;
        let need = done.data_len();
        if out.len() < need {
            return Err(PyValueError::new_err(format!(
                "destination holds {} bytes, the pull brought {need}",
                out.len()
            )));
        }
        py.detach(|| {
            let mut off = 0;
            for block in &done.data {
                let end = off + block.len();
                out[off..end].copy_from_slice(block);
                off = end;
            }
        });
    }
    let reason = done.report.outcome.reason().map(ToString::to_string);
    Ok((done.report.blocks, done.report.outcome.label(), reason))
}

/// NONE_HASH (hex) as vLLM derives it: `H(cbor(seed))`, seed `PYTHONHASHSEED` or vLLM's default.
#[pyfunction]
#[pyo3(signature = (hash_algo, seed=None))]
fn none_hash(hash_algo: &str, seed: Option<&str>) -> PyResult<String> {
    let algo: HashAlgo = hash_algo
        .parse()
        .map_err(|e| PyValueError::new_err(format!("{e}")))?;
    Ok(none_hash_for_seed(
        algo,
        seed.unwrap_or(kvmesh_core::hashing::DEFAULT_NONE_HASH_SEED),
    )
    .to_hex())
}

/// The fingerprint's hashing fields from Python's strings: the algorithm, and NONE_HASH as
/// canonical hex (a malformed value is a `ValueError` naming it).
fn hashing_fields(hash_algo: &str, none_hash: &str) -> PyResult<(HashAlgo, String)> {
    let algo = hash_algo
        .parse()
        .map_err(|e| PyValueError::new_err(format!("{e}")))?;
    let none_hash = BlockDigest::from_hex(none_hash)
        .map_err(|e| PyValueError::new_err(format!("none_hash: {e}")))?
        .to_hex();
    Ok((algo, none_hash))
}

/// [`Fingerprint::id`] of a fingerprint given field by field (for processes without a node,
/// e.g. vLLM's API server exporting `kvmesh_p2p_fingerprint_info`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (*, model_id, kv_dtype, block_size, num_layers, num_kv_heads, head_dim, hash_algo, none_hash))]
fn fingerprint_id(
    model_id: String,
    kv_dtype: String,
    block_size: u32,
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    hash_algo: &str,
    none_hash: &str,
) -> PyResult<String> {
    let (hash_algo, none_hash) = hashing_fields(hash_algo, none_hash)?;
    Ok(Fingerprint {
        model_id,
        kv_dtype,
        block_size,
        num_layers,
        num_kv_heads,
        head_dim,
        hash_algo,
        none_hash,
    }
    .id())
}

/// A kvmesh mesh member: bounded CPU tier, P2P producer, pull client.
#[pyclass(name = "Node", frozen)]
struct PyNode {
    inner: Node,
}

#[pymethods]
impl PyNode {
    #[new]
    #[pyo3(signature = (
        *, model_id, kv_dtype, block_size, num_layers, num_kv_heads, head_dim, hash_algo,
        none_hash, cpu_bytes, listen_host=None, listen_port=0, allowed_peers=Vec::new(),
        allowed_consumers=None, secret=None, timeout_ms=5000, max_pull_ms=30000,
        serve_bytes_per_sec=0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_id: String,
        kv_dtype: String,
        block_size: u32,
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        hash_algo: &str,
        none_hash: &str,
        cpu_bytes: u64,
        listen_host: Option<String>,
        listen_port: u16,
        allowed_peers: Vec<String>,
        allowed_consumers: Option<Vec<String>>,
        secret: Option<Vec<u8>>,
        timeout_ms: u64,
        max_pull_ms: u64,
        serve_bytes_per_sec: u64,
    ) -> PyResult<Self> {
        let (hash_algo, none_hash) = hashing_fields(hash_algo, none_hash)?;
        let config = NodeConfig {
            fingerprint: Fingerprint {
                model_id,
                kv_dtype,
                block_size,
                num_layers,
                num_kv_heads,
                head_dim,
                hash_algo,
                none_hash,
            },
            cpu_bytes,
            listen: listen_host.map(|h| (h, listen_port)),
            allowed_peers,
            allowed_consumers,
            secret,
            timeout: Duration::from_millis(timeout_ms),
            max_pull: Duration::from_millis(max_pull_ms),
            serve_bytes_per_sec,
        };
        let inner = py
            .detach(|| Node::start(config))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Self { inner })
    }

    /// The producer's bound port, `None` without a producer.
    #[getter]
    fn port(&self) -> Option<u16> {
        self.inner.listen_addr().map(|a| a.port())
    }

    /// The fingerprint as a dict (what a peer must match).
    fn fingerprint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let f = kvmesh_transfer::BlockSource::fingerprint(self.inner.tier());
        let d = PyDict::new(py);
        d.set_item("model_id", f.model_id)?;
        d.set_item("kv_dtype", f.kv_dtype)?;
        d.set_item("block_size", f.block_size)?;
        d.set_item("num_layers", f.num_layers)?;
        d.set_item("num_kv_heads", f.num_kv_heads)?;
        d.set_item("head_dim", f.head_dim)?;
        d.set_item("hash_algo", f.hash_algo.as_str())?;
        d.set_item("none_hash", f.none_hash)?;
        Ok(d)
    }

    /// Indexes of `hashes` the tier does not hold.
    fn missing(&self, hashes_in: Vec<u64>) -> Vec<usize> {
        let tier = self.inner.tier();
        hashes_in
            .iter()
            .enumerate()
            .filter(|(_, h)| !tier.contains(BlockHash(**h)))
            .map(|(i, _)| i)
            .collect()
    }

    /// Store `len(hashes)` blocks given as one contiguous buffer of equal-sized blocks.
    /// Returns `(stored hashes, rejected count)`; blocks already held are neither. Each stored
    /// block gets its own allocation (evicting it frees it), copied with the GIL released.
    fn insert_blocks(
        &self,
        py: Python<'_>,
        hashes_in: Vec<u64>,
        data: PyBuffer<u8>,
    ) -> PyResult<(Vec<u64>, usize)> {
        let n = hashes_in.len();
        let all = buffers::bytes(&data)?;
        if n == 0 {
            return Ok((Vec::new(), 0));
        }
        if all.is_empty() || !all.len().is_multiple_of(n) {
            return Err(PyValueError::new_err(format!(
                "{} bytes do not split into {n} equal blocks",
                all.len()
            )));
        }
        let tier = self.inner.tier();
        Ok(py.detach(|| {
            let (mut stored, mut rejected) = (Vec::new(), 0);
            for (h, block) in hashes_in.iter().zip(all.chunks_exact(all.len() / n)) {
                // Held already: skip the copy.
                if tier.contains(BlockHash(*h)) {
                    continue;
                }
                match tier.insert(BlockHash(*h), Bytes::copy_from_slice(block)) {
                    Inserted::Stored => stored.push(*h),
                    Inserted::Rejected => rejected += 1,
                    Inserted::Present => {}
                }
            }
            (stored, rejected)
        }))
    }

    /// Keeps the leading run of held `hashes` for `ttl_ms` for the P/D reader `request_id`
    /// (its `remote_request_id`): evicted only after unprotected blocks, released by that
    /// reader's fetch or at the TTL. Returns how many were retained.
    fn retain(&self, request_id: &str, hashes_in: Vec<u64>, ttl_ms: u64) -> usize {
        self.inner.tier().retain(
            request_id,
            &hashes(&hashes_in),
            Duration::from_millis(ttl_ms),
        )
    }

    /// Copies the leading held blocks of `hashes` into `dest` (writable, GIL released): this
    /// server's own tier serving one of its requests. Returns how many blocks were copied; a
    /// block `dest` has no room for ends the run.
    fn read_into(
        &self,
        py: Python<'_>,
        hashes_in: Vec<u64>,
        mut dest: PyBuffer<u8>,
    ) -> PyResult<usize> {
        let hs = hashes(&hashes_in);
        let out = buffers::bytes_mut(&mut dest)?;
        let tier = self.inner.tier();
        Ok(py.detach(|| {
            let mut off = 0;
            let mut copied = 0;
            for block in tier.get_prefix(&hs) {
                let Some(slot) = out.get_mut(off..off + block.len()) else {
                    break;
                };
                slot.copy_from_slice(&block);
                off += block.len();
                copied += 1;
            }
            copied
        }))
    }

    /// Start a background pull under `key` of `hashes` (each `block_bytes` long) from
    /// `host:port`; `poll_pull(key, dest)` copies what arrived into `dest`.
    #[allow(clippy::too_many_arguments)]
    fn start_pull(
        &self,
        py: Python<'_>,
        key: &str,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes_in: Vec<u64>,
        block_bytes: usize,
    ) {
        let hs = hashes(&hashes_in);
        py.detach(|| {
            self.inner
                .start_pull(key, host, port, kv_request_id, hs, block_bytes);
        });
    }

    /// Start a layer-major pull under `key` of `hashes` from `host:port`, straight into vLLM's
    /// KV tensors: block `i` lands in block `block_ids[i]` of every layer. `layers` gives, per
    /// layer in the order the CPU tier stores a block's bytes, `(data_ptr, bytes, block_stride,
    /// [(offset, len), …])`: the tensor's address and its bytes from there, the bytes between
    /// two blocks, and each contiguous run of one block's bytes. Every byte is bounds-checked
    /// against its layer; a bad destination is a `ValueError`.
    ///
    /// Pointer contract (what Rust cannot check): the tensors stay alive and nobody else reads
    /// or writes the blocks `block_ids` until `end_layer_pull(key)` returned. The connector
    /// keeps its KV tensors for the engine's lifetime and waits for every layer (or the pull's
    /// failure) before vLLM's attention reads a layer.
    #[allow(clippy::too_many_arguments, unsafe_code)]
    fn start_layer_pull(
        &self,
        py: Python<'_>,
        key: &str,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes_in: Vec<u64>,
        layers: Vec<PyLayerTarget>,
        block_ids: Vec<usize>,
    ) -> PyResult<()> {
        let targets = layers
            .into_iter()
            .map(|(base, len, block_stride, chunks)| LayerTarget {
                base,
                len,
                block_stride,
                chunks,
            })
            .collect();
        // SAFETY: the pointer contract above, which the connector keeps.
        let destination = unsafe { KvDestination::new(targets, block_ids) }
            .map_err(|e| PyValueError::new_err(format!("layer pull destination: {e}")))?;
        let hs = hashes(&hashes_in);
        py.detach(|| {
            self.inner
                .start_layer_pull(key, host, port, kv_request_id, hs, destination);
        });
        Ok(())
    }

    /// Sleep (GIL released) up to `timeout_ms` for layer `layer` of the layer-major pull under
    /// `key`: `"ready"` (it is in, for the blocks the peer served), `"failed"` (the pull ended
    /// without it, or no such pull) or `"pending"` (still on the wire).
    fn wait_layer(&self, py: Python<'_>, key: &str, layer: usize, timeout_ms: u64) -> &'static str {
        match py.detach(|| {
            self.inner
                .wait_layer(key, layer, Duration::from_millis(timeout_ms))
        }) {
            LayerWait::Ready => "ready",
            LayerWait::Failed => "failed",
            LayerWait::Pending => "pending",
        }
    }

    /// End the layer-major pull under `key` (GIL released): wait up to `grace_ms` for it, then
    /// cancel it; returns once it no longer writes into the tensors. `(blocks, outcome,
    /// reason)` with `blocks` the leading blocks that arrived whole (every layer); `None` for an
    /// unknown key.
    fn end_layer_pull(&self, py: Python<'_>, key: &str, grace_ms: u64) -> Option<PullTuple> {
        let report = py.detach(|| {
            self.inner
                .end_layer_pull(key, Duration::from_millis(grace_ms))
        })?;
        let reason = report.outcome.reason().map(ToString::to_string);
        Some((report.blocks, report.outcome.label(), reason))
    }

    /// Start a background lookup under `key`: how many leading blocks `host:port` holds, none
    /// moved. Polled like a pull (`poll_pull(key, True)`: `blocks` is that run, no data).
    fn start_lookup(
        &self,
        py: Python<'_>,
        key: &str,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes_in: Vec<u64>,
    ) {
        let hs = hashes(&hashes_in);
        py.detach(|| {
            self.inner.start_lookup(key, host, port, kv_request_id, hs);
        });
    }

    /// `None` while running or for an unknown key (see `is_pulling`); the pull's tuple once
    /// finished (then forgotten). A pull copies its blocks into `dest` (writable, at least
    /// `blocks × block_bytes`); a lookup has none.
    #[pyo3(signature = (key, dest=None))]
    fn poll_pull(
        &self,
        py: Python<'_>,
        key: &str,
        dest: Option<PyBuffer<u8>>,
    ) -> PyResult<Option<PullTuple>> {
        match self.inner.poll_pull(key) {
            Some(Some(done)) => finish_pull(py, done, dest).map(Some),
            _ => Ok(None),
        }
    }

    fn is_pulling(&self, key: &str) -> bool {
        matches!(self.inner.poll_pull_peek(key), Some(false))
    }

    /// Sleep (GIL released) up to `timeout_ms` for the pull under `key`; whether it finished.
    fn wait_pull(&self, py: Python<'_>, key: &str, timeout_ms: u64) -> bool {
        py.detach(|| self.inner.wait_pull(key, Duration::from_millis(timeout_ms)))
    }

    fn forget(&self, key: &str) {
        self.inner.forget(key);
    }

    /// Hashes evicted since the last call (for `BlockRemoved` events).
    fn take_removed(&self) -> Vec<u64> {
        self.inner
            .tier()
            .take_removed()
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    /// Prometheus text of `kvmesh_p2p_*` and the tier's gauges.
    fn metrics_text(&self) -> String {
        self.inner.metrics_text()
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNode>()?;
    m.add_function(wrap_pyfunction!(none_hash, m)?)?;
    m.add_function(wrap_pyfunction!(fingerprint_id, m)?)?;
    Ok(())
}
