//! The host-to-device copy engine of a time-modelled backend: restores from the CPU tier queue
//! on one DMA engine beside compute, as vLLM's offloading connector loads on its own CUDA
//! stream. A copy delays only the requests whose blocks it carries (they wait, admitted, until
//! their blocks land); concurrent restores share the host link by queueing FIFO behind each
//! other. Plain data with the clock passed in, so the loop's timing is testable.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use kvmesh_core::BlockHash;

/// Copies queued on the host-to-device link and when each block they carry lands.
#[derive(Debug, Default)]
pub(super) struct CopyEngine {
    /// When the last queued copy finishes (the link is free from then on).
    free_at: Option<Instant>,
    /// Blocks still in flight and when each lands.
    landing: HashMap<BlockHash, Instant>,
    /// The same copies in completion order (FIFO: completion times never decrease), to forget
    /// landed blocks without scanning the map.
    queue: VecDeque<(Instant, Vec<BlockHash>)>,
}

impl CopyEngine {
    /// Queues a copy of `hashes` taking `duration` on the link: it starts when the copies ahead
    /// of it are done (or now) and returns when the blocks land.
    pub(super) fn enqueue(
        &mut self,
        now: Instant,
        duration: Duration,
        hashes: Vec<BlockHash>,
    ) -> Instant {
        self.forget_landed(now);
        let start = self.free_at.map_or(now, |t| t.max(now));
        let done = start + duration;
        self.free_at = Some(done);
        if !hashes.is_empty() {
            for &h in &hashes {
                self.landing.insert(h, done);
            }
            self.queue.push_back((done, hashes));
        }
        done
    }

    /// When the last of `hashes` still in flight lands; `None` when all of them are usable now.
    pub(super) fn ready_at(&mut self, now: Instant, hashes: &[BlockHash]) -> Option<Instant> {
        self.forget_landed(now);
        if self.landing.is_empty() {
            return None;
        }
        hashes
            .iter()
            .filter_map(|h| self.landing.get(h).copied())
            .max()
    }

    /// Blocks in flight.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.landing.len()
    }

    fn forget_landed(&mut self, now: Instant) {
        while let Some((done, _)) = self.queue.front() {
            if *done > now {
                break;
            }
            let Some((done, hashes)) = self.queue.pop_front() else {
                break;
            };
            for h in hashes {
                // A block evicted and copied again since is carried by a later copy: keep it.
                if self.landing.get(&h) == Some(&done) {
                    self.landing.remove(&h);
                }
            }
        }
        if self.free_at.is_some_and(|t| t <= now) {
            self.free_at = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn hashes(range: std::ops::Range<u64>) -> Vec<BlockHash> {
        range.map(BlockHash).collect()
    }

    #[test]
    fn a_copy_on_an_idle_link_lands_after_its_own_duration() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        assert_eq!(ce.enqueue(t0, ms(10), hashes(0..4)), t0 + ms(10));
        assert_eq!(ce.ready_at(t0, &hashes(0..2)), Some(t0 + ms(10)));
        // Blocks the copy does not carry are usable now.
        assert_eq!(ce.ready_at(t0, &hashes(10..12)), None);
    }

    #[test]
    fn concurrent_copies_share_the_link_by_queueing() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        ce.enqueue(t0, ms(10), hashes(0..4));
        // Issued 2 ms later, it starts when the first is done.
        assert_eq!(ce.enqueue(t0 + ms(2), ms(10), hashes(4..8)), t0 + ms(20));
        // A request needing blocks of both waits for the later one.
        assert_eq!(ce.ready_at(t0 + ms(2), &hashes(2..6)), Some(t0 + ms(20)));
        // After the first landed, only the second's blocks are in flight.
        assert_eq!(ce.ready_at(t0 + ms(10), &hashes(0..4)), None);
        assert_eq!(ce.in_flight(), 4);
        // Once everything landed the link is idle: a new copy starts at once.
        assert_eq!(ce.ready_at(t0 + ms(25), &hashes(0..8)), None);
        assert_eq!(ce.in_flight(), 0);
        assert_eq!(ce.enqueue(t0 + ms(30), ms(5), hashes(8..9)), t0 + ms(35));
    }

    #[test]
    fn a_block_copied_again_keeps_its_later_landing() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        ce.enqueue(t0, ms(10), hashes(0..2));
        // Evicted and restored again (a second copy of block 1) before the first landed.
        ce.enqueue(t0 + ms(1), ms(10), hashes(1..2));
        assert_eq!(ce.ready_at(t0 + ms(12), &hashes(0..2)), Some(t0 + ms(20)));
    }
}
