//! Hot-prefix replication, the I/O half (the pure half is [`crate::hot_prefixes`]).
//!
//! Every aggregated request's placement feeds the hot-prefix table with the longest prefix any
//! endpoint holds. When that prefix turns hot while all its holders are busy, the least loaded
//! endpoint of the holder's KV group pulls it now, off any request's critical path, through the
//! engines' prefetch API (`POST /kvmesh/prefetch`, the same one sessions use). The copy lands in
//! its CPU tier and is announced by event; from then on placement sees two holders. Copies are
//! bounded per target, one per prefix per cooldown, and every outcome is counted
//! (`kvmesh_router_replications_total{outcome}`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_core::{ChainKey, RemoteKvSource, TokenId};
use kvmesh_sched::Candidate;
use serde_json::json;

use crate::candidates::by_id;
use crate::endpoints::Endpoint;
use crate::hot_prefixes::pick_copy;
use crate::prefetch::{PREFETCH_PATH, send_prefetch};
use crate::state::RouterState;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A request for `tokens` (chain keys `keys`) was placed among `candidates` (the router's view
/// of `eligible` just before): count its prefix and, when the prefix is hot and its holders
/// busy, start a copy. Never delays or fails the request.
pub(crate) fn after_placement(
    s: &Arc<RouterState>,
    tokens: &[TokenId],
    keys: &[ChainKey],
    candidates: &[Candidate],
    eligible: &[Arc<Endpoint>],
) {
    let Some(r) = s.replication.clone() else {
        return;
    };
    let bs = s.config.block_size;
    let prefix_blocks = candidates
        .iter()
        .map(|c| c.any_blocks)
        .max()
        .unwrap_or(0)
        .min(keys.len());
    if prefix_blocks == 0 || prefix_blocks * bs < r.config.min_tokens {
        return;
    }
    let key = keys[prefix_blocks - 1];
    let now = Instant::now();
    if !r.arrive(key, now) {
        return;
    }
    let copy = match pick_copy(
        candidates,
        prefix_blocks,
        r.config.busy_tokens,
        r.config.max_holders,
    ) {
        Ok(c) => c,
        Err(skip) => {
            r.count(skip.label());
            return;
        }
    };
    let (src, dst) = (&candidates[copy.source], &candidates[copy.target]);
    let (Some(source), Some(target)) =
        (by_id(eligible, src.endpoint), by_id(eligible, dst.endpoint))
    else {
        r.count("skipped_no_target");
        return;
    };
    let Some((host, port)) = source.spec.p2p_host_port() else {
        r.count("skipped_no_source");
        return;
    };
    if !r.reserve(target.id) {
        r.count("skipped_budget");
        return;
    }
    r.copied(key, now);
    r.count("issued");
    let id = format!("rp-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    tracing::info!(copy = %id, source = %source.name, target = %target.name,
        tokens = prefix_blocks * bs, "hot prefix: copying to a second holder");
    // An engine never takes the block holding a prompt's last token from a peer (it computes
    // that token): one token past the prefix, from this request, makes every prefix block count.
    let end = (prefix_blocks * bs + 1).min(tokens.len());
    let body = json!({
        "prefetch_id": id,
        "prompt_token_ids": &tokens[..end],
        "remote_kv_source": RemoteKvSource {
            kv_request_id: id.clone(),
            remote_host: host,
            remote_port: port,
        },
    });
    // Called from the request path, which always runs on the runtime; be safe at shutdown.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        r.release(target.id);
        return;
    };
    let (s, target) = (Arc::clone(s), Arc::clone(target));
    runtime.spawn(async move {
        let timeout = Duration::from_secs_f64(r.config.timeout_s);
        let url = target.url(PREFETCH_PATH);
        let (report, blocks, _) = send_prefetch(&s, url, &body, timeout, bs).await;
        r.release(target.id);
        if blocks > 0 {
            r.count("landed");
        } else {
            r.count("failed");
            tracing::info!(copy = %id, target = %target.name, report = ?report,
                "hot prefix: copy did not land");
        }
    });
}
