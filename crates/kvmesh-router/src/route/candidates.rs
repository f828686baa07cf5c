//! Which endpoints may take a request, and what the scheduler is told about each (a
//! [`Candidate`]: its cached prefix from the index, the load this router put on it, its scraped
//! metrics).

use std::sync::Arc;

use kvmesh_core::ChainKey;
use kvmesh_index::{EndpointId, EndpointMatch};
use kvmesh_sched::Candidate;

use crate::config::Role;
use crate::fleet::endpoints::Endpoint;
use crate::fleet::prefix::match_of;
use crate::state::RouterState;

/// Endpoints that may serve an aggregated request: healthy `both` endpoints, or every healthy
/// endpoint when none is `both`.
pub(crate) fn eligible(list: &[Arc<Endpoint>]) -> Vec<Arc<Endpoint>> {
    let healthy: Vec<Arc<Endpoint>> = list.iter().filter(|e| e.is_healthy()).cloned().collect();
    let both: Vec<Arc<Endpoint>> = healthy
        .iter()
        .filter(|e| e.serves_aggregated())
        .cloned()
        .collect();
    if both.is_empty() { healthy } else { both }
}

/// Healthy endpoints of one role.
pub(crate) fn with_role(list: &[Arc<Endpoint>], role: Role) -> Vec<Arc<Endpoint>> {
    list.iter()
        .filter(|e| e.is_healthy() && e.spec.role == role)
        .cloned()
        .collect()
}

/// The endpoint a decision names.
pub(crate) fn by_id(list: &[Arc<Endpoint>], id: EndpointId) -> Option<&Arc<Endpoint>> {
    list.iter().find(|e| e.id == id)
}

/// What the scheduler knows about `e` for a request whose index match on it is `m` and whose
/// prompt's full blocks are `keys` (of `block_size` tokens).
pub(crate) fn candidate(
    e: &Endpoint,
    m: EndpointMatch,
    keys: &[ChainKey],
    block_size: usize,
) -> Candidate {
    let load = e.load.snapshot();
    let scraped = e.metrics();
    let bs = block_size as u64;
    let gpu_capacity_tokens = scraped.and_then(|m| m.gpu_capacity_tokens);
    // How much of the prompt in-flight requests already hold matters only for the wait for GPU
    // room, so only where the tier's size is known.
    let in_flight_context_tokens = load.context_blocks * bs + load.decode_tokens;
    let in_flight_shared_tokens = if gpu_capacity_tokens.is_some() && load.context_blocks > 0 {
        e.load.shared_blocks(keys) * bs
    } else {
        0
    };
    Candidate {
        endpoint: e.id,
        name: Arc::clone(&e.name),
        // For a vLLM server running a hybrid model (HMA: sliding-window or Mamba groups) these
        // runs are already vLLM's prefix-hit rule, applied by the index: a prefix counts only
        // where the full-attention blocks, each sliding group's last window and each Mamba
        // state are all held. Scoring, the P2P source choice and P/D therefore never credit an
        // endpoint, or a peer, with full-attention blocks whose window it lacks: vLLM would not
        // count them as cached, and the connector (one group) cannot make it.
        gpu_blocks: m.gpu_blocks,
        cpu_blocks: m.cpu_blocks,
        any_blocks: m.any_blocks,
        in_flight_requests: load.requests,
        in_flight_uncached_tokens: load.uncached_tokens,
        in_flight_decode_tokens: load.decode_tokens,
        in_flight_context_tokens,
        in_flight_shared_tokens,
        gpu_capacity_tokens,
        decode_ms: e.load.in_flight_decode_ms(&load),
        waiting: scraped.map(|m| m.waiting),
        running: scraped.map(|m| m.running),
        kv_usage: scraped.map(|m| m.kv_usage),
        has_p2p: e.spec.p2p_host_port().is_some(),
        pulls_in: load.pulls_in,
        pulls_out: load.pulls_out,
        pulls_landing_in: load.pulls_landing_in,
        pulls_landing_uncached_tokens: load.pulls_landing_uncached_tokens,
        kv_group: e.kv_group(),
        // Filled from the router's reputation by whoever decides a pull (`gather`, P/D).
        source_standing: Default::default(),
    }
}

/// Candidates for `endpoints`, given the index's matches for the request and its blocks.
pub(crate) fn candidates_of(
    endpoints: &[Arc<Endpoint>],
    matches: &[EndpointMatch],
    keys: &[ChainKey],
    block_size: usize,
) -> Vec<Candidate> {
    endpoints
        .iter()
        .map(|e| candidate(e, match_of(matches, e.id), keys, block_size))
        .collect()
}

/// The endpoints that may serve an aggregated request now (never `excluded`), and what the router
/// knows about each.
pub(crate) fn gather(
    s: &RouterState,
    keys: &[ChainKey],
    excluded: Option<EndpointId>,
) -> (Vec<Arc<Endpoint>>, Vec<Candidate>) {
    let matches = s.prefix.find_matches(keys);
    let mut eligible = eligible(&s.endpoints.list());
    eligible.retain(|e| Some(e.id) != excluded);
    let mut candidates = candidates_of(&eligible, &matches, keys, s.config.block_size);
    s.reputation.fill(&mut candidates);
    (eligible, candidates)
}
