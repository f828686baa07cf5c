//! Layer-pipelined pulls (`--p2p-load-mode layerwise`) for backends that compute layer by layer
//! and keep each block as one contiguous run per layer ([`BackendCapabilities::layered_blocks`]):
//! the request is scheduled at once, the missing prefix is pulled layer-major
//! ([`kvmesh_transfer::layers`]) into a staging area, and the compute loop, before each layer of
//! the request's first step, waits for that layer alone and copies it into the request's blocks
//! ([`LayeredPull::load_layer`]). Layer 0's attention can then run while layer 1 is on the wire.
//!
//! A stream that ends short (peer gone mid-layer, a `MISS` in the middle of the prefix, the
//! deadline) never fails the request: the compute loop keeps only the blocks that arrived on
//! every layer and recomputes the rest, discarding that step's output for the request (the
//! same rule as vLLM's load-error path). Staging is bounded by an engine-wide byte budget; a
//! pull that does not fit takes the whole-prefix path instead.
//!
//! [`BackendCapabilities::layered_blocks`]: crate::compute::BackendCapabilities::layered_blocks

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvmesh_core::{BlockHash, PullFeedback};
use kvmesh_transfer::{LayerPullReport, SegmentSink};

use crate::compute::{BlockId, KvArena};

/// How long past its deadline the compute loop waits for a layer before treating the stream as
/// ended: the pull task itself stops at the deadline, this only covers a starved runtime.
const WAIT_SLACK: Duration = Duration::from_secs(1);

/// Staging bytes all layer-pipelined pulls of an engine may hold at once.
#[derive(Debug)]
pub struct StagingBudget {
    limit: usize,
    used: AtomicUsize,
}

impl StagingBudget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Reserves `bytes`, or `None` when they do not fit (the caller pulls whole instead).
    fn reserve(self: &Arc<Self>, bytes: usize) -> Option<Reservation> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.checked_add(bytes).filter(|&n| n <= self.limit)?;
            match self
                .used
                .compare_exchange(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Some(Reservation {
                        budget: Arc::clone(self),
                        bytes,
                    });
                }
                Err(now) => used = now,
            }
        }
    }

    #[cfg(test)]
    fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// Bytes held against a [`StagingBudget`], given back when the pull's staging is dropped.
#[derive(Debug)]
struct Reservation {
    budget: Arc<StagingBudget>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One request's layer-major pull, shared by the task that runs it and the compute loop.
#[derive(Debug)]
pub struct LayeredPull {
    /// Index (in the prompt's full blocks) of the first pulled block.
    first_block: usize,
    /// Hashes of the blocks asked for, in prompt order.
    hashes: Vec<BlockHash>,
    /// Bytes of one layer of one block.
    segment_len: usize,
    layers: usize,
    /// When the compute loop stops waiting for a layer.
    give_up_at: Instant,
    state: Mutex<StreamState>,
    changed: Condvar,
    /// What the router is told once the pull ended (`x-kvmesh-pull`).
    feedback: tokio::sync::watch::Sender<Option<PullFeedback>>,
    /// Set once layer 0 arrived (the served prefix is known) or the pull ended.
    first_layer: tokio::sync::watch::Sender<bool>,
}

#[derive(Debug, Default)]
struct StreamState {
    /// Layers that arrived and are not yet copied out: `blocks × segment_len` bytes each.
    staged: Vec<Option<Vec<u8>>>,
    /// Blocks each completed layer covers (the producer's whole prefix, known with layer 0).
    served: Option<usize>,
    /// Layers that arrived so far (copied out or not).
    arrived: usize,
    /// Leading layers copied into the arena, and the fewest blocks any of them covered.
    copied_layers: usize,
    copied_blocks: usize,
    /// The pull's report once it ended, however.
    ended: Option<LayerPullReport>,
    /// Given back when the staging goes.
    reservation: Option<Reservation>,
}

/// What [`LayeredPull::load_layer`] did for one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerLoad {
    /// The layer of this many leading blocks is in the arena now.
    Copied(usize),
    /// The stream ended before this layer arrived.
    Missing,
}

impl LayeredPull {
    /// A pull of `hashes` (prompt blocks `first_block..`) whose blocks are `layers` runs of
    /// `segment_len` bytes, staged against `budget`; `None` when the staging does not fit.
    pub fn new(
        first_block: usize,
        hashes: Vec<BlockHash>,
        layers: usize,
        segment_len: usize,
        budget: &Arc<StagingBudget>,
        give_up_at: Instant,
    ) -> Option<Arc<Self>> {
        let bytes = hashes.len().checked_mul(layers)?.checked_mul(segment_len)?;
        let reservation = budget.reserve(bytes)?;
        Some(Arc::new(Self {
            first_block,
            hashes,
            segment_len,
            layers,
            give_up_at: give_up_at + WAIT_SLACK,
            state: Mutex::new(StreamState {
                staged: (0..layers).map(|_| None).collect(),
                reservation: Some(reservation),
                ..StreamState::default()
            }),
            changed: Condvar::new(),
            feedback: tokio::sync::watch::channel(None).0,
            first_layer: tokio::sync::watch::channel(false).0,
        }))
    }

    pub fn first_block(&self) -> usize {
        self.first_block
    }

    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    pub fn layers(&self) -> usize {
        self.layers
    }

    fn lock(&self) -> MutexGuard<'_, StreamState> {
        // A panic while holding this lock leaves plain data behind: keep using it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sink the pull task reads segments into.
    pub fn sink(self: &Arc<Self>) -> StagingSink {
        StagingSink {
            pull: Arc::clone(self),
            current: Vec::new(),
            segment: 0,
        }
    }

    /// The pull ended (`report`; `feedback` for the router): wakes the compute loop, which
    /// keeps what arrived.
    pub fn end(&self, report: LayerPullReport, feedback: PullFeedback) {
        let mut st = self.lock();
        st.ended = Some(report);
        drop(st);
        self.changed.notify_all();
        self.first_layer.send_replace(true);
        self.feedback.send_replace(Some(feedback));
    }

    /// Waits until layer 0 arrived or the pull ended (at most until the compute loop would give
    /// up), then says how many blocks the producer serves: every layer brings the same leading
    /// run, so a `MISS` in the middle of the prefix shows here, before the request is scheduled.
    pub async fn served_blocks(&self) -> usize {
        let mut rx = self.first_layer.subscribe();
        let until = tokio::time::Instant::from_std(self.give_up_at);
        let _ = tokio::time::timeout_at(until, rx.wait_for(|landed| *landed)).await;
        self.lock().served.unwrap_or(0)
    }

    /// Blocks each arrived layer covers (0 before layer 0 arrived).
    pub fn served(&self) -> usize {
        self.lock().served.unwrap_or(0)
    }

    /// What the router is told about this pull, once it ended (at most by the deadline the
    /// compute loop gives up at; `None` past it).
    pub async fn feedback(&self) -> Option<PullFeedback> {
        let mut rx = self.feedback.subscribe();
        let until = tokio::time::Instant::from_std(self.give_up_at);
        let ended = tokio::time::timeout_at(until, rx.wait_for(Option::is_some)).await;
        ended.ok()?.ok()?.clone()
    }

    /// Blocks until layer `layer` has arrived (or the stream ended, or its time is up), then
    /// copies it into the first of `blocks` (the arena blocks of prompt blocks
    /// `first_block..`), layer `layer`'s run of each. Runs on the compute thread, which is
    /// where a layer-pipelined step is meant to wait.
    pub fn load_layer(&self, layer: usize, blocks: &[BlockId], arena: &mut KvArena) -> LayerLoad {
        let mut st = self.lock();
        while st.arrived <= layer && st.ended.is_none() {
            let now = Instant::now();
            if now >= self.give_up_at {
                return LayerLoad::Missing;
            }
            st = match self.changed.wait_timeout(st, self.give_up_at - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        let served = st.served.unwrap_or(0);
        let Some(buf) = st.staged.get_mut(layer).and_then(Option::take) else {
            return LayerLoad::Missing;
        };
        let n = served.min(blocks.len());
        if st.copied_layers == layer {
            st.copied_blocks = if layer == 0 {
                n
            } else {
                st.copied_blocks.min(n)
            };
            st.copied_layers += 1;
        }
        drop(st);
        let seg = self.segment_len;
        for (b, &id) in blocks.iter().take(n).enumerate() {
            let dst = &mut arena.block_mut(id)[layer * seg..(layer + 1) * seg];
            dst.copy_from_slice(&buf[b * seg..(b + 1) * seg]);
        }
        LayerLoad::Copied(n)
    }

    /// Leading blocks whose every layer was copied into the arena: what the request may keep.
    pub fn complete_blocks(&self) -> usize {
        let st = self.lock();
        if st.copied_layers >= self.layers {
            st.copied_blocks
        } else {
            0
        }
    }

    /// Frees the staging (the budget gets its bytes back); the pull may still be running, and
    /// stops at the next segment.
    pub fn release(&self) {
        let mut st = self.lock();
        st.staged.iter_mut().for_each(|s| *s = None);
        st.reservation = None;
    }

    /// The pull's report, once it ended.
    pub fn report(&self) -> Option<LayerPullReport> {
        self.lock().ended.clone()
    }
}

/// [`SegmentSink`] of a [`LayeredPull`]: each segment (one layer of every served block) is read
/// into a buffer of its own, handed to the compute loop whole when it completes.
pub struct StagingSink {
    pull: Arc<LayeredPull>,
    current: Vec<u8>,
    segment: usize,
}

impl SegmentSink for StagingSink {
    fn destination(&mut self, index: usize, segment: usize, len: usize) -> Option<&mut [u8]> {
        let p = &self.pull;
        if len != p.segment_len || index >= p.hashes.len() || segment >= p.layers {
            return None;
        }
        if segment != self.segment {
            self.segment = segment;
            self.current.clear();
        }
        if self.current.is_empty() {
            // Released (the request went away): stop the pull.
            p.lock().reservation.as_ref()?;
            self.current = vec![0u8; p.hashes.len() * len];
        }
        self.current.get_mut(index * len..(index + 1) * len)
    }

    fn segment_complete(&mut self, segment: usize, blocks: usize) {
        let mut buf = std::mem::take(&mut self.current);
        buf.truncate(blocks * self.pull.segment_len);
        let mut st = self.pull.lock();
        if st.reservation.is_some()
            && let Some(slot) = st.staged.get_mut(segment)
        {
            *slot = Some(buf);
        }
        st.served.get_or_insert(blocks);
        st.arrived = st.arrived.max(segment + 1);
        drop(st);
        self.pull.changed.notify_all();
        self.pull.first_layer.send_replace(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pull(blocks: usize, layers: usize, seg: usize) -> (Arc<LayeredPull>, Arc<StagingBudget>) {
        let budget = StagingBudget::new(1 << 20);
        let hashes = (0..blocks as u64).map(BlockHash).collect();
        let give_up = Instant::now() + Duration::from_millis(200);
        let p = LayeredPull::new(3, hashes, layers, seg, &budget, give_up).unwrap();
        (p, budget)
    }

    fn feed(sink: &mut StagingSink, segment: usize, blocks: usize, fill: u8) {
        for b in 0..blocks {
            let dst = sink.destination(b, segment, 4).unwrap();
            dst.fill(fill + b as u8);
        }
        sink.segment_complete(segment, blocks);
    }

    #[test]
    fn each_layer_lands_in_its_own_run_of_each_block() {
        let (p, _) = pull(2, 2, 4);
        let mut sink = p.sink();
        let mut arena = KvArena::new(4, 8);
        feed(&mut sink, 0, 2, 10);
        assert_eq!(p.load_layer(0, &[2, 1], &mut arena), LayerLoad::Copied(2));
        assert_eq!(&arena.block(2)[..4], &[10; 4]);
        assert_eq!(&arena.block(1)[..4], &[11; 4]);
        assert_eq!(p.complete_blocks(), 0, "layer 1 is still on the wire");
        feed(&mut sink, 1, 2, 20);
        assert_eq!(p.load_layer(1, &[2, 1], &mut arena), LayerLoad::Copied(2));
        assert_eq!(&arena.block(2)[4..8], &[20; 4]);
        assert_eq!(&arena.block(1)[4..8], &[21; 4]);
        assert_eq!(p.complete_blocks(), 2);
    }

    #[test]
    fn a_layer_waits_for_its_segment_and_not_for_later_ones() {
        let (p, _) = pull(1, 3, 4);
        let mut sink = p.sink();
        let waiter = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                let mut arena = KvArena::new(1, 16);
                p.load_layer(0, &[0], &mut arena)
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        feed(&mut sink, 0, 1, 1);
        assert_eq!(waiter.join().unwrap(), LayerLoad::Copied(1));
    }

    #[test]
    fn a_stream_that_ends_mid_layer_leaves_no_complete_block() {
        let (p, _) = pull(2, 3, 4);
        let mut sink = p.sink();
        let mut arena = KvArena::new(2, 16);
        feed(&mut sink, 0, 2, 1);
        // Layer 1 half written, then the peer goes away.
        sink.destination(0, 1, 4).unwrap();
        p.end(
            LayerPullReport {
                outcome: kvmesh_transfer::PullOutcome::Failed {
                    reason: kvmesh_transfer::PullReason::PeerClosed,
                },
                blocks: 0,
                segments: 1,
                segment_blocks: 2,
                bytes: 8,
                duration: Duration::ZERO,
            },
            PullFeedback {
                outcome: kvmesh_core::PullFeedbackOutcome::Failed,
                reason: Some("peer_closed".into()),
                reached_tokens: 0,
                readable_tokens: 32,
                block_size: 16,
                elapsed_ms: 1.0,
                deadline_ms: 200.0,
            },
        );
        assert_eq!(p.load_layer(0, &[0, 1], &mut arena), LayerLoad::Copied(2));
        assert_eq!(p.load_layer(1, &[0, 1], &mut arena), LayerLoad::Missing);
        assert_eq!(p.complete_blocks(), 0);
    }

    #[test]
    fn a_miss_mid_prefix_keeps_the_served_blocks() {
        let (p, _) = pull(4, 2, 4);
        let mut sink = p.sink();
        let mut arena = KvArena::new(4, 16);
        feed(&mut sink, 0, 3, 1);
        feed(&mut sink, 1, 3, 5);
        assert_eq!(
            p.load_layer(0, &[0, 1, 2, 3], &mut arena),
            LayerLoad::Copied(3)
        );
        assert_eq!(
            p.load_layer(1, &[0, 1, 2, 3], &mut arena),
            LayerLoad::Copied(3)
        );
        assert_eq!(p.complete_blocks(), 3);
    }

    #[test]
    fn a_silent_stream_is_given_up_at_its_deadline() {
        let budget = StagingBudget::new(1 << 20);
        let p = LayeredPull::new(0, vec![BlockHash(1)], 2, 4, &budget, Instant::now()).unwrap();
        let mut arena = KvArena::new(1, 16);
        let t = Instant::now();
        assert_eq!(p.load_layer(0, &[0], &mut arena), LayerLoad::Missing);
        assert!(t.elapsed() >= WAIT_SLACK - Duration::from_millis(50));
    }

    #[test]
    fn a_layer_that_arrives_after_the_step_gave_up_on_it_does_not_count() {
        let budget = StagingBudget::new(1 << 20);
        let p = LayeredPull::new(0, vec![BlockHash(1)], 2, 4, &budget, Instant::now()).unwrap();
        let mut sink = p.sink();
        let mut arena = KvArena::new(1, 16);
        feed(&mut sink, 0, 1, 1);
        assert_eq!(p.load_layer(0, &[0], &mut arena), LayerLoad::Copied(1));
        assert_eq!(p.load_layer(1, &[0], &mut arena), LayerLoad::Missing);
        feed(&mut sink, 1, 1, 2);
        assert_eq!(p.complete_blocks(), 0, "layer 1 is not in the arena");
    }

    #[test]
    fn staging_is_bounded_and_given_back() {
        let budget = StagingBudget::new(100);
        let give_up = Instant::now();
        let hashes = |n: u64| (0..n).map(BlockHash).collect::<Vec<_>>();
        let a = LayeredPull::new(0, hashes(3), 2, 10, &budget, give_up).unwrap();
        assert_eq!(budget.used(), 60);
        assert!(
            LayeredPull::new(0, hashes(3), 2, 10, &budget, give_up).is_none(),
            "120 bytes past a 100-byte budget"
        );
        a.release();
        assert_eq!(budget.used(), 0);
        assert!(LayeredPull::new(0, hashes(3), 2, 10, &budget, give_up).is_some());
        let huge = LayeredPull::new(0, hashes(3), usize::MAX, 10, &budget, give_up);
        assert!(
            huge.is_none(),
            "an overflowing size is refused, not wrapped"
        );
    }

    #[test]
    fn a_released_pull_stops_taking_segments() {
        let (p, budget) = pull(2, 2, 4);
        let mut sink = p.sink();
        p.release();
        assert!(sink.destination(0, 0, 4).is_none());
        assert_eq!(budget.used(), 0);
    }
}
