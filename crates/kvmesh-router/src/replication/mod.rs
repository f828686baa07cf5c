//! Hot-prefix replication, the I/O half (the pure half is [`crate::replication::hot_prefixes`]).
//!
//! Every aggregated request's placement feeds the hot-prefix table with the longest prefix any
//! endpoint holds. When that prefix turns hot while all its holders are busy, the least loaded
//! endpoint of the holder's KV group pulls it now, off any request's critical path, through the
//! engines' prefetch API (`POST /kvmesh/prefetch`, the same one sessions use). The copy lands in
//! its CPU tier and is announced by event; from then on placement sees two holders. Copies are
//! bounded per target, one per prefix per cooldown, and every outcome is counted
//! (`kvmesh_router_replications_total{outcome}`). Every decision about a hot prefix (a copy
//! issued, or skipped and why) and every copy's end (landed, failed) is also in
//! `/debug/decisions` (profile `replication`), so an operator can see why a prefix did or did not
//! get a second home without reading logs.

pub mod config;
pub mod hot_prefixes;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_core::{ChainKey, RemoteKvSource, TokenId};
use kvmesh_sched::decisions::DecisionRecord;
use kvmesh_sched::plugins::p2p_source_producer::P2pDecision;
use kvmesh_sched::{Candidate, Decision};
use prometheus_client::registry::Registry;
use serde_json::json;

use crate::fleet::endpoints::Endpoint;
use crate::replication::config::ReplicationConfig;
use crate::replication::hot_prefixes::{Replication, Skip, pick_copy};
use crate::route::candidates::by_id;
use crate::route::forward::{PREFETCH_PATH, send_prefetch};
use crate::state::{Hook, Placed, RouterState, unix_now};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The replication feature: the hot-prefix table, hooked into the aggregated route.
pub struct Replicate {
    table: Arc<Replication>,
}

impl Replicate {
    pub fn new(config: ReplicationConfig, registry: &mut Registry) -> Self {
        Replicate {
            table: Arc::new(Replication::new(config, registry)),
        }
    }
}

impl Hook for Replicate {
    fn after_placement(&self, s: &Arc<RouterState>, p: &Placed<'_>) {
        if !p.shared {
            // A copy is a prefetch of bare token ids, hashed unsalted by the engine: it would
            // copy the base model's blocks, not this tenant's.
            return;
        }
        let r = Arc::clone(&self.table);
        after_placement(s, r, p.tokens, p.keys, p.candidates, p.eligible);
    }
}

/// A request for `tokens` (chain keys `keys`) was placed among `candidates` (the router's view
/// of `eligible` just before): count its prefix and, when the prefix is hot and its holders
/// busy, start a copy. Never delays or fails the request.
fn after_placement(
    s: &Arc<RouterState>,
    r: Arc<Replication>,
    tokens: &[TokenId],
    keys: &[ChainKey],
    candidates: &[Candidate],
    eligible: &[Arc<Endpoint>],
) {
    let bs = s.config.block_size;
    let blocks = candidates
        .iter()
        .map(|c| c.any_blocks)
        .max()
        .unwrap_or(0)
        .min(keys.len());
    if blocks == 0 || blocks * bs < r.config.min_tokens {
        return;
    }
    let hot = Hot {
        key: keys[blocks - 1],
        blocks,
        tokens: blocks * bs,
        id: format!("rp-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed)),
        now: Instant::now(),
    };
    if !r.arrive(hot.key, hot.now) {
        return;
    }
    match plan_copy(&r, &hot, candidates, eligible) {
        Ok(plan) => start_copy(s, r, &hot, plan, tokens),
        Err(skip) => {
            r.count(skip.label);
            if r.show_skip(hot.key, skip.label, hot.now) {
                let why = format!("{}: {}", skip.label, skip.why);
                record(
                    s,
                    &hot.entry(skip.source, skip.target),
                    "replication_skipped",
                    why,
                );
            }
        }
    }
}

/// A prefix that just turned hot: its deepest block's key, its length, the copy's id.
struct Hot {
    key: ChainKey,
    blocks: usize,
    tokens: usize,
    id: String,
    now: Instant,
}

impl Hot {
    fn entry<'a>(&'a self, source: Option<&'a str>, target: Option<&'a str>) -> Entry<'a> {
        Entry {
            id: &self.id,
            source,
            target,
            prefix_tokens: self.tokens,
            prefix_blocks: self.blocks,
        }
    }
}

/// A copy about to start: from `source` (candidate `src`) to `target` (candidate `dst`), whose
/// slot in the per-target budget is reserved.
struct Plan<'a> {
    src: &'a Candidate,
    dst: &'a Candidate,
    source: &'a Arc<Endpoint>,
    target: &'a Arc<Endpoint>,
    /// The source's P2P address.
    host: String,
    port: u16,
}

/// Why no copy starts, as counted (`label`) and shown.
struct Skipped<'a> {
    label: &'static str,
    source: Option<&'a str>,
    target: Option<&'a str>,
    why: String,
}

/// Who copies the hot prefix to whom (and reserves the target's slot), or why nobody does.
fn plan_copy<'a>(
    r: &Replication,
    hot: &Hot,
    candidates: &'a [Candidate],
    eligible: &'a [Arc<Endpoint>],
) -> Result<Plan<'a>, Skipped<'a>> {
    let (busy, max_holders) = (r.config.busy_tokens, r.config.max_holders);
    let copy = pick_copy(candidates, hot.blocks, busy, max_holders).map_err(|skip| {
        let holders: Vec<&Candidate> = candidates
            .iter()
            .filter(|c| c.any_blocks >= hot.blocks)
            .collect();
        Skipped {
            label: skip.label(),
            source: holders.first().map(|c| &*c.name),
            target: None,
            why: skip_why(skip, &holders, busy, max_holders),
        }
    })?;
    let (src, dst) = (&candidates[copy.source], &candidates[copy.target]);
    let skipped = |label, source: &'a str, target: &'a str, why| Skipped {
        label,
        source: Some(source),
        target: Some(target),
        why,
    };
    let (Some(source), Some(target)) =
        (by_id(eligible, src.endpoint), by_id(eligible, dst.endpoint))
    else {
        let why = "the chosen source or target is no longer eligible".to_owned();
        return Err(skipped("skipped_no_target", &src.name, &dst.name, why));
    };
    let Some((host, port)) = source.spec.p2p_host_port() else {
        let why = format!("{} has no P2P producer address", source.name);
        return Err(skipped(
            "skipped_no_source",
            &source.name,
            &target.name,
            why,
        ));
    };
    if !r.reserve(target.id) {
        let why = format!(
            "{} already has {} copies in flight (max_inflight_per_endpoint)",
            target.name, r.config.max_inflight_per_endpoint
        );
        return Err(skipped("skipped_budget", &source.name, &target.name, why));
    }
    Ok(Plan {
        src,
        dst,
        source,
        target,
        host,
        port,
    })
}

/// Records the copy as issued and has its target pull the prefix in the background (through
/// the engines' prefetch API); its end is recorded too.
fn start_copy(
    s: &Arc<RouterState>,
    r: Arc<Replication>,
    hot: &Hot,
    plan: Plan<'_>,
    tokens: &[TokenId],
) {
    let (source, target) = (plan.source, plan.target);
    r.copied(hot.key, hot.now);
    r.count("issued");
    tracing::info!(copy = %hot.id, source = %source.name, target = %target.name,
        tokens = hot.tokens, "hot prefix: copying to a second holder");
    let issued_why = format!(
        "hot ({} requests within {} s); every holder has at least {} prefill tokens queued \
         (source {} queues {}); {} is the least loaded endpoint of its KV group ({} queued)",
        r.config.hot_requests,
        r.config.window_s,
        r.config.busy_tokens,
        source.name,
        plan.src.in_flight_uncached_tokens,
        target.name,
        plan.dst.in_flight_uncached_tokens
    );
    let entry = hot.entry(Some(&source.name), Some(&target.name));
    record(s, &entry, "replication_issued", issued_why);
    // An engine never takes the block holding a prompt's last token from a peer (it computes
    // that token): one token past the prefix, from this request, makes every prefix block count.
    let end = (hot.tokens + 1).min(tokens.len());
    let body = json!({
        "prefetch_id": hot.id,
        "prompt_token_ids": &tokens[..end],
        "remote_kv_source": RemoteKvSource {
            kv_request_id: hot.id.clone(),
            remote_host: plan.host,
            remote_port: plan.port,
        },
    });
    // Called from the request path, which always runs on the runtime; be safe at shutdown.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        r.release(target.id);
        return;
    };
    let (s, source, target) = (Arc::clone(s), Arc::clone(source), Arc::clone(target));
    let hot = Hot {
        id: hot.id.clone(),
        ..*hot
    };
    runtime.spawn(async move {
        let timeout = Duration::from_secs_f64(r.config.timeout_s);
        let url = target.url(PREFETCH_PATH);
        let bs = s.config.block_size;
        let (report, blocks, _) = send_prefetch(&s, url, &body, timeout, bs).await;
        r.release(target.id);
        let entry = hot.entry(Some(&source.name), Some(&target.name));
        if blocks > 0 {
            r.count("landed");
            record(&s, &entry, "replication_landed", engine_says(&report));
        } else {
            r.count("failed");
            tracing::info!(copy = %hot.id, target = %target.name, report = ?report,
                "hot prefix: copy did not land");
            record(&s, &entry, "replication_failed", engine_says(&report));
        }
    });
}

/// What the target's report says about a copy, for `/debug/decisions`.
fn engine_says(report: &Option<serde_json::Value>) -> String {
    match report {
        Some(r) => format!(
            "engine outcome {}, {} of {} blocks{}",
            r.get("outcome").and_then(|v| v.as_str()).unwrap_or("?"),
            r.get("blocks").and_then(|v| v.as_u64()).unwrap_or(0),
            r.get("wanted_blocks").and_then(|v| v.as_u64()).unwrap_or(0),
            r.get("reason")
                .and_then(|v| v.as_str())
                .map(|why| format!(" ({why})"))
                .unwrap_or_default()
        ),
        None => "the target refused or did not answer in time".to_owned(),
    }
}

/// One replication decision as `/debug/decisions` shows it.
struct Entry<'a> {
    id: &'a str,
    source: Option<&'a str>,
    target: Option<&'a str>,
    prefix_tokens: usize,
    prefix_blocks: usize,
}

/// Adds a replication decision (`replication_issued`, `replication_skipped`) or a copy's end
/// (`replication_landed`, `replication_failed`) to `/debug/decisions`: profile `replication`,
/// `endpoint` = the target, `p2p.source_endpoint` = the source, `p2p.why` = the reason. The
/// copy's id (`rp-N`) ties a decision to its end.
fn record(s: &RouterState, e: &Entry<'_>, outcome: &'static str, why: String) {
    let decision = Decision {
        profile: "replication".to_owned(),
        chosen: None,
        endpoint: e.target.map(str::to_owned),
        picker: "hot-prefix".to_owned(),
        filters: Vec::new(),
        candidates: Vec::new(),
        p2p: Some(P2pDecision {
            source: None,
            source_endpoint: e.source.map(str::to_owned),
            skipped: None,
            source_tokens: e.prefix_tokens as u64,
            computing_tokens: 0,
            delta_tokens: e.prefix_tokens as i64,
            predicted_recompute_ms: None,
            predicted_pull_ms: None,
            band: Vec::new(),
            penalised_sources: Vec::new(),
            why,
        }),
    };
    s.decisions.push(Arc::new(DecisionRecord {
        request_id: e.id.to_owned(),
        at: unix_now(),
        path: PREFETCH_PATH.to_owned(),
        prompt_tokens: e.prefix_tokens,
        blocks: e.prefix_blocks,
        scheduling_us: 0,
        held_ms: 0.0,
        outcome,
        decision,
    }));
}

/// Why `pick_copy` said no, with the holders' numbers behind it.
fn skip_why(skip: Skip, holders: &[&Candidate], busy_tokens: u64, max_holders: usize) -> String {
    let names = holders
        .iter()
        .map(|c| format!("{} ({} queued)", c.name, c.in_flight_uncached_tokens))
        .collect::<Vec<_>>()
        .join(", ");
    match skip {
        Skip::Holders => format!(
            "held by {} endpoints, max_holders {max_holders}: {names}",
            holders.len()
        ),
        Skip::HolderIdle => format!(
            "a holder has under busy_tokens {busy_tokens} of prefill queued and can take the next \
             request promptly: {names}"
        ),
        Skip::NoSource => {
            format!("no holder has the whole prefix in its CPU tier and a P2P producer: {names}")
        }
        Skip::NoTarget => format!(
            "no endpoint of the source's KV group with a P2P consumer lacks the prefix: {names}"
        ),
    }
}
