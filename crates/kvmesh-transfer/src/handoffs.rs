//! The P/D hand-off ledger: which reader (`remote_request_id`) each retained block was kept for,
//! shared by what retains blocks (the kvmesh engine's P/D hook, the vLLM connector's worker) and
//! the `BlockSource` the producer serves them from (its `served`), so that only
//! that reader's fetch releases the retention: any other peer reading the same block leaves it
//! held (before, any client's read freed blocks kept for a decoder).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::time::Instant;

use kvmesh_core::BlockHash;

/// Most P/D hand-offs remembered at once; beyond it (after dropping expired ones) a new one is
/// not recorded and its retention simply runs to its expiry.
const MAX_HANDOFFS: usize = 65_536;

/// One request's retained blocks, each with the retentions a read by that request may release.
#[derive(Debug)]
struct Handoff {
    blocks: HashMap<BlockHash, usize>,
    expires: Instant,
}

/// Which blocks are retained for which P/D reader (the `remote_request_id` the engine returned).
/// The request id is a key, not a proof: it travels in `kv_transfer_params` (the router's to hand
/// out) and in the reader's `Lookup`; it keeps other peers' reads from freeing what a decoder
/// still needs.
#[derive(Debug, Default)]
pub struct Handoffs {
    map: parking_lot::Mutex<HashMap<String, Handoff>>,
}

impl Handoffs {
    /// Remember that `hashes` hold one retention each for `request_id`, until `expires`.
    pub fn record(&self, request_id: &str, hashes: &[BlockHash], expires: Instant) {
        if request_id.is_empty() || hashes.is_empty() {
            return;
        }
        let mut map = self.map.lock();
        if map.len() >= MAX_HANDOFFS && !map.contains_key(request_id) {
            let now = Instant::now();
            map.retain(|_, h| h.expires > now);
            if map.len() >= MAX_HANDOFFS {
                tracing::debug!(
                    request_id,
                    "p2p: hand-off table full; retention expires unread"
                );
                return;
            }
        }
        let entry = map.entry(request_id.to_owned()).or_insert_with(|| Handoff {
            blocks: HashMap::new(),
            expires,
        });
        entry.expires = entry.expires.max(expires);
        for h in hashes {
            *entry.blocks.entry(*h).or_default() += 1;
        }
    }

    /// Whether `request_id` holds a retention on `hash` it may release now; takes it if so.
    pub fn take(&self, request_id: &str, hash: BlockHash) -> bool {
        if request_id.is_empty() {
            return false;
        }
        let mut map = self.map.lock();
        let Entry::Occupied(mut slot) = map.entry(request_id.to_owned()) else {
            return false;
        };
        if slot.get().expires <= Instant::now() {
            slot.remove();
            return false;
        }
        let handoff = slot.get_mut();
        let taken = match handoff.blocks.get_mut(&hash) {
            Some(n) if *n > 1 => {
                *n -= 1;
                true
            }
            Some(_) => {
                handoff.blocks.remove(&hash);
                true
            }
            None => false,
        };
        if handoff.blocks.is_empty() {
            slot.remove();
        }
        taken
    }

    /// Whether no request has blocks held for it.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.map.lock().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_hand_off_is_released_only_by_its_request_once_per_retention() {
        let h = Handoffs::default();
        let far = Instant::now() + Duration::from_secs(60);
        h.record("r1", &[BlockHash(1), BlockHash(2)], far);
        h.record("r1", &[BlockHash(1)], far); // retained twice for the same reader
        assert!(
            !h.take("evil", BlockHash(1)),
            "another request releases nothing"
        );
        assert!(!h.take("", BlockHash(1)));
        assert!(!h.take("r1", BlockHash(3)), "not retained for r1");
        assert!(h.take("r1", BlockHash(1)));
        assert!(h.take("r1", BlockHash(1)));
        assert!(!h.take("r1", BlockHash(1)), "two retentions, two releases");
        assert!(h.take("r1", BlockHash(2)));
        assert!(h.is_empty(), "a fully read hand-off is forgotten");
        // An expired hand-off releases nothing (its retention already ran out).
        h.record("r2", &[BlockHash(5)], Instant::now());
        assert!(!h.take("r2", BlockHash(5)));
        assert!(h.is_empty());
    }
}
