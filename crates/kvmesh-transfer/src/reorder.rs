//! In-order delivery for a striped pull: blocks arrive out of order over several connections,
//! the sink still sees them in prefix order, and a gap ends the prefix.
//!
//! A pull striped over `k` connections gives stripe `s` the blocks `s, s + k, s + 2k, …`. Each
//! stripe's blocks arrive in order, but one stripe may run ahead of another. [`Reorder`] keeps the
//! blocks that arrived ahead of the next one the sink needs, hands each run to the sink as soon as
//! it is contiguous, and bounds how far ahead a stripe may read ([`Reorder::admits`]: at most a
//! `window` of blocks beyond the next undelivered one, so the memory it holds is bounded). When a
//! stripe fails at block `g` (its connection died, the producer missed it, the sink refused it) the
//! prefix ends at `g`: blocks before it still count, blocks after it are dropped, and every stripe
//! whose next block is beyond the gap stops. [`StripeWindow`] wraps it for the stripes' concurrent
//! futures (one lock, never held across an await, and a notification when the window moves).

use std::collections::BTreeMap;

use bytes::Bytes;
use kvmesh_core::BlockHash;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::report::{Progress, PullReason};
use crate::source::BlockSink;

/// May a stripe read its block `g` now?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// Beyond the window: wait until the blocks before it are delivered.
    Wait,
    /// The prefix already ends at or before `g`: the stripe has nothing left to contribute.
    Stop,
}

/// Reorder state of one striped pull (pure: no I/O, no clock).
#[derive(Debug)]
pub struct Reorder {
    window: usize,
    /// Blocks the sink accepted: indices `0..next`.
    next: usize,
    /// Payload bytes the sink accepted.
    bytes: u64,
    early: BTreeMap<usize, (BlockHash, Bytes)>,
    /// Where the prefix ends and why (the smallest failed index).
    gap: Option<(usize, PullReason)>,
}

impl Reorder {
    pub fn new(window: usize) -> Self {
        Self {
            window: window.max(1),
            next: 0,
            bytes: 0,
            early: BTreeMap::new(),
            gap: None,
        }
    }

    /// Blocks delivered to the sink (the leading contiguous run).
    pub fn delivered(&self) -> usize {
        self.next
    }

    pub fn delivered_bytes(&self) -> u64 {
        self.bytes
    }

    /// Where the prefix ends and why, if a stripe failed.
    pub fn gap(&self) -> Option<&(usize, PullReason)> {
        self.gap.as_ref()
    }

    /// Blocks held waiting for an earlier one.
    pub fn held(&self) -> usize {
        self.early.len()
    }

    pub fn admits(&self, g: usize) -> Admit {
        if self.gap.as_ref().is_some_and(|(gap, _)| *gap <= g) {
            Admit::Stop
        } else if g < self.next + self.window {
            Admit::Yes
        } else {
            Admit::Wait
        }
    }

    /// The prefix ends at `g` (unless it already ends earlier); blocks held beyond it are dropped.
    pub fn fail(&mut self, g: usize, reason: PullReason) {
        if self.gap.as_ref().is_some_and(|(gap, _)| *gap <= g) {
            return;
        }
        self.early.retain(|&i, _| i < g);
        self.gap = Some((g, reason));
    }

    /// Block `g` arrived: hands it, and every block it makes contiguous, to the sink in order.
    /// Returns the payload sizes delivered now. A refusal by the sink ends the prefix there.
    pub fn arrive(
        &mut self,
        g: usize,
        hash: BlockHash,
        payload: Bytes,
        sink: &mut dyn BlockSink,
    ) -> Vec<usize> {
        if self.admits(g) == Admit::Stop || g < self.next {
            return Vec::new();
        }
        self.early.insert(g, (hash, payload));
        let mut delivered = Vec::new();
        while let Some((hash, payload)) = self.early.remove(&self.next) {
            let len = payload.len();
            if sink.accept(self.next, hash, payload).is_err() {
                self.fail(self.next, PullReason::SinkRejected);
                break;
            }
            self.next += 1;
            self.bytes += len as u64;
            delivered.push(len);
        }
        delivered
    }
}

/// [`Reorder`] shared by the stripes of one pull, with the sink it delivers to and the pull's
/// progress (kept current, so a pull dropped at its deadline still counts what it delivered).
pub struct StripeWindow<'a> {
    state: Mutex<Shared<'a>>,
    moved: Notify,
}

struct Shared<'a> {
    reorder: Reorder,
    sink: &'a mut dyn BlockSink,
    progress: &'a mut Progress,
}

impl<'a> StripeWindow<'a> {
    pub(crate) fn new(
        window: usize,
        sink: &'a mut dyn BlockSink,
        progress: &'a mut Progress,
    ) -> Self {
        Self {
            state: Mutex::new(Shared {
                reorder: Reorder::new(window),
                sink,
                progress,
            }),
            moved: Notify::new(),
        }
    }

    /// Waits until block `g` is within the window; `false` if the prefix ends before it.
    pub async fn admit(&self, g: usize) -> bool {
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            // Registered before the check, so a move between check and await is not missed.
            moved.as_mut().enable();
            match self.state.lock().reorder.admits(g) {
                Admit::Yes => return true,
                Admit::Stop => return false,
                Admit::Wait => {}
            }
            moved.await;
        }
    }

    /// See [`Reorder::arrive`].
    pub fn arrive(&self, g: usize, hash: BlockHash, payload: Bytes) -> Vec<usize> {
        let delivered = {
            let mut state = self.state.lock();
            let Shared {
                reorder,
                sink,
                progress,
            } = &mut *state;
            let delivered = reorder.arrive(g, hash, payload, &mut **sink);
            progress.blocks = reorder.delivered();
            progress.bytes = reorder.delivered_bytes();
            delivered
        };
        self.moved.notify_waiters();
        delivered
    }

    /// See [`Reorder::fail`].
    pub fn fail(&self, g: usize, reason: PullReason) {
        self.state.lock().reorder.fail(g, reason);
        self.moved.notify_waiters();
    }

    /// Where the prefix ends and why, if it does.
    pub fn gap(&self) -> Option<(usize, PullReason)> {
        self.state.lock().reorder.gap().cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{SinkError, VecSink};

    fn b(i: u64) -> (BlockHash, Bytes) {
        (BlockHash(i), Bytes::from(vec![i as u8; 3]))
    }

    #[test]
    fn out_of_order_arrivals_reach_the_sink_in_order() {
        let mut sink = VecSink::default();
        let mut r = Reorder::new(4);
        for g in [1usize, 3, 2] {
            let (h, p) = b(g as u64);
            assert!(
                r.arrive(g, h, p, &mut sink).is_empty(),
                "block 0 is missing"
            );
        }
        assert_eq!(r.held(), 3);
        let (h, p) = b(0);
        assert_eq!(r.arrive(0, h, p, &mut sink), vec![3; 4]);
        let order: Vec<u64> = sink.blocks.iter().map(|(h, _)| h.0).collect();
        assert_eq!(order, [0, 1, 2, 3], "VecSink refuses anything out of order");
        assert_eq!((r.delivered(), r.delivered_bytes(), r.held()), (4, 12, 0));
    }

    #[test]
    fn the_window_bounds_how_far_ahead_a_stripe_reads() {
        let mut sink = VecSink::default();
        let mut r = Reorder::new(2);
        assert_eq!(r.admits(1), Admit::Yes);
        assert_eq!(r.admits(2), Admit::Wait);
        let (h, p) = b(0);
        r.arrive(0, h, p, &mut sink);
        assert_eq!(
            r.admits(2),
            Admit::Yes,
            "the window moved with the delivered prefix"
        );
    }

    #[test]
    fn a_gap_ends_the_prefix_and_stops_stripes_beyond_it() {
        let mut sink = VecSink::default();
        let mut r = Reorder::new(8);
        for g in [0usize, 1, 3, 4] {
            let (h, p) = b(g as u64);
            r.arrive(g, h, p, &mut sink);
        }
        r.fail(2, PullReason::PeerClosed);
        assert_eq!(r.held(), 0, "blocks beyond the gap are dropped");
        assert_eq!(r.admits(5), Admit::Stop);
        assert_eq!(r.admits(1), Admit::Yes);
        // A later, larger gap does not move it; a smaller one does.
        r.fail(6, PullReason::Timeout);
        assert_eq!(r.gap(), Some(&(2, PullReason::PeerClosed)));
        let (h, p) = b(5);
        assert!(r.arrive(5, h, p, &mut sink).is_empty());
        assert_eq!(r.delivered(), 2, "the leading contiguous run");
    }

    #[test]
    fn a_refusing_sink_ends_the_prefix_at_the_refused_block() {
        struct Picky;
        impl BlockSink for Picky {
            fn accept(&mut self, index: usize, _: BlockHash, _: Bytes) -> Result<(), SinkError> {
                if index == 1 {
                    Err(SinkError {
                        index,
                        reason: "no".into(),
                    })
                } else {
                    Ok(())
                }
            }
        }
        let mut r = Reorder::new(8);
        for g in [2usize, 1, 0] {
            let (h, p) = b(g as u64);
            r.arrive(g, h, p, &mut Picky);
        }
        assert_eq!(r.delivered(), 1);
        assert_eq!(r.gap(), Some(&(1, PullReason::SinkRejected)));
        assert_eq!(r.held(), 0);
    }

    #[tokio::test]
    async fn a_waiting_stripe_wakes_when_the_window_moves_or_the_prefix_ends() {
        let mut sink = VecSink::default();
        let mut progress = Progress::default();
        let w = StripeWindow::new(1, &mut sink, &mut progress);
        assert!(w.admit(0).await);
        let waiter = w.admit(1);
        let (h, p) = b(0);
        let (admitted, _) = tokio::join!(waiter, async { w.arrive(0, h, p) });
        assert!(admitted);
        let waiter = w.admit(2);
        let (admitted, ()) = tokio::join!(waiter, async { w.fail(1, PullReason::Miss) });
        assert!(!admitted, "the prefix ended at 1");
        assert_eq!(w.gap(), Some((1, PullReason::Miss)));
        drop(w);
        assert_eq!((progress.blocks, progress.bytes), (1, 3));
    }
}
