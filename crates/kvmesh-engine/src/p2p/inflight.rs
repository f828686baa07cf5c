//! Pulls in flight, by every block they fetch: one pull per prefix at a time.
//!
//! Concurrent requests for one prefix (a burst on a popular prefix) would each move the whole
//! prefix; a later one waits for the first's blocks instead (they become local) and pulls only
//! what is still missing. Every block is a key, not just the first, because a request arriving
//! mid-pull already sees the landed blocks as local: its first missing block is one the pull has
//! not landed yet.
//!
//! A prefetch's pull is background traffic on both ends' modelled links until a request starts
//! waiting for one of its blocks (joining it, or held until it lands): that promotes it to demand
//! for what is left ([`PullClass::Background`]'s `promote` signal).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use kvmesh_core::BlockHash;
use kvmesh_transfer::{PullClass, TrafficClass};
use parking_lot::Mutex;
use tokio::sync::watch;

/// The table of pulls in flight (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct PullsInFlight {
    map: Mutex<HashMap<BlockHash, InflightPull>>,
}

/// One pull in flight, as seen by a request that needs its blocks.
#[derive(Debug, Clone)]
struct InflightPull {
    /// Changes (the sender drops) when the pull ends.
    done: watch::Receiver<()>,
    /// True once a request waits for the pull's blocks: a prefetch's pull then moves the rest
    /// as demand traffic. Demand pulls start true.
    urgent: Arc<watch::Sender<bool>>,
}

impl InflightPull {
    /// A request waits for this pull: make it demand (no-op if it already is).
    fn promote(&self) {
        self.urgent
            .send_if_modified(|urgent| !std::mem::replace(urgent, true));
    }
}

/// Holds a claim on an in-flight pull; dropping it wakes the requests waiting for it.
pub(crate) struct InflightClaim<'a> {
    map: &'a Mutex<HashMap<BlockHash, InflightPull>>,
    keys: Vec<BlockHash>,
    urgent: Arc<watch::Sender<bool>>,
    _done: watch::Sender<()>,
}

impl InflightClaim<'_> {
    /// The class the claimed pull runs in: a background claim (a prefetch) stays background
    /// until a request waiting for its blocks promotes it.
    pub(crate) fn pull_class(&self) -> PullClass {
        if *self.urgent.borrow() {
            PullClass::Demand
        } else {
            PullClass::Background {
                promote: self.urgent.subscribe(),
            }
        }
    }
}

impl Drop for InflightClaim<'_> {
    fn drop(&mut self) {
        let mut map = self.map.lock();
        for key in &self.keys {
            map.remove(key);
        }
        // `_done` drops right after: waiters' `changed()` returns.
    }
}

/// Either we pull (holding the claim) or someone else already is (wait on the receiver).
pub(crate) enum Inflight<'a> {
    Claimed(InflightClaim<'a>),
    Busy(watch::Receiver<()>),
}

impl PullsInFlight {
    /// Claims the blocks `want` (non-empty) for one pull of `class`, unless its first block is
    /// already part of another pull. Blocks further on that another pull holds are left to it
    /// (not re-keyed). A demand caller that finds another pull will wait for it, so that pull is
    /// promoted to demand (a prefetch must not delay the request now waiting for it).
    pub(crate) fn claim(&self, want: &[BlockHash], class: TrafficClass) -> Inflight<'_> {
        let mut map = self.map.lock();
        if let Some(pull) = want.first().and_then(|first| map.get(first)) {
            if class == TrafficClass::Demand {
                pull.promote();
            }
            return Inflight::Busy(pull.done.clone());
        }
        let (tx, rx) = watch::channel(());
        let urgent = Arc::new(watch::Sender::new(class == TrafficClass::Demand));
        let entry = InflightPull {
            done: rx,
            urgent: Arc::clone(&urgent),
        };
        let mut keys = Vec::with_capacity(want.len());
        for &hash in want {
            if let Entry::Vacant(slot) = map.entry(hash) {
                slot.insert(entry.clone());
                keys.push(hash);
            }
        }
        Inflight::Claimed(InflightClaim {
            map: &self.map,
            keys,
            urgent,
            _done: tx,
        })
    }

    /// Whether the pull in flight holding `hash` (if any) still runs as background traffic.
    #[cfg(test)]
    fn is_background(&self, hash: BlockHash) -> Option<bool> {
        self.map.lock().get(&hash).map(|p| !*p.urgent.borrow())
    }

    /// Waits (until `deadline` at most) while any of `hashes` belongs to a pull in flight, which
    /// a request waiting for it makes demand traffic (a prefetch's pull is promoted).
    pub(crate) async fn wait_for(&self, hashes: &[BlockHash], deadline: tokio::time::Instant) {
        loop {
            let busy = {
                let map = self.map.lock();
                hashes.iter().find_map(|h| map.get(h).cloned())
            };
            let Some(pull) = busy else {
                return;
            };
            pull.promote();
            let mut rx = pull.done;
            // Err from `changed` is the claim's drop (the pull ended): look again.
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return;
            }
        }
    }

    /// Blocks being pulled right now: 0 when no pull is in flight.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const D: TrafficClass = TrafficClass::Demand;
    const B: TrafficClass = TrafficClass::Background;

    #[test]
    fn a_request_arriving_mid_pull_waits_for_the_blocks_still_on_the_wire() {
        let pulls = PullsInFlight::default();
        let prefix: Vec<BlockHash> = (1..=256).map(BlockHash).collect();
        let Inflight::Claimed(first) = pulls.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        // 7 blocks have landed: a second request's first missing block is the 8th.
        assert!(matches!(pulls.claim(&prefix[7..], D), Inflight::Busy(_)));
        // A prefix the pull does not cover is pulled independently.
        assert!(matches!(
            pulls.claim(&[BlockHash(1000), BlockHash(1001)], D),
            Inflight::Claimed(_)
        ));
        drop(first);
        assert_eq!(pulls.len(), 0, "a finished pull releases all its blocks");
        assert!(matches!(pulls.claim(&prefix[7..], D), Inflight::Claimed(_)));
    }

    /// A prefetch's pull stays background while only other prefetches meet it, and becomes
    /// demand the moment a request joins it; its pull class follows.
    #[tokio::test]
    async fn a_request_joining_a_prefetch_promotes_its_pull() {
        let pulls = PullsInFlight::default();
        let prefix: Vec<BlockHash> = (1..=64).map(BlockHash).collect();
        let Inflight::Claimed(prefetch) = pulls.claim(&prefix, B) else {
            panic!("nothing was in flight");
        };
        let PullClass::Background { mut promote } = prefetch.pull_class() else {
            panic!("a prefetch's pull is background");
        };
        assert_eq!(pulls.is_background(prefix[10]), Some(true));
        // Another prefetch of the same history waits for it without promoting it.
        assert!(matches!(pulls.claim(&prefix[3..], B), Inflight::Busy(_)));
        assert!(!*promote.borrow_and_update());
        // A request whose first missing block is in it joins, and promotes it.
        assert!(matches!(pulls.claim(&prefix[5..], D), Inflight::Busy(_)));
        assert!(*promote.borrow_and_update(), "joined but not promoted");
        assert_eq!(pulls.is_background(prefix[10]), Some(false));
        assert!(matches!(prefetch.pull_class(), PullClass::Demand));
        drop(prefetch);
        assert_eq!(pulls.is_background(prefix[10]), None);

        // A request held until a prefetch's blocks land (the sim's local-hit wait) promotes it.
        let Inflight::Claimed(prefetch) = pulls.claim(&prefix, B) else {
            panic!("nothing was in flight");
        };
        let soon = tokio::time::Instant::now() + Duration::from_millis(10);
        pulls.wait_for(&prefix[40..41], soon).await;
        assert!(matches!(prefetch.pull_class(), PullClass::Demand));
        // A demand claim is demand from the start.
        drop(prefetch);
        let Inflight::Claimed(demand) = pulls.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        assert!(matches!(demand.pull_class(), PullClass::Demand));
    }

    #[tokio::test]
    async fn a_request_using_blocks_of_a_pull_in_flight_waits_until_the_pull_ends() {
        let pulls = PullsInFlight::default();
        let prefix: Vec<BlockHash> = (1..=16).map(BlockHash).collect();
        let far = tokio::time::Instant::now() + Duration::from_secs(30);
        // Blocks nobody is pulling: no wait.
        tokio::time::timeout(
            Duration::from_secs(5),
            pulls.wait_for(&[BlockHash(99)], far),
        )
        .await
        .expect("waited on blocks no pull holds");
        let Inflight::Claimed(pull) = pulls.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        let wait = pulls.wait_for(&prefix[3..5], far);
        tokio::pin!(wait);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut wait)
                .await
                .is_err(),
            "returned while the pull was still in flight"
        );
        drop(pull);
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("the pull ended, the wait did not");
        // A pull that never ends holds a request no longer than its deadline.
        let Inflight::Claimed(_stuck) = pulls.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        tokio::time::timeout(Duration::from_secs(5), pulls.wait_for(&prefix, soon))
            .await
            .expect("waited past its deadline");
    }
}
