//! A cap on how fast one endpoint may announce stored blocks: a token bucket over block hashes,
//! with the clock passed in (no I/O).
//!
//! Why: what an engine can store is bounded by what it can compute or receive. The fastest
//! profile kvmesh models (an H200) prefills ~30K tokens/s and lands pulls at ~60K tokens/s, about
//! 6K blocks of 16 tokens per second, each stored at most twice (GPU, then CPU tier): ~12K
//! blocks/s. A stream announcing millions per second is not an engine (issue 37: 10 M blocks in
//! 7 s), and each announced block costs the router a hash and a table insert. The default cap,
//! 100,000 blocks/s with a burst of 10 s of it, leaves an order of magnitude for larger nodes and
//! for a router catching up on a replay ring; a `sim` engine run at `--time-scale` above ~10 may
//! need more (`index.max_blocks_per_second`).

use std::time::Instant;

/// Default [`StoreRate`] cap, in block hashes per second per endpoint.
pub const DEFAULT_MAX_BLOCKS_PER_SECOND: u64 = 100_000;
/// The bucket holds this many seconds of the rate (the burst a stream may send at once).
pub const BURST_SECONDS: u64 = 10;

/// A token bucket of block hashes.
#[derive(Debug, Clone)]
pub struct StoreRate {
    per_second: f64,
    burst: f64,
    tokens: f64,
    last: Option<Instant>,
}

impl StoreRate {
    /// `per_second` blocks per second, bursts of [`BURST_SECONDS`] of it; starts full.
    pub fn new(per_second: u64) -> StoreRate {
        let per_second = per_second.max(1) as f64;
        let burst = per_second * BURST_SECONDS as f64;
        StoreRate {
            per_second,
            burst,
            tokens: burst,
            last: None,
        }
    }

    /// Takes `blocks` tokens at `now` if the bucket holds them; a refused announcement takes none
    /// (it is skipped whole, so the index under-estimates rather than keying half a run).
    pub fn admit(&mut self, blocks: usize, now: Instant) -> bool {
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.per_second).min(self.burst);
        }
        self.last = Some(now);
        let want = blocks as f64;
        if want > self.tokens {
            return false;
        }
        self.tokens -= want;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_passes_then_the_rate_holds() {
        let t0 = Instant::now();
        let mut r = StoreRate::new(1000);
        assert!(r.admit(10_000, t0), "a full burst");
        assert!(!r.admit(1, t0), "nothing left");
        assert!(!r.admit(600, t0 + Duration::from_millis(500)), "500 earned");
        assert!(
            r.admit(1000, t0 + Duration::from_millis(1000)),
            "refusals took nothing"
        );
        // An hour idle refills only the burst.
        assert!(r.admit(10_000, t0 + Duration::from_secs(3600)));
        assert!(!r.admit(10, t0 + Duration::from_secs(3600)));
    }

    #[test]
    fn a_flood_is_held_to_the_rate() {
        let t0 = Instant::now();
        let mut r = StoreRate::new(100_000);
        let mut admitted = 0usize;
        // 10 M blocks offered over 7 s in events of 4096 (the flood).
        for i in 0..(10_000_000 / 4096) {
            let now = t0 + Duration::from_secs_f64(7.0 * i as f64 / (10_000_000.0 / 4096.0));
            if r.admit(4096, now) {
                admitted += 4096;
            }
        }
        // Burst (1 M) + 7 s at 100K/s = 1.7 M at most.
        assert!(admitted <= 1_700_000 + 4096, "{admitted}");
        assert!(admitted >= 1_600_000, "{admitted}");
    }
}
