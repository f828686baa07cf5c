//! What a plugin sees: the request ([`SchedulingContext`]) and each endpoint ([`Candidate`]).
//!
//! Inputs come in borrowed structs whose optional fields are `Option`s, so adding an input never
//! breaks an existing plugin. A candidate is named by its [`EndpointId`]: decisions carry ids, never
//! positions in a list, so whoever acts on a decision finds the endpoint without translating.

use std::sync::Arc;

use kvmesh_index::EndpointId;

use crate::reputation::SourceStanding;

/// What the scheduler knows about one endpoint for one request.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub endpoint: EndpointId,
    pub name: Arc<str>,
    /// Longest consecutive prefix of the request held in the GPU tier, in blocks.
    pub gpu_blocks: usize,
    /// Longest consecutive prefix held in the CPU tier, in blocks (what a P2P producer can serve).
    pub cpu_blocks: usize,
    /// Longest consecutive prefix held in either tier, in blocks.
    pub any_blocks: usize,
    /// Requests this router has in flight to the endpoint.
    pub in_flight_requests: u64,
    /// Prompt tokens of in-flight requests the endpoint still has to compute (not cached, not pulled).
    pub in_flight_uncached_tokens: u64,
    /// Decode tokens (max_tokens) of in-flight requests.
    pub in_flight_decode_tokens: u64,
    /// What in-flight requests need the GPU tier to hold: their distinct prompt tokens (a prefix
    /// they share counted once) plus their decode tokens.
    pub in_flight_context_tokens: u64,
    /// This request's prompt tokens that in-flight requests already hold (it would share them).
    /// Filled only when `gpu_capacity_tokens` is known, else 0.
    pub in_flight_shared_tokens: u64,
    /// Tokens the endpoint's GPU tier holds (scraped `vllm:cache_config_info`), if reported.
    pub gpu_capacity_tokens: Option<u64>,
    /// How long the requests in flight there take to decode, first byte to end (ms): their mean
    /// requested output length at the per-token time the router learned there.
    pub decode_ms: Option<f64>,
    /// Scraped `vllm:num_requests_waiting` (None until the first successful scrape).
    pub waiting: Option<f64>,
    /// Scraped `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// Scraped `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: Option<f64>,
    /// Whether the endpoint has a P2P producer address (can be named as a pull source).
    pub has_p2p: bool,
    /// Pulls this router named into the endpoint that have not finished yet.
    pub pulls_in: u64,
    /// Pulls this router named with the endpoint as source that have not finished yet.
    pub pulls_out: u64,
    /// Of `pulls_in`, those whose transfer is expected to be still under way: their requests
    /// join the engine's queue when it ends, behind work placed there meanwhile (a pull that
    /// has landed is queued ahead of any newcomer).
    pub pulls_landing_in: u64,
    /// The prompt tokens those requests compute once their pulls have landed.
    pub pulls_landing_uncached_tokens: u64,
    /// KV compatibility group (`kv_group` in the router's endpoint config); `None` is the
    /// implicit group of every endpoint without one. Blocks only move within a group: another
    /// group's blocks differ in model, layout, dtype or block size and a pull would be refused.
    pub kv_group: Option<Arc<str>>,
    /// How its pulls have gone lately, as a P2P source ([`crate::reputation`]): placement
    /// discounts a pull from it by the failure probability and never names it when excluded.
    pub source_standing: SourceStanding,
}

impl Candidate {
    /// Prefill tokens a request computed here now would wait for: the router's queued work
    /// minus the requests still pulling their prefix in, which will land behind it.
    pub fn queued_ahead_of_new_work(&self) -> u64 {
        self.in_flight_uncached_tokens
            .saturating_sub(self.pulls_landing_uncached_tokens)
    }

    /// A candidate with no prefix, no load and no scraped metrics (tests and cold starts).
    pub fn idle(endpoint: u32, name: &str) -> Candidate {
        Candidate {
            endpoint: EndpointId(endpoint),
            name: Arc::from(name),
            gpu_blocks: 0,
            cpu_blocks: 0,
            any_blocks: 0,
            in_flight_requests: 0,
            in_flight_uncached_tokens: 0,
            in_flight_decode_tokens: 0,
            in_flight_context_tokens: 0,
            in_flight_shared_tokens: 0,
            gpu_capacity_tokens: None,
            decode_ms: None,
            waiting: None,
            running: None,
            kv_usage: None,
            has_p2p: true,
            pulls_in: 0,
            pulls_out: 0,
            pulls_landing_in: 0,
            pulls_landing_uncached_tokens: 0,
            kv_group: None,
            source_standing: SourceStanding::default(),
        }
    }

    /// Whether `other`'s KV blocks are usable here (same group, the implicit one included).
    pub fn same_kv_group(&self, other: &Candidate) -> bool {
        self.kv_group == other.kv_group
    }

    /// Whether this candidate may serve a pull into `dest`: it has a P2P address, its blocks
    /// are usable on `dest`, and its reputation does not exclude it.
    pub fn can_source_for(&self, dest: &Candidate) -> bool {
        self.has_p2p && self.same_kv_group(dest) && !self.source_standing.excluded
    }
}

/// What the scheduler knows about the request.
#[derive(Debug, Clone, Copy)]
pub struct SchedulingContext<'a> {
    /// The id forwarded to the engine and used for deterministic P2P sampling.
    pub request_id: &'a str,
    pub prompt_tokens: usize,
    /// Full blocks of the prompt (`prompt_tokens / block_size`).
    pub total_blocks: usize,
    pub block_size: usize,
    /// Requested decode length, if the request said.
    pub max_tokens: Option<u64>,
    /// The admission queue behind this request when it was released from it (empty otherwise).
    pub backlog: Backlog<'a>,
    /// Whether the request may pull its prefix from a peer. False for a request the admission
    /// queue held with `pulls_when_held: false`: the prediction prices no pull for it and the
    /// P2P step names no source (every other use of the candidates, hot-prefix replication
    /// included, is unaffected).
    pub may_pull: bool,
}

/// What was still waiting in the router's admission queue when a held request left it. Those
/// requests are released while some endpoint's prefill queue is within `share_tokens`, so while
/// this request's pull is in flight some of them can be placed on its endpoint and computed
/// ahead of it (see [`crate::predict`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog<'a> {
    /// Prefill tokens of each held request that nothing is cached for anywhere, ascending.
    /// Only those go wherever the queue is shortest: a held request whose prefix some endpoint
    /// holds goes there, or pulls it and lands after this one.
    pub cold_tokens: &'a [u64],
    /// `admission_queue.max_queued_prefill_tokens`.
    pub share_tokens: u64,
}

impl Backlog<'_> {
    /// Prefill tokens the admission queue would place on an endpoint, and compute there, while
    /// a pull is landing on it. The endpoint has `queued` prefill tokens (the admission queue's
    /// measure) of which a request computed now waits for `ahead` (the rest is landing);
    /// `elsewhere` is the shortest such wait on any other endpoint, and `charge` what placement
    /// charges per token for going ahead of the landing pulls (`pulling_delay_weight` × how many
    /// are landing there, this one included). Cold requests leave the queue smallest first
    /// while the endpoint is within its share, and each comes here only if waiting here plus
    /// its charge beats waiting elsewhere.
    pub fn overtaking(&self, queued: u64, ahead: u64, elsewhere: u64, charge: f64) -> u64 {
        let mut sum = 0u64;
        for &tokens in self.cold_tokens {
            let within_share = queued.saturating_add(sum) <= self.share_tokens;
            let here = ahead.saturating_add(sum) as f64 + tokens as f64 * charge;
            if !within_share || here >= elsewhere as f64 {
                break;
            }
            sum = sum.saturating_add(tokens);
        }
        sum
    }
}

impl SchedulingContext<'_> {
    /// Prompt tokens `c` would still compute if it got the request (tier-blind local prefix).
    pub fn uncached_tokens(&self, c: &Candidate) -> u64 {
        let cached = c.any_blocks.saturating_mul(self.block_size);
        self.prompt_tokens.saturating_sub(cached) as u64
    }
}
