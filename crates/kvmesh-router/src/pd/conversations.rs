//! The P/D route's memory: decoders' returned `kv_transfer_params` per conversation (single use,
//! TTL-bounded, so the next turn's prefill leg reads the history from the decoder that holds it),
//! and the P/D metrics. [`ConversationCache`] is the pure part (the clock is an argument).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvmesh_core::KvTransferParams;
use kvmesh_sched::Scheduler;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::config::error::ConfigError;
use crate::pd::config::PdConfig;

/// Result of a conversation-cache lookup.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    Hit(Box<KvTransferParams>),
    Miss,
    Expired,
}

/// Decoder params per conversation: single use, TTL-bounded (pure; clock passed in).
#[derive(Debug, Default)]
pub struct ConversationCache {
    map: HashMap<String, (KvTransferParams, Instant)>,
    evicted_stale: u64,
}

impl ConversationCache {
    pub fn store(&mut self, key: String, params: KvTransferParams, now: Instant, ttl: Duration) {
        self.evict_stale(now, ttl);
        self.map.insert(key, (params, now));
    }

    /// Takes the entry (single use); an entry older than `ttl` is dropped and reported expired.
    pub fn take(&mut self, key: &str, now: Instant, ttl: Duration) -> Lookup {
        match self.map.remove(key) {
            None => Lookup::Miss,
            Some((_, at)) if now.saturating_duration_since(at) >= ttl => {
                self.evicted_stale += 1;
                Lookup::Expired
            }
            Some((p, _)) => Lookup::Hit(Box::new(p)),
        }
    }

    fn evict_stale(&mut self, now: Instant, ttl: Duration) {
        let before = self.map.len();
        self.map
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        self.evicted_stale += (before - self.map.len()) as u64;
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn evicted_stale(&self) -> u64 {
        self.evicted_stale
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LegLabel {
    pub leg: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConvLabel {
    pub result: &'static str,
}

/// The router's P/D state.
pub struct PdRouter {
    pub config: PdConfig,
    conversations: Mutex<ConversationCache>,
    pub legs: Family<LegLabel, Counter>,
    pub conversation_lookups: Family<ConvLabel, Counter>,
    pub cached_conversations: Gauge,
}

impl PdRouter {
    pub fn new(
        config: PdConfig,
        scheduler: &Scheduler,
        registry: &mut Registry,
    ) -> Result<Self, ConfigError> {
        config.validate(scheduler)?;
        let r = PdRouter {
            config,
            conversations: Mutex::new(ConversationCache::default()),
            legs: Family::default(),
            conversation_lookups: Family::default(),
            cached_conversations: Gauge::default(),
        };
        registry.register(
            "kvmesh_router_pd_legs",
            "P/D legs by leg (prefill, decode, decode_only) and outcome",
            r.legs.clone(),
        );
        registry.register(
            "kvmesh_router_pd_conversations",
            "Conversation-cache lookups and stores by result (hit, miss, expired, stored)",
            r.conversation_lookups.clone(),
        );
        registry.register(
            "kvmesh_router_pd_cached_conversations",
            "Conversations with cached decoder params",
            r.cached_conversations.clone(),
        );
        Ok(r)
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs_f64(self.config.conversation_ttl_s)
    }

    pub(crate) fn leg(&self, leg: &'static str, outcome: &'static str) {
        self.legs.get_or_create(&LegLabel { leg, outcome }).inc();
    }

    fn conv(&self, result: &'static str) {
        self.conversation_lookups
            .get_or_create(&ConvLabel { result })
            .inc();
    }

    pub fn take(&self, key: &str) -> Option<KvTransferParams> {
        let (r, n) = {
            let mut c = self.conversations.lock();
            let r = c.take(key, Instant::now(), self.ttl());
            (r, c.len())
        };
        self.cached_conversations.set(n as i64);
        match r {
            Lookup::Hit(p) => {
                self.conv("hit");
                Some(*p)
            }
            Lookup::Miss => {
                self.conv("miss");
                None
            }
            Lookup::Expired => {
                self.conv("expired");
                None
            }
        }
    }

    pub fn store(&self, key: String, params: KvTransferParams) {
        let n = {
            let mut c = self.conversations.lock();
            c.store(key, params, Instant::now(), self.ttl());
            c.len()
        };
        self.cached_conversations.set(n as i64);
        self.conv("stored");
    }

    /// `(cached_conversations, evicted_stale)` for `/health`, after evicting stale entries.
    pub fn health(&self) -> (usize, u64) {
        let mut c = self.conversations.lock();
        c.evict_stale(Instant::now(), self.ttl());
        (c.len(), c.evicted_stale())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversation_cache_is_single_use_and_expires() {
        let mut c = ConversationCache::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(450);
        let p = KvTransferParams {
            remote_num_tokens: Some(7),
            ..Default::default()
        };
        c.store("a".into(), p.clone(), t0, ttl);
        assert_eq!(
            c.take("a", t0 + Duration::from_secs(1), ttl),
            Lookup::Hit(Box::new(p.clone()))
        );
        assert_eq!(c.take("a", t0, ttl), Lookup::Miss, "single use");
        c.store("b".into(), p.clone(), t0, ttl);
        assert_eq!(c.take("b", t0 + ttl, ttl), Lookup::Expired);
        c.store("c".into(), p, t0, ttl);
        c.evict_stale(t0 + ttl * 2, ttl);
        assert!(c.is_empty());
        assert_eq!(c.evicted_stale(), 2);
    }
}
