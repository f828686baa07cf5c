//! The router's own in-flight accounting per endpoint.
//!
//! Every forwarded request holds a [`LoadGuard`]; its `Drop` releases what it added, so the counts
//! are right on every path — success, engine error, timeout, client disconnect (the response body,
//! which owns the guard, is dropped) and stream end. Uncached prompt tokens are released as soon as
//! the first byte of the response arrives (prefill is over), decode tokens at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Atomic counters; read without locks on the scheduling path.
#[derive(Debug, Default)]
pub struct EndpointLoad {
    requests: AtomicU64,
    uncached_tokens: AtomicU64,
    decode_tokens: AtomicU64,
}

/// A point-in-time copy of [`EndpointLoad`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LoadSnapshot {
    pub requests: u64,
    pub uncached_tokens: u64,
    pub decode_tokens: u64,
}

impl EndpointLoad {
    pub fn snapshot(&self) -> LoadSnapshot {
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            uncached_tokens: self.uncached_tokens.load(Ordering::Relaxed),
            decode_tokens: self.decode_tokens.load(Ordering::Relaxed),
        }
    }

    /// Counts one request with `uncached` prompt tokens to compute and `decode` tokens to generate.
    pub fn acquire(self: &Arc<Self>, uncached: u64, decode: u64) -> LoadGuard {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.uncached_tokens.fetch_add(uncached, Ordering::Relaxed);
        self.decode_tokens.fetch_add(decode, Ordering::Relaxed);
        LoadGuard {
            load: Arc::clone(self),
            uncached,
            decode,
        }
    }
}

/// Releases its request's share of [`EndpointLoad`] when dropped.
#[derive(Debug)]
pub struct LoadGuard {
    load: Arc<EndpointLoad>,
    uncached: u64,
    decode: u64,
}

impl LoadGuard {
    /// Prefill finished (first byte seen): the uncached tokens are no longer pending work.
    pub fn prefill_done(&mut self) {
        self.load
            .uncached_tokens
            .fetch_sub(std::mem::take(&mut self.uncached), Ordering::Relaxed);
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.load.requests.fetch_sub(1, Ordering::Relaxed);
        self.load
            .uncached_tokens
            .fetch_sub(self.uncached, Ordering::Relaxed);
        self.load
            .decode_tokens
            .fetch_sub(self.decode, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_releases_everything_once() {
        let load = Arc::new(EndpointLoad::default());
        let mut g1 = load.acquire(100, 10);
        let g2 = load.acquire(50, 5);
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 2,
                uncached_tokens: 150,
                decode_tokens: 15
            }
        );
        g1.prefill_done();
        g1.prefill_done();
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 2,
                uncached_tokens: 50,
                decode_tokens: 15
            }
        );
        drop(g1);
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 1,
                uncached_tokens: 50,
                decode_tokens: 5
            }
        );
        drop(g2);
        assert_eq!(load.snapshot(), LoadSnapshot::default());
    }
}
