//! The live set of endpoints: specs, ids, health, scraped engine metrics and in-flight load.
//!
//! The list is an `ArcSwap` snapshot: the request path loads it without locks; config reloads
//! swap in a new list. An endpoint keeps its [`EndpointId`] (and index entries, load, learned
//! rates) while its spec is unchanged; a changed spec is a new endpoint with a fresh id, because
//! its KV events describe a different cache.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use arc_swap::ArcSwap;
use kvmesh_index::EndpointId;
use parking_lot::Mutex;
use serde::Serialize;

use crate::config::{EndpointSpec, Role};
use crate::load::EndpointLoad;

/// The `vllm:` gauges the router scrapes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EngineMetrics {
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: f64,
    #[serde(skip)]
    pub scraped_at: Instant,
}

pub struct Endpoint {
    pub id: EndpointId,
    pub name: Arc<str>,
    pub spec: EndpointSpec,
    /// `spec.url` without a trailing slash; request paths are appended.
    pub base_url: String,
    pub load: Arc<EndpointLoad>,
    healthy: AtomicBool,
    fail_streak: AtomicU32,
    ok_streak: AtomicU32,
    metrics: Mutex<Option<EngineMetrics>>,
    /// Requests (and P/D legs) placed here since it was added.
    pub placed: AtomicU64,
    /// Configured with KV events but none arrived while it served requests (see
    /// `RouterState::check_events`).
    pub events_silent: AtomicBool,
}

impl Endpoint {
    pub(crate) fn new(id: EndpointId, spec: EndpointSpec) -> Endpoint {
        Endpoint {
            id,
            name: Arc::from(spec.name.as_str()),
            base_url: spec.url.trim_end_matches('/').to_owned(),
            spec,
            load: Arc::new(EndpointLoad::default()),
            healthy: AtomicBool::new(true),
            fail_streak: AtomicU32::new(0),
            ok_streak: AtomicU32::new(0),
            metrics: Mutex::new(None),
            placed: AtomicU64::new(0),
            events_silent: AtomicBool::new(false),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn serves_aggregated(&self) -> bool {
        self.spec.role == Role::Both
    }

    /// Records a health-check result; returns `Some(new state)` when the endpoint was ejected or
    /// readmitted.
    pub fn record_health(
        &self,
        ok: bool,
        unhealthy_threshold: u32,
        healthy_threshold: u32,
    ) -> Option<bool> {
        if ok {
            self.fail_streak.store(0, Ordering::Relaxed);
            let streak = self.ok_streak.fetch_add(1, Ordering::Relaxed) + 1;
            if !self.is_healthy() && streak >= healthy_threshold.max(1) {
                self.healthy.store(true, Ordering::Relaxed);
                return Some(true);
            }
        } else {
            self.ok_streak.store(0, Ordering::Relaxed);
            let streak = self.fail_streak.fetch_add(1, Ordering::Relaxed) + 1;
            if self.is_healthy() && streak >= unhealthy_threshold.max(1) {
                self.healthy.store(false, Ordering::Relaxed);
                return Some(false);
            }
        }
        None
    }

    /// Takes the endpoint out of placement at once (its engine refused a connection); the health
    /// loop returns it after `healthy_threshold` good checks. Returns whether it was healthy.
    pub fn eject(&self) -> bool {
        self.ok_streak.store(0, Ordering::Relaxed);
        self.healthy.swap(false, Ordering::Relaxed)
    }

    pub fn metrics(&self) -> Option<EngineMetrics> {
        *self.metrics.lock()
    }

    pub fn set_metrics(&self, m: EngineMetrics) {
        *self.metrics.lock() = Some(m);
    }
}

/// What a reload changed.
#[derive(Default)]
pub struct EndpointDiff {
    pub added: Vec<Arc<Endpoint>>,
    pub removed: Vec<Arc<Endpoint>>,
}

pub struct EndpointSet {
    current: ArcSwap<Vec<Arc<Endpoint>>>,
    next_id: AtomicU32,
    /// Serialises reloads (the swap itself is lock-free for readers).
    reload: Mutex<()>,
}

impl Default for EndpointSet {
    fn default() -> Self {
        EndpointSet {
            current: ArcSwap::from_pointee(Vec::new()),
            next_id: AtomicU32::new(0),
            reload: Mutex::new(()),
        }
    }
}

impl EndpointSet {
    pub fn list(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.current.load_full()
    }

    pub fn get(&self, id: EndpointId) -> Option<Arc<Endpoint>> {
        self.current.load().iter().find(|e| e.id == id).cloned()
    }

    /// Replaces the endpoint list with `specs` (already validated), keeping unchanged endpoints.
    pub fn apply(&self, specs: Vec<EndpointSpec>) -> EndpointDiff {
        let _serial = self.reload.lock();
        let old = self.current.load_full();
        let mut by_name: HashMap<&str, &Arc<Endpoint>> =
            old.iter().map(|e| (e.spec.name.as_str(), e)).collect();
        let mut diff = EndpointDiff::default();
        let mut next = Vec::with_capacity(specs.len());
        for spec in specs {
            match by_name.remove(spec.name.as_str()) {
                Some(e) if e.spec == spec => next.push(Arc::clone(e)),
                prev => {
                    if let Some(p) = prev {
                        diff.removed.push(Arc::clone(p));
                    }
                    let id = EndpointId(self.next_id.fetch_add(1, Ordering::Relaxed));
                    let e = Arc::new(Endpoint::new(id, spec));
                    diff.added.push(Arc::clone(&e));
                    next.push(e);
                }
            }
        }
        diff.removed.extend(by_name.into_values().cloned());
        self.current.store(Arc::new(next));
        diff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, port: u16) -> EndpointSpec {
        EndpointSpec {
            name: name.into(),
            url: format!("http://127.0.0.1:{port}/"),
            kv_events: None,
            p2p: None,
            role: Role::Both,
        }
    }

    #[test]
    fn reload_keeps_unchanged_and_renews_changed() {
        let set = EndpointSet::default();
        let d = set.apply(vec![spec("a", 1), spec("b", 2)]);
        assert_eq!(d.added.len(), 2);
        let a_id = set.list()[0].id;
        assert_eq!(
            set.list()[0].url("/v1/models"),
            "http://127.0.0.1:1/v1/models"
        );
        let d = set.apply(vec![spec("a", 1), spec("b", 3), spec("c", 4)]);
        assert_eq!(
            d.added
                .iter()
                .map(|e| e.name.to_string())
                .collect::<Vec<_>>(),
            vec!["b", "c"]
        );
        assert_eq!(d.removed.len(), 1);
        assert_eq!(set.list()[0].id, a_id);
        let d = set.apply(vec![spec("c", 4)]);
        assert_eq!(d.removed.len(), 2);
        assert_eq!(set.list().len(), 1);
    }

    #[test]
    fn health_streaks_eject_and_readmit() {
        let e = Endpoint::new(EndpointId(0), spec("a", 1));
        assert_eq!(e.record_health(false, 2, 2), None);
        assert_eq!(e.record_health(false, 2, 2), Some(false));
        assert!(!e.is_healthy());
        assert_eq!(e.record_health(true, 2, 2), None);
        assert_eq!(e.record_health(true, 2, 2), Some(true));
        assert!(e.is_healthy());
    }
}
