//! The host-to-device copy engine of a time-modelled backend: restores from the CPU tier queue
//! on one DMA engine beside compute, as vLLM's offloading connector loads on its own CUDA
//! stream. A copy delays only the requests whose blocks it carries (they wait, admitted, until
//! their blocks land). Copies a request waits for (demand) share the host link by queueing FIFO
//! behind each other; copies made ahead of a request (a prefetch's restore ahead) run only
//! while no demand copy is queued, and a demand copy issued meanwhile goes first (preempt and
//! resume), because a prefetch must never delay other work. Plain data with the clock passed
//! in, so the loop's timing is testable.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};
use kvmesh_core::BlockHash;

/// Whether a request is waiting for a copy, or the copy is made ahead of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CopyClass {
    /// A request waits for these blocks: first on the link.
    Demand,
    /// Restored ahead of a predicted request: uses the link only when no demand copy waits.
    Ahead,
}

/// Copies queued on the host-to-device link and when each block they carry lands.
#[derive(Debug, Default)]
pub(super) struct CopyEngine {
    /// When the last queued demand copy finishes.
    demand_free_at: Option<Instant>,
    /// When the last queued copy of either class finishes (the link is idle from then on).
    free_at: Option<Instant>,
    /// Blocks still in flight and when each lands.
    landing: HashMap<BlockHash, Instant>,
    /// Demand copies in completion order (FIFO: completion times never decrease), with their
    /// durations.
    demand: VecDeque<(Instant, Duration, Vec<BlockHash>)>,
    /// Copies ahead in completion order (FIFO among themselves; every demand copy pushes the
    /// ones not yet done back by its duration, which keeps the order), with their durations.
    ahead: VecDeque<(Instant, Duration, Vec<BlockHash>)>,
}

impl CopyEngine {
    /// Queues a copy of `hashes` taking `duration` on the link and returns when the blocks
    /// land. A demand copy starts when the demand copies ahead of it are done (or now) and
    /// delays every copy ahead still running by its duration; a copy ahead starts when all
    /// queued work is done.
    pub(super) fn enqueue(
        &mut self,
        now: Instant,
        duration: Duration,
        hashes: Vec<BlockHash>,
        class: CopyClass,
    ) -> Instant {
        self.forget_landed(now);
        let done = match class {
            CopyClass::Demand => {
                let start = self.demand_free_at.map_or(now, |t| t.max(now));
                let done = start + duration;
                self.demand_free_at = Some(done);
                // Preempt-resume on one link: every lower-class copy that would still be
                // moving at `start` finishes exactly `duration` later.
                for (t, _, blocks) in self.ahead.iter_mut() {
                    if *t > start {
                        let old = *t;
                        *t = old + duration;
                        for h in blocks.iter() {
                            if let Some(at) = self.landing.get_mut(h)
                                && *at == old
                            {
                                *at = old + duration;
                            }
                        }
                    }
                }
                let last_ahead = self.ahead.back().map(|(t, _, _)| *t);
                self.free_at = Some(last_ahead.map_or(done, |t| t.max(done)));
                done
            }
            CopyClass::Ahead => {
                let start = self.free_at.map_or(now, |t| t.max(now));
                let done = start + duration;
                self.free_at = Some(done);
                done
            }
        };
        if !hashes.is_empty() {
            for &h in &hashes {
                self.landing.insert(h, done);
            }
            match class {
                CopyClass::Demand => self.demand.push_back((done, duration, hashes)),
                CopyClass::Ahead => self.ahead.push_back((done, duration, hashes)),
            }
        }
        done
    }

    /// When the last of `hashes` still in flight lands, for a request that now waits for them;
    /// `None` when all of them are usable now. A copy ahead carrying any of them becomes a
    /// demand copy for what is left of it: a request waits for it now.
    pub(super) fn ready_at(&mut self, now: Instant, hashes: &[BlockHash]) -> Option<Instant> {
        self.forget_landed(now);
        if self.landing.is_empty() {
            return None;
        }
        if !self.ahead.is_empty() {
            self.promote(now, hashes);
        }
        hashes
            .iter()
            .filter_map(|h| self.landing.get(h).copied())
            .max()
    }

    /// Moves the copies ahead that carry any of `hashes` to the demand class. What is left of
    /// such a copy is taken as the lesser of its duration and its time to landing (an upper
    /// bound when demand copies had preempted it); the copies ahead queued after it keep their
    /// landing times, since the same work still runs before them.
    fn promote(&mut self, now: Instant, hashes: &[BlockHash]) {
        let wanted: HashSet<BlockHash> = hashes
            .iter()
            .filter(|h| self.landing.contains_key(*h))
            .copied()
            .collect();
        if wanted.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.ahead.len() {
            let (done, _, blocks) = &self.ahead[i];
            let carries = blocks
                .iter()
                .any(|h| wanted.contains(h) && self.landing.get(h) == Some(done));
            if !carries {
                i += 1;
                continue;
            }
            let Some((done, duration, blocks)) = self.ahead.remove(i) else {
                break;
            };
            let left = duration.min(done.saturating_duration_since(now));
            // Out of the low class, the copies ahead behind it would finish `left` sooner; the
            // demand copy below pushes them back by as much, since it runs first.
            for (t, _, blocks) in self.ahead.iter_mut().skip(i) {
                let old = *t;
                *t = old.checked_sub(left).map_or(now, |t| t.max(now));
                for h in blocks.iter() {
                    if let Some(at) = self.landing.get_mut(h)
                        && *at == old
                    {
                        *at = *t;
                    }
                }
            }
            let mine: Vec<BlockHash> = blocks
                .into_iter()
                .filter(|h| self.landing.get(h) == Some(&done))
                .collect();
            self.enqueue(now, left, mine, CopyClass::Demand);
        }
    }

    /// Blocks in flight.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.landing.len()
    }

    fn forget_landed(&mut self, now: Instant) {
        for queue in [&mut self.demand, &mut self.ahead] {
            while let Some((done, _, _)) = queue.front() {
                if *done > now {
                    break;
                }
                let Some((done, _, hashes)) = queue.pop_front() else {
                    break;
                };
                for h in hashes {
                    // A block evicted and copied again since is carried by a later copy: keep it.
                    if self.landing.get(&h) == Some(&done) {
                        self.landing.remove(&h);
                    }
                }
            }
        }
        if self.demand_free_at.is_some_and(|t| t <= now) {
            self.demand_free_at = None;
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
        assert_eq!(
            ce.enqueue(t0, ms(10), hashes(0..4), CopyClass::Demand),
            t0 + ms(10)
        );
        assert_eq!(ce.ready_at(t0, &hashes(0..2)), Some(t0 + ms(10)));
        // Blocks the copy does not carry are usable now.
        assert_eq!(ce.ready_at(t0, &hashes(10..12)), None);
    }

    #[test]
    fn concurrent_copies_share_the_link_by_queueing() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        ce.enqueue(t0, ms(10), hashes(0..4), CopyClass::Demand);
        // Issued 2 ms later, it starts when the first is done.
        assert_eq!(
            ce.enqueue(t0 + ms(2), ms(10), hashes(4..8), CopyClass::Demand),
            t0 + ms(20)
        );
        // A request needing blocks of both waits for the later one.
        assert_eq!(ce.ready_at(t0 + ms(2), &hashes(2..6)), Some(t0 + ms(20)));
        // After the first landed, only the second's blocks are in flight.
        assert_eq!(ce.ready_at(t0 + ms(10), &hashes(0..4)), None);
        assert_eq!(ce.in_flight(), 4);
        // Once everything landed the link is idle: a new copy starts at once.
        assert_eq!(ce.ready_at(t0 + ms(25), &hashes(0..8)), None);
        assert_eq!(ce.in_flight(), 0);
        assert_eq!(
            ce.enqueue(t0 + ms(30), ms(5), hashes(8..9), CopyClass::Demand),
            t0 + ms(35)
        );
    }

    #[test]
    fn a_block_copied_again_keeps_its_later_landing() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        ce.enqueue(t0, ms(10), hashes(0..2), CopyClass::Demand);
        // Evicted and restored again (a second copy of block 1) before the first landed.
        ce.enqueue(t0 + ms(1), ms(10), hashes(1..2), CopyClass::Demand);
        assert_eq!(ce.ready_at(t0 + ms(12), &hashes(0..2)), Some(t0 + ms(20)));
    }

    #[test]
    fn a_demand_copy_preempts_a_copy_ahead_and_delays_it_by_its_own_duration() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        // A 100 ms restore ahead is running when a request's 10 ms copy is issued.
        assert_eq!(
            ce.enqueue(t0, ms(100), hashes(0..8), CopyClass::Ahead),
            t0 + ms(100)
        );
        // The request's copy does not wait behind it...
        assert_eq!(
            ce.enqueue(t0 + ms(20), ms(10), hashes(8..9), CopyClass::Demand),
            t0 + ms(30)
        );
        assert_eq!(ce.ready_at(t0 + ms(20), &hashes(8..9)), Some(t0 + ms(30)));
        // ...and the copy ahead resumes after it, 10 ms later than planned.
        assert_eq!(ce.ready_at(t0 + ms(20), &hashes(20..21)), None);
        assert_eq!(ce.landing.get(&BlockHash(0)), Some(&(t0 + ms(110))));
        // A second copy ahead queues behind all of it.
        assert_eq!(
            ce.enqueue(t0 + ms(25), ms(5), hashes(30..31), CopyClass::Ahead),
            t0 + ms(115)
        );
    }

    #[test]
    fn demand_copies_keep_their_fifo_order_among_themselves() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        ce.enqueue(t0, ms(50), hashes(0..2), CopyClass::Ahead);
        assert_eq!(
            ce.enqueue(t0, ms(10), hashes(2..4), CopyClass::Demand),
            t0 + ms(10)
        );
        assert_eq!(
            ce.enqueue(t0 + ms(5), ms(10), hashes(4..6), CopyClass::Demand),
            t0 + ms(20)
        );
        // The copy ahead lost 20 ms to the two demand copies.
        assert_eq!(ce.landing.get(&BlockHash(0)), Some(&(t0 + ms(70))));
        // Once everything landed the link is idle.
        assert_eq!(ce.ready_at(t0 + ms(70), &hashes(0..6)), None);
        assert_eq!(ce.in_flight(), 0);
        assert_eq!(
            ce.enqueue(t0 + ms(80), ms(5), hashes(9..10), CopyClass::Ahead),
            t0 + ms(85)
        );
    }

    #[test]
    fn a_request_waiting_for_a_copy_ahead_makes_it_a_demand_copy() {
        let t0 = Instant::now();
        let mut ce = CopyEngine::default();
        // Two restores ahead queued back to back; a request arrives wanting the second one's
        // blocks while other requests' copies keep the link busy.
        ce.enqueue(t0, ms(40), hashes(0..4), CopyClass::Ahead);
        ce.enqueue(t0, ms(40), hashes(4..8), CopyClass::Ahead);
        ce.enqueue(t0, ms(10), hashes(8..9), CopyClass::Demand);
        // Without promotion blocks 4..8 would land at 90 ms.
        assert_eq!(ce.landing.get(&BlockHash(4)), Some(&(t0 + ms(90))));
        // Waited for at 10 ms: the demand copy it becomes runs next, for at most its 40 ms.
        assert_eq!(ce.ready_at(t0 + ms(10), &hashes(4..8)), Some(t0 + ms(50)));
        // The first restore ahead, still unrequested, yields to it.
        assert_eq!(ce.landing.get(&BlockHash(0)), Some(&(t0 + ms(90))));
        // A copy ahead no request waits for is not promoted by an unrelated lookup.
        assert_eq!(ce.ready_at(t0 + ms(10), &hashes(100..101)), None);
        assert_eq!(ce.landing.get(&BlockHash(0)), Some(&(t0 + ms(90))));
    }
}
