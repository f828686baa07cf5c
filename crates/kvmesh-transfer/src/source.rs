//! The seams between the transfer service and a block store: [`BlockSource`] (producer side, the
//! engine's CPU tier) and [`BlockSink`] (consumer side), plus [`MemorySource`], an in-memory
//! reference implementation with pin leases used by tests, the benchmark and as a model for the
//! engine's implementation.
//!
//! Contract for a `BlockSource`:
//! - `lookup_and_pin` answers per block and pins **only the leading run of `Hit`s**; each pin holds
//!   until `unpin` or until its lease expires, whichever comes first. A pinned block is never
//!   evicted, so a fetch that follows a lookup cannot race eviction.
//! - pins are counted: two lookups pin twice, each `unpin` releases one.
//! - `read` is cheap (a `Bytes` clone); it is called on async threads and must not block.
//! - `wait_ready` resolves `true` as soon as a pending block becomes readable, `false` at the
//!   deadline or at once if the block is not pending.
//! - `served` is told which request each sent block went to (the `kv_request_id` of the
//!   connection's last lookup). Holds kept for one reader (P/D hand-off) are released there, and
//!   only for that reader: a read by anyone else must not free them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, Fingerprint};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

pub use crate::message::BlockStatus;

/// Producer side: where served blocks come from.
pub trait BlockSource: Send + Sync + 'static {
    /// Our fingerprint; a consumer with a different one is refused.
    fn fingerprint(&self) -> Fingerprint;
    /// Status per block; pins the leading `Hit` run for `lease`.
    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus>;
    /// The payload of a held block.
    fn read(&self, hash: BlockHash) -> Option<Bytes>;
    /// The payload with its CRC32 (`crc32fast::hash`). Stores that keep the checksum from insert
    /// time should override this: checksumming on every send costs a pass over the payload on the
    /// producer's cores, and a checksum taken at insert also catches corruption at rest.
    fn read_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        let payload = self.read(hash)?;
        let crc = crc32fast::hash(&payload);
        Some((payload, crc))
    }
    /// Release one pin per hash (pins already expired are ignored).
    fn unpin(&self, hashes: &[BlockHash]);
    /// Resolve `true` once a `Pending` block is readable, `false` at `deadline` or if not pending.
    fn wait_ready(&self, hash: BlockHash, deadline: Instant) -> BoxFuture<'static, bool>;
    /// A block was sent to a consumer whose last lookup named `kv_request_id` (untrusted: any
    /// peer may name any id; it is a key, not a proof). Default: nothing to release.
    fn served(&self, kv_request_id: &str, hash: BlockHash) {
        let _ = (kv_request_id, hash);
    }
}

/// Why a sink refused a block; the pull stops there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sink rejected block {index}: {reason}")]
pub struct SinkError {
    pub index: usize,
    pub reason: String,
}

/// Consumer side: where pulled blocks go, in prefix order, as they arrive.
///
/// Each block is delivered once, `index` 0, 1, 2… in order, whatever the number of connections a
/// pull uses: either with [`BlockSink::accept`] (the payload in a buffer the client allocated), or,
/// for a sink that hands out its own memory with [`BlockSink::destination`], with
/// [`BlockSink::accept_written`] after the client read the payload straight into that memory.
pub trait BlockSink: Send {
    /// Block `index` arrived and passed the transport's checks (CRC32, and with a secret its
    /// tags). Verify and store; an error stops the pull.
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError>;

    /// Optional zero-copy landing: memory of exactly `len` bytes where block `index`'s payload
    /// should go. The client then reads the payload from the socket straight into it (checking,
    /// and when encrypted decrypting, it there) and calls [`BlockSink::accept_written`] instead
    /// of `accept`; the kernel's copy is then the only copy of each byte on the consumer. Until
    /// that call the memory's contents are unspecified: on any failure (a bad tag or checksum, a
    /// dropped connection) the client never makes it and the pull stops there. Asked only on a
    /// pull over one connection (a striped pull reads its stripes concurrently into buffers of
    /// its own, then calls `accept` in order). Default: `None` (the client allocates the buffer).
    fn destination(&mut self, index: usize, hash: BlockHash, len: usize) -> Option<&mut [u8]> {
        let _ = (index, hash, len);
        None
    }

    /// The payload of block `index` is in the memory [`BlockSink::destination`] returned for it,
    /// checked. Called only after `destination` returned memory for that block; an error stops
    /// the pull. Default: refuses (a sink that hands out memory implements this).
    fn accept_written(&mut self, index: usize, hash: BlockHash) -> Result<(), SinkError> {
        let _ = hash;
        Err(SinkError {
            index,
            reason: "the sink returned a destination but does not implement accept_written".into(),
        })
    }
}

/// A sink that keeps every block in memory (tests, examples).
#[derive(Debug, Default)]
pub struct VecSink {
    pub blocks: Vec<(BlockHash, Bytes)>,
}

impl BlockSink for VecSink {
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        if index != self.blocks.len() {
            return Err(SinkError {
                index,
                reason: format!("expected index {}", self.blocks.len()),
            });
        }
        self.blocks.push((hash, payload));
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Payload and its CRC32, computed once at insert.
    blocks: HashMap<BlockHash, (Bytes, u32)>,
    pending: HashSet<BlockHash>,
    /// Lease expiries of live pins per block (one entry per pin).
    pins: HashMap<BlockHash, Vec<Instant>>,
}

impl Inner {
    fn drop_expired(&mut self, hash: BlockHash, now: Instant) -> bool {
        if let Some(leases) = self.pins.get_mut(&hash) {
            leases.retain(|&t| t > now);
            if leases.is_empty() {
                self.pins.remove(&hash);
                return false;
            }
            return true;
        }
        false
    }
}

/// In-memory [`BlockSource`] with leases on `tokio::time::Instant` (so paused-clock tests work).
#[derive(Debug, Clone)]
pub struct MemorySource {
    fingerprint: Fingerprint,
    inner: Arc<Mutex<Inner>>,
    ready: Arc<Notify>,
}

impl MemorySource {
    pub fn new(fingerprint: Fingerprint) -> Self {
        Self {
            fingerprint,
            inner: Arc::default(),
            ready: Arc::new(Notify::new()),
        }
    }

    /// Store a block (completing it if it was pending). Computes its checksum once, here.
    pub fn insert(&self, hash: BlockHash, payload: Bytes) {
        let crc = crc32fast::hash(&payload);
        {
            let mut g = self.inner.lock();
            g.pending.remove(&hash);
            g.blocks.insert(hash, (payload, crc));
        }
        self.ready.notify_waiters();
    }

    /// Mark a block as being computed.
    pub fn mark_pending(&self, hash: BlockHash) {
        self.inner.lock().pending.insert(hash);
    }

    /// Evict a block unless it holds a live pin. Returns whether it was removed.
    pub fn evict(&self, hash: BlockHash) -> bool {
        let mut g = self.inner.lock();
        if g.drop_expired(hash, Instant::now()) {
            return false;
        }
        g.blocks.remove(&hash).is_some()
    }

    /// Number of blocks that currently hold at least one unexpired pin.
    pub fn pinned_blocks(&self) -> usize {
        let now = Instant::now();
        let g = self.inner.lock();
        g.pins
            .values()
            .filter(|leases| leases.iter().any(|&t| t > now))
            .count()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.lock().blocks.contains_key(&hash)
    }

    /// Unexpired pins on one block (each lookup that pinned it holds one).
    pub fn pin_count(&self, hash: BlockHash) -> usize {
        let now = Instant::now();
        self.inner
            .lock()
            .pins
            .get(&hash)
            .map_or(0, |leases| leases.iter().filter(|&&t| t > now).count())
    }
}

impl BlockSource for MemorySource {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus> {
        let now = Instant::now();
        let mut g = self.inner.lock();
        let mut leading = true;
        hashes
            .iter()
            .map(|h| {
                let status = if g.blocks.contains_key(h) {
                    BlockStatus::Hit
                } else if g.pending.contains(h) {
                    BlockStatus::Pending
                } else {
                    BlockStatus::Miss
                };
                if status == BlockStatus::Hit && leading {
                    g.pins.entry(*h).or_default().push(now + lease);
                } else {
                    leading = false;
                }
                status
            })
            .collect()
    }

    fn read(&self, hash: BlockHash) -> Option<Bytes> {
        self.inner.lock().blocks.get(&hash).map(|(p, _)| p.clone())
    }

    fn read_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        self.inner.lock().blocks.get(&hash).cloned()
    }

    fn unpin(&self, hashes: &[BlockHash]) {
        let now = Instant::now();
        let mut g = self.inner.lock();
        for h in hashes {
            if g.drop_expired(*h, now)
                && let Some(leases) = g.pins.get_mut(h)
            {
                leases.pop();
                if leases.is_empty() {
                    g.pins.remove(h);
                }
            }
        }
    }

    fn wait_ready(&self, hash: BlockHash, deadline: Instant) -> BoxFuture<'static, bool> {
        let inner = Arc::clone(&self.inner);
        let ready = Arc::clone(&self.ready);
        Box::pin(async move {
            loop {
                let notified = ready.notified();
                tokio::pin!(notified);
                // Register before checking so an insert between check and await is not missed.
                notified.as_mut().enable();
                {
                    let g = inner.lock();
                    if g.blocks.contains_key(&hash) {
                        return true;
                    }
                    if !g.pending.contains(&hash) {
                        return false;
                    }
                }
                tokio::select! {
                    _ = notified => {}
                    _ = tokio::time::sleep_until(deadline) => {
                        return inner.lock().blocks.contains_key(&hash);
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_core::HashAlgo;

    use super::*;

    fn src() -> MemorySource {
        MemorySource::new(Fingerprint {
            model_id: "m".into(),
            kv_dtype: "sim".into(),
            block_size: 16,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
            hash_algo: HashAlgo::Sha256Cbor,
            none_hash: "00".into(),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn pins_leading_hits_only_and_leases_expire() {
        let s = src();
        for h in [1, 2, 4] {
            s.insert(BlockHash(h), Bytes::from_static(b"x"));
        }
        s.mark_pending(BlockHash(3));
        let st = s.lookup_and_pin(&[1, 2, 3, 4].map(BlockHash), Duration::from_secs(5));
        assert_eq!(
            st,
            vec![
                BlockStatus::Hit,
                BlockStatus::Hit,
                BlockStatus::Pending,
                BlockStatus::Hit
            ]
        );
        assert_eq!(s.pinned_blocks(), 2);
        assert!(!s.evict(BlockHash(1)), "pinned block must not be evicted");
        assert!(
            s.evict(BlockHash(4)),
            "block after the leading run is not pinned"
        );
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(s.pinned_blocks(), 0);
        assert!(s.evict(BlockHash(1)), "lease expired");
    }

    #[tokio::test(start_paused = true)]
    async fn unpin_releases_one_pin_each() {
        let s = src();
        s.insert(BlockHash(1), Bytes::from_static(b"x"));
        s.lookup_and_pin(&[BlockHash(1)], Duration::from_secs(5));
        s.lookup_and_pin(&[BlockHash(1)], Duration::from_secs(5));
        s.unpin(&[BlockHash(1)]);
        assert_eq!(s.pinned_blocks(), 1);
        s.unpin(&[BlockHash(1)]);
        assert_eq!(s.pinned_blocks(), 0);
        s.unpin(&[BlockHash(1)]); // extra unpin is harmless
    }

    #[tokio::test(start_paused = true)]
    async fn wait_ready_resolves_on_insert_or_deadline() {
        let s = src();
        s.mark_pending(BlockHash(9));
        let deadline = Instant::now() + Duration::from_secs(1);
        let w = s.wait_ready(BlockHash(9), deadline);
        let s2 = s.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s2.insert(BlockHash(9), Bytes::from_static(b"y"));
        });
        assert!(w.await);
        s.mark_pending(BlockHash(10));
        assert!(
            !s.wait_ready(BlockHash(10), Instant::now() + Duration::from_millis(50))
                .await
        );
        assert!(
            !s.wait_ready(BlockHash(11), Instant::now() + Duration::from_secs(60))
                .await,
            "not pending"
        );
    }
}
