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
use crate::fleet::load::EndpointLoad;

/// The `vllm:` gauges the router scrapes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EngineMetrics {
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: f64,
    /// Tokens the GPU tier holds (`num_gpu_blocks × block_size` of `vllm:cache_config_info`,
    /// summed over data-parallel ranks), when the engine reports it.
    pub gpu_capacity_tokens: Option<u64>,
    /// Tokens per block (`vllm:cache_config_info{block_size}`), when the engine reports it.
    pub block_size: Option<u64>,
    #[serde(skip)]
    pub scraped_at: Instant,
}

impl EngineMetrics {
    /// Whether the engine's blocks line up with the router's blocks of `router_block_size`
    /// tokens (the engine's block size must be a multiple of it); `None` when the engine does
    /// not report its block size.
    pub fn block_size_agrees(&self, router_block_size: u64) -> Option<bool> {
        let bs = self.block_size?;
        Some(router_block_size > 0 && bs % router_block_size == 0)
    }
}

pub struct Endpoint {
    pub id: EndpointId,
    pub name: Arc<str>,
    /// `spec.kv_group()`, shared so every candidate built for a request clones a pointer.
    configured_kv_group: Option<Arc<str>>,
    /// `fingerprint:<id>` from the engine's `kvmesh_p2p_fingerprint_info`, once scraped: the
    /// KV group of an endpoint configured without one (see [`Endpoint::kv_group`]).
    learned_kv_group: Mutex<Option<Arc<str>>>,
    /// Shared by the endpoints of one [`EndpointSet`]: whether they export more than one
    /// fingerprint id (see [`EndpointSet::note_fingerprints`]).
    fingerprints_differ: Arc<AtomicBool>,
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
    /// What discovery says about readiness (a Kubernetes pod's Ready condition; always true for
    /// static and DNS endpoints). Kept apart from `healthy` so the health loop, which only sees
    /// the engine's `/health`, cannot re-admit a pod Kubernetes holds back.
    discovered_ready: AtomicBool,
}

impl Endpoint {
    pub(crate) fn new(id: EndpointId, spec: EndpointSpec) -> Endpoint {
        Endpoint {
            id,
            name: Arc::from(spec.name.as_str()),
            configured_kv_group: spec.kv_group().map(Arc::from),
            learned_kv_group: Mutex::new(None),
            fingerprints_differ: Arc::new(AtomicBool::new(false)),
            base_url: spec.url.trim_end_matches('/').to_owned(),
            spec,
            load: Arc::new(EndpointLoad::default()),
            healthy: AtomicBool::new(true),
            fail_streak: AtomicU32::new(0),
            ok_streak: AtomicU32::new(0),
            metrics: Mutex::new(None),
            placed: AtomicU64::new(0),
            events_silent: AtomicBool::new(false),
            discovered_ready: AtomicBool::new(true),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }

    /// Placeable: passing health checks and ready as far as discovery knows.
    pub fn is_healthy(&self) -> bool {
        self.passes_health_checks() && self.is_discovered_ready()
    }

    fn passes_health_checks(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn is_discovered_ready(&self) -> bool {
        self.discovered_ready.load(Ordering::Relaxed)
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
            if !self.passes_health_checks() && streak >= healthy_threshold.max(1) {
                self.healthy.store(true, Ordering::Relaxed);
                return Some(true);
            }
        } else {
            self.ok_streak.store(0, Ordering::Relaxed);
            let streak = self.fail_streak.fetch_add(1, Ordering::Relaxed) + 1;
            if self.passes_health_checks() && streak >= unhealthy_threshold.max(1) {
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

    /// The endpoint's KV group: blocks move only between endpoints of one group. The configured
    /// `kv_group` if any. Else, once the fleet's engines export more than one fingerprint id,
    /// the id this one exports (so a vLLM server and a kvmesh engine in one config never trade
    /// blocks they cannot use). Else `None`, the implicit default group: a fleet whose engines
    /// all agree (or export nothing) is one group, as if learning were not there, and an
    /// engine not scraped yet never splits from the others on a timing accident.
    pub fn kv_group(&self) -> Option<Arc<str>> {
        self.configured_kv_group.clone().or_else(|| {
            if self.fingerprints_differ.load(Ordering::Relaxed) {
                self.learned_kv_group.lock().clone()
            } else {
                None
            }
        })
    }

    fn learned_fingerprint(&self) -> Option<Arc<str>> {
        self.learned_kv_group.lock().clone()
    }

    /// Records the fingerprint id the engine exports (see [`Endpoint::kv_group`]).
    pub fn learn_fingerprint(&self, id: &str) {
        let mut learned = self.learned_kv_group.lock();
        if learned
            .as_deref()
            .and_then(|g| g.strip_prefix("fingerprint:"))
            != Some(id)
        {
            *learned = Some(Arc::from(format!("fingerprint:{id}")));
        }
    }
}

/// One endpoint as discovery reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    pub spec: EndpointSpec,
    /// Whether it may take requests now; a not-ready endpoint keeps its id and index entries.
    pub ready: bool,
}

impl Discovered {
    pub fn ready(spec: EndpointSpec) -> Discovered {
        Discovered { spec, ready: true }
    }
}

/// What a reload changed.
#[derive(Default)]
pub struct EndpointDiff {
    pub added: Vec<Arc<Endpoint>>,
    pub removed: Vec<Arc<Endpoint>>,
    /// Kept endpoints whose discovered readiness flipped (the endpoint, its new readiness).
    pub readiness: Vec<(Arc<Endpoint>, bool)>,
}

pub struct EndpointSet {
    current: ArcSwap<Vec<Arc<Endpoint>>>,
    /// Whether the endpoints export more than one fingerprint id (shared with each endpoint).
    fingerprints_differ: Arc<AtomicBool>,
    next_id: AtomicU32,
    /// Serialises reloads (the swap itself is lock-free for readers).
    reload: Mutex<()>,
}

impl Default for EndpointSet {
    fn default() -> Self {
        EndpointSet {
            current: ArcSwap::from_pointee(Vec::new()),
            fingerprints_differ: Arc::new(AtomicBool::new(false)),
            next_id: AtomicU32::new(0),
            reload: Mutex::new(()),
        }
    }
}

impl EndpointSet {
    /// After a scrape round: endpoints fall into fingerprint groups only when the fingerprint
    /// ids they export differ (see [`Endpoint::kv_group`]).
    pub fn note_fingerprints(&self) {
        let list = self.list();
        let mut ids = list.iter().filter_map(|e| e.learned_fingerprint());
        let differ = ids.next().is_some_and(|first| ids.any(|id| id != first));
        self.fingerprints_differ.store(differ, Ordering::Relaxed);
    }

    pub fn list(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.current.load_full()
    }

    pub fn get(&self, id: EndpointId) -> Option<Arc<Endpoint>> {
        self.current.load().iter().find(|e| e.id == id).cloned()
    }

    /// Replaces the endpoint list with `specs` (already validated), keeping unchanged endpoints.
    pub fn apply(&self, specs: Vec<EndpointSpec>) -> EndpointDiff {
        self.apply_discovered(specs.into_iter().map(Discovered::ready).collect())
    }

    /// [`EndpointSet::apply`] with readiness: a new endpoint is published with its readiness
    /// already set (never briefly placeable), a kept one has it updated.
    pub fn apply_discovered(&self, found: Vec<Discovered>) -> EndpointDiff {
        let _serial = self.reload.lock();
        let old = self.current.load_full();
        let mut by_name: HashMap<&str, &Arc<Endpoint>> =
            old.iter().map(|e| (e.spec.name.as_str(), e)).collect();
        let mut diff = EndpointDiff::default();
        let mut next = Vec::with_capacity(found.len());
        for Discovered { spec, ready } in found {
            match by_name.remove(spec.name.as_str()) {
                Some(e) if e.spec == spec => {
                    if e.discovered_ready.swap(ready, Ordering::Relaxed) != ready {
                        diff.readiness.push((Arc::clone(e), ready));
                    }
                    next.push(Arc::clone(e));
                }
                prev => {
                    if let Some(p) = prev {
                        diff.removed.push(Arc::clone(p));
                    }
                    let id = EndpointId(self.next_id.fetch_add(1, Ordering::Relaxed));
                    let mut e = Endpoint::new(id, spec);
                    e.fingerprints_differ = Arc::clone(&self.fingerprints_differ);
                    e.discovered_ready.store(ready, Ordering::Relaxed);
                    let e = Arc::new(e);
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
            kv_group: None,
        }
    }

    #[test]
    fn fingerprint_groups_split_a_fleet_only_when_its_engines_disagree() {
        let set = EndpointSet::default();
        let configured = EndpointSpec {
            kv_group: Some("vllm-llama".into()),
            ..spec("c", 3)
        };
        set.apply(vec![spec("a", 1), spec("b", 2), configured]);
        let [a, b, c] = [0, 1, 2].map(|i| Arc::clone(&set.list()[i]));
        let groups = || [&a, &b, &c].map(|e| e.kv_group().map(|g| g.to_string()));
        // Nothing scraped, or every engine agrees: one implicit group, as without learning.
        set.note_fingerprints();
        assert_eq!(groups(), [None, None, Some("vllm-llama".into())]);
        a.learn_fingerprint("0123456789abcdef");
        b.learn_fingerprint("0123456789abcdef");
        c.learn_fingerprint("0123456789abcdef");
        set.note_fingerprints();
        assert_eq!(groups(), [None, None, Some("vllm-llama".into())]);
        // b restarted as another kind of engine: the fleet splits by what each exports, and
        // the configured group still wins.
        b.learn_fingerprint("fedcba9876543210");
        set.note_fingerprints();
        assert_eq!(
            groups(),
            [
                Some("fingerprint:0123456789abcdef".into()),
                Some("fingerprint:fedcba9876543210".into()),
                Some("vllm-llama".into())
            ]
        );
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
    fn not_ready_is_kept_but_not_placeable_and_health_cannot_readmit_it() {
        let set = EndpointSet::default();
        let d = set.apply_discovered(vec![Discovered {
            spec: spec("a", 1),
            ready: false,
        }]);
        assert!(!d.added[0].is_healthy());
        let id = set.list()[0].id;
        let e = &set.list()[0];
        assert_eq!(
            e.record_health(true, 1, 1),
            None,
            "not ejected, so not readmitted"
        );
        assert!(!e.is_healthy());
        let d = set.apply_discovered(vec![Discovered::ready(spec("a", 1))]);
        assert_eq!(d.readiness.len(), 1);
        assert!(d.added.is_empty() && d.removed.is_empty());
        assert_eq!(set.list()[0].id, id);
        assert!(set.list()[0].is_healthy());
        let d = set.apply(vec![spec("a", 1)]);
        assert!(d.readiness.is_empty());
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
