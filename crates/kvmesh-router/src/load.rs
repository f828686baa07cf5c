//! The router's own in-flight accounting per endpoint.
//!
//! Every forwarded request holds a [`LoadGuard`]; its `Drop` releases what it added, so the counts
//! are right on every path — success, engine error, timeout, client disconnect (the response body,
//! which owns the guard, is dropped) and stream end. Uncached prompt tokens are released as soon as
//! the first byte of the response arrives (prefill is over), decode tokens at the end. A request
//! whose engine pulls its prefix also counts as a transfer into that endpoint and out of the
//! source until its first byte (the pull is over by then): the cost of the next pull over the
//! same links depends on it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Atomic counters; read without locks on the scheduling path.
#[derive(Debug, Default)]
pub struct EndpointLoad {
    requests: AtomicU64,
    uncached_tokens: AtomicU64,
    decode_tokens: AtomicU64,
    pulls_in: AtomicU64,
    pulls_out: AtomicU64,
}

/// A point-in-time copy of [`EndpointLoad`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LoadSnapshot {
    pub requests: u64,
    pub uncached_tokens: u64,
    pub decode_tokens: u64,
    pub pulls_in: u64,
    pub pulls_out: u64,
}

impl EndpointLoad {
    pub fn snapshot(&self) -> LoadSnapshot {
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            uncached_tokens: self.uncached_tokens.load(Ordering::Relaxed),
            decode_tokens: self.decode_tokens.load(Ordering::Relaxed),
            pulls_in: self.pulls_in.load(Ordering::Relaxed),
            pulls_out: self.pulls_out.load(Ordering::Relaxed),
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
            pull_source: None,
        }
    }
}

/// Releases its request's share of [`EndpointLoad`] when dropped.
#[derive(Debug)]
pub struct LoadGuard {
    load: Arc<EndpointLoad>,
    uncached: u64,
    decode: u64,
    /// The source of a pull this request's engine makes, until the pull is over.
    pull_source: Option<Arc<EndpointLoad>>,
}

impl LoadGuard {
    /// Counts a pull from `source` into this request's endpoint until the first byte.
    pub fn track_pull(&mut self, source: &Arc<EndpointLoad>) {
        if self.pull_source.is_some() {
            return;
        }
        self.load.pulls_in.fetch_add(1, Ordering::Relaxed);
        source.pulls_out.fetch_add(1, Ordering::Relaxed);
        self.pull_source = Some(Arc::clone(source));
    }

    fn pull_done(&mut self) {
        if let Some(source) = self.pull_source.take() {
            self.load.pulls_in.fetch_sub(1, Ordering::Relaxed);
            source.pulls_out.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Prefill finished (first byte seen): the uncached tokens are no longer pending work.
    pub fn prefill_done(&mut self) {
        self.load
            .uncached_tokens
            .fetch_sub(std::mem::take(&mut self.uncached), Ordering::Relaxed);
        self.pull_done();
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.pull_done();
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
                decode_tokens: 15,
                ..LoadSnapshot::default()
            }
        );
        g1.prefill_done();
        g1.prefill_done();
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 2,
                uncached_tokens: 50,
                decode_tokens: 15,
                ..LoadSnapshot::default()
            }
        );
        drop(g1);
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 1,
                uncached_tokens: 50,
                decode_tokens: 5,
                ..LoadSnapshot::default()
            }
        );
        drop(g2);
        assert_eq!(load.snapshot(), LoadSnapshot::default());
    }

    #[test]
    fn a_tracked_pull_counts_on_both_ends_until_first_byte_or_drop() {
        let (dest, src) = (
            Arc::new(EndpointLoad::default()),
            Arc::new(EndpointLoad::default()),
        );
        let mut g = dest.acquire(10, 1);
        g.track_pull(&src);
        g.track_pull(&src);
        assert_eq!((dest.snapshot().pulls_in, src.snapshot().pulls_out), (1, 1));
        g.prefill_done();
        assert_eq!((dest.snapshot().pulls_in, src.snapshot().pulls_out), (0, 0));
        let mut g2 = dest.acquire(10, 1);
        g2.track_pull(&src);
        drop(g2);
        drop(g);
        assert_eq!(dest.snapshot(), LoadSnapshot::default());
        assert_eq!(src.snapshot(), LoadSnapshot::default());
    }
}
