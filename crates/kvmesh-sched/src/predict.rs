//! Predicted time to first token: the one cost function that placement and the pull decision share.
//!
//! For a request placed on candidate `c` the router predicts
//!
//! ```text
//! ttft(c) = queue(c) + kv_wait(c) + own(c) + decode_penalty × in_flight_requests(c) + step_overhead
//! queue(c) = prefill tokens already sent to c and not yet computed / prefill_rate(c)
//! kv_wait(c) = decode_time(c) × max(0, context(c) + this request's new context − gpu_capacity(c))
//!                             / gpu_capacity(c)
//! own(c)   = min( local:  uncached(c) / prefill_rate(c) + cpu_only(c) / restore_rate,
//!                 pull s: pull_time(s → c, delta) + (prompt − cpu(s)) / prefill_rate(c)
//!                         + (cpu_only(c) + delta) / restore_rate )
//! ```
//!
//! Why this shape: the engines schedule prefill FCFS under a token budget, so a request's wait is
//! the prefill work ahead of it, not the number of requests (a 24-token prompt behind 35K queued
//! prefill tokens waits ~1.4 s on gpt-oss-120b/H200, whatever the request counts say). Only prefill
//! work the router itself sent counts as queued (`in_flight_uncached_tokens`, exact for one router
//! and released at the first byte); scraped gauges are seconds stale during a burst.
//! A CPU-tier hit is not free (it is copied back to the GPU) but is far cheaper than recompute.
//!
//! `kv_wait` is why a saturated engine is slower than its queue says: an engine admits a request
//! only when its GPU tier can hold its context, so once the requests in flight there (their
//! distinct prompt blocks and decode tokens, as this router counts them) fill the tier, a new
//! one waits for running ones to finish. Running requests free the tier at about its size per
//! decode time, so the wait is the overflow's share of one decode time. Without it an engine
//! with a short prefill queue but 2× its GPU tier in flight looked like the fastest place for a
//! returning agent turn, and the turns sent to such engines were 7× slower than the others
//! (`agentic-paced`). Unknown capacity or decode time (an engine that does not report
//! `vllm:cache_config_info`, no finished streamed response yet) prices no wait.
//!
//! A pull is an option only when `delta = cpu(s) − cached(c)` reaches `min_pull_tokens` (and the
//! request may pull at all: [`SchedulingContext::may_pull`]), and its
//! time is the cost model's prediction stretched by what already shares the link: transfers the
//! router has in flight out of `s` and into `c` (`1 + max(out(s), in(c))`). The engine pulls
//! before the request joins its queue, so the pull path pays the pull *and* the queue — the
//! conservative sum, which is what makes "P2P never makes TTFT worse" hold by construction: a pull
//! is chosen only when `pull_time(delta) + margin < recompute(delta)` on the same destination.
//!
//! A pulled request joins its engine's queue only when its blocks land. When the router's
//! admission queue released it while others were still held, those others are released while
//! some endpoint's prefill queue is within `share` tokens, and during the pull the cold ones
//! (nothing cached anywhere) can be placed on its endpoint and computed first. The router
//! predicts its own placement of them: smallest first, while `c` is within its share, each comes
//! to `c` if the prefill ahead of it there plus the charge for delaying the landing pulls
//! (`pulling_delay_weight` × its prefill × pulls landing) is below the shortest queue elsewhere.
//! The pull path waits for those too (`overtaken_ms`). Without it, pulls of held 10K-token
//! prompts in skew-heavy's warm-up were predicted at 90 ms and took 200 ms: first-seen prompts
//! released right after them were computed first. Held requests whose prefix an endpoint holds
//! are not counted: they go to it, or pull and land after this one.
//!
//! Plain functions over [`Candidate`]s and the [`CostModel`]: no I/O, no clock.

use serde::{Deserialize, Serialize};

use kvmesh_index::EndpointId;

use crate::candidate::{Candidate, SchedulingContext};
use crate::cost_model::CostModel;

/// Knobs of the prediction (`predicted-ttft-scorer`'s parameters).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TtftParams {
    /// CPU tier → GPU copy rate (tokens/s). gpt-oss-120b: 72 KiB/token over a ~50 GB/s host link.
    pub restore_tokens_per_second: f64,
    /// Added per request in flight on the endpoint (decode steps stretch every prefill chunk; also
    /// breaks ties between equally idle endpoints toward the emptier one).
    pub decode_penalty_ms: f64,
    /// Fixed per-request cost (one engine step, HTTP), so a fully cached prompt is not "free".
    pub step_overhead_ms: f64,
    /// Consider pulling the missing prefix from a peer's CPU tier.
    pub p2p: bool,
    /// Smallest pull worth considering (tokens).
    pub min_pull_tokens: u64,
    /// A pull must beat recomputing the same tokens by at least this much (ms).
    pub margin_ms: f64,
    /// How much a token this request would compute counts against a candidate, relative to a
    /// token of queued work ahead of it. 1 = pure greedy TTFT. Above 1 the router also charges
    /// the work a placement adds to the fleet: recomputing a prefix another endpoint holds delays
    /// every later request there, and leaves the conversation's next turn without a warm cache.
    pub work_weight: f64,
    /// How much the wait this request's prefill would add to requests still pulling their prefix
    /// into the candidate counts, per such request, relative to its own TTFT. Such a request
    /// joins the engine's queue only when its pull lands, behind whatever was placed there
    /// meanwhile: a cold 50K-token prefill placed during a 200 ms pull delays the pulled turn by
    /// its whole second of compute. 0 = ignore them; 1 = minimise the sum of first-token times.
    /// The default 0.5 leans toward the tail: with 1, a burst's first-seen prompts avoided every
    /// engine receiving a pull and doubled up on queues a whole prefill longer, slower than the
    /// pulled requests they spared (skew-heavy, `docs/benchmarks.md`).
    pub pulling_delay_weight: f64,
    /// Where prefill and pull rates come from: `configured` (the cost model's configured rates,
    /// the same for every endpoint) or `learned` (per endpoint / pair as learned online).
    pub rates: RateSource,
}

/// Which rates the prediction uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RateSource {
    /// The configured `cost_model` rates. The default: learned per-endpoint prefill rates of
    /// identical sim engines spread 64K–247K tokens/s in one trace run (batched prefills overlap,
    /// so per-request samples are biased), and placement followed the noise onto one engine.
    #[default]
    Configured,
    /// Rates learned online (per endpoint for prefill, per pair / destination for pulls).
    Learned,
}

impl Default for TtftParams {
    fn default() -> Self {
        TtftParams {
            restore_tokens_per_second: 650_000.0,
            decode_penalty_ms: 1.0,
            step_overhead_ms: 5.0,
            p2p: false,
            min_pull_tokens: 512,
            margin_ms: 5.0,
            work_weight: 2.0,
            pulling_delay_weight: 0.5,
            rates: RateSource::Configured,
        }
    }
}

impl TtftParams {
    pub fn validate(&self) -> Result<(), String> {
        let finite_pos = |v: f64| v.is_finite() && v > 0.0;
        let finite_nonneg = |v: f64| v.is_finite() && v >= 0.0;
        if !finite_pos(self.restore_tokens_per_second) {
            return Err("restore_tokens_per_second must be a finite number > 0".to_owned());
        }
        if !finite_nonneg(self.decode_penalty_ms)
            || !finite_nonneg(self.step_overhead_ms)
            || !finite_nonneg(self.margin_ms)
            || !finite_nonneg(self.work_weight)
            || !finite_nonneg(self.pulling_delay_weight)
        {
            return Err(
                "decode_penalty_ms, step_overhead_ms, margin_ms, work_weight and pulling_delay_weight \
                 must be finite and >= 0"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

/// A pull the prediction considered for one destination.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PullPlan {
    /// The source endpoint.
    #[serde(skip)]
    pub source: EndpointId,
    pub source_endpoint: String,
    /// Tokens the source holds in its CPU tier.
    pub source_tokens: u64,
    /// Tokens pulled (source's CPU prefix beyond what the destination holds).
    pub delta_tokens: u64,
    /// Predicted transfer time, link sharing included (ms).
    pub pull_ms: f64,
    /// Predicted time to compute the same tokens locally instead (ms).
    pub recompute_ms: f64,
    /// Transfers already sharing the link (the larger of the two ends).
    pub sharing: u64,
    /// What the pull had to win by (the scorer's `margin_ms`).
    pub margin_ms: f64,
    /// The source's estimated failure probability ([`crate::reputation`]): with it the tokens
    /// are recomputed after the pull, so the pull is priced at `pull_ms + p × recompute_ms`.
    pub failure_probability: f64,
}

impl PullPlan {
    /// The recompute the pull is expected to leave over: the delta's recompute time, times the
    /// chance the source does not serve it.
    pub fn expected_recompute_ms(&self) -> f64 {
        self.failure_probability * self.recompute_ms
    }
}

/// The prediction for one candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Prefill work ahead of the request (ms).
    pub queue_ms: f64,
    /// The part of `queue_ms` the admission queue may still place here ahead of this request
    /// while its pull lands (ms; 0 unless it pulls and was released with others still held).
    pub overtaken_ms: f64,
    /// Wait for room in the GPU tier: in-flight requests' context beyond its capacity (ms).
    pub kv_wait_ms: f64,
    /// Compute + restore (+ pull, when the pull path is chosen) of this request (ms).
    pub own_ms: f64,
    /// Decode penalty + step overhead (ms).
    pub load_ms: f64,
    /// Predicted TTFT (ms).
    pub total_ms: f64,
    /// The prefill time this request would put ahead of requests still pulling into the
    /// endpoint, times their number and `pulling_delay_weight` (ms; part of `cost_ms`). Their own
    /// prefill is then not in `queue_ms`: they will be behind this request. 0 when this request
    /// pulls too (it lands after them).
    pub delays_pulling_ms: f64,
    /// What placement minimises: the TTFT plus `work_weight − 1` times the prefill work this
    /// request adds to the endpoint, plus `delays_pulling_ms` (ms).
    pub cost_ms: f64,
    /// The cheapest pull considered, whether or not it won.
    pub best_pull: Option<PullPlan>,
    /// Whether the pull path is the predicted one.
    pub pulls: bool,
}

fn clamp_tokens(blocks: usize, block_size: usize, prompt: usize) -> u64 {
    blocks.saturating_mul(block_size).min(prompt) as u64
}

/// Predicts the TTFT of the request on `candidates[at]`; pull sources are any other candidate
/// with a P2P address in `candidates[at]`'s KV group (another group's blocks are refused by the
/// fingerprint, so pricing a pull from it would promise a TTFT the engine cannot get).
pub fn predict(
    ctx: &SchedulingContext<'_>,
    candidates: &[&Candidate],
    at: usize,
    cm: &CostModel,
    p: &TtftParams,
) -> Prediction {
    let Some(c) = candidates.get(at) else {
        return Prediction {
            queue_ms: f64::INFINITY,
            overtaken_ms: 0.0,
            kv_wait_ms: 0.0,
            own_ms: f64::INFINITY,
            load_ms: 0.0,
            total_ms: f64::INFINITY,
            delays_pulling_ms: 0.0,
            cost_ms: f64::INFINITY,
            best_pull: None,
            pulls: false,
        };
    };
    let prompt = ctx.prompt_tokens;
    let bs = ctx.block_size;
    let learned = p.rates == RateSource::Learned;
    let rate = if learned {
        cm.prefill_rate(c.endpoint)
    } else {
        cm.params().prefill_tokens_per_second
    }
    .max(1e-9);
    let restore = p.restore_tokens_per_second.max(1e-9);
    let ms = |tokens: u64, per_s: f64| tokens as f64 / per_s * 1000.0;
    let any = clamp_tokens(c.any_blocks.max(c.gpu_blocks), bs, prompt);
    let gpu = clamp_tokens(c.gpu_blocks, bs, prompt).min(any);
    let cpu_only = any - gpu;
    let uncached = prompt as u64 - any;
    let kv_wait_ms = kv_wait_ms(ctx, c);
    let load_ms = p.decode_penalty_ms * c.in_flight_requests as f64 + p.step_overhead_ms;
    let local_ms = ms(uncached, rate) + ms(cpu_only, restore);

    let mut best_pull: Option<PullPlan> = None;
    if p.p2p && ctx.may_pull {
        for (i, s) in candidates.iter().enumerate() {
            if i == at || !s.can_source_for(c) {
                continue;
            }
            let src = clamp_tokens(s.cpu_blocks, bs, prompt);
            if src <= any || src - any < p.min_pull_tokens.max(1) {
                continue;
            }
            let delta = src - any;
            let sharing = s.pulls_out.max(c.pulls_in);
            let base = if learned {
                cm.predict_pull_ms(s.endpoint, c.endpoint, delta)
            } else {
                cm.params().pull_floor_ms
                    + delta as f64 / cm.params().pull_tokens_per_second.max(1e-9) * 1000.0
            };
            let pull_ms = contended_pull_ms(base, cm.params().pull_floor_ms, sharing);
            // A source that has been missing or stalling lately is priced by what a pull from it
            // is expected to cost: the pull, then, with its failure probability, the recompute.
            let failure_probability = s.source_standing.failure_probability.clamp(0.0, 1.0);
            let plan = PullPlan {
                source: s.endpoint,
                source_endpoint: s.name.to_string(),
                source_tokens: src,
                delta_tokens: delta,
                pull_ms,
                recompute_ms: ms(delta, rate),
                sharing,
                margin_ms: p.margin_ms,
                failure_probability,
            };
            let better = best_pull.as_ref().is_none_or(|b| {
                pull_path_ms(&plan, prompt as u64, cpu_only, rate, restore)
                    < pull_path_ms(b, prompt as u64, cpu_only, rate, restore)
            });
            if better {
                best_pull = Some(plan);
            }
        }
    }
    let overtaken_ms = if best_pull.is_some() {
        ms(overtaking_tokens(ctx, candidates, at, p), rate)
    } else {
        0.0
    };
    let pull_ms = best_pull
        .as_ref()
        .map(|b| pull_path_ms(b, prompt as u64, cpu_only, rate, restore));
    let pulls = match (&best_pull, pull_ms) {
        (Some(b), Some(path)) => {
            b.pull_ms + b.expected_recompute_ms() + p.margin_ms < b.recompute_ms
                && path + overtaken_ms + p.margin_ms < local_ms
        }
        _ => false,
    };
    let overtaken_ms = if pulls { overtaken_ms } else { 0.0 };
    let own_ms = match pull_ms {
        Some(path) if pulls => path,
        _ => local_ms,
    };
    let computed = match &best_pull {
        Some(b) if pulls => prompt as u64 - b.source_tokens,
        _ => uncached,
    };
    // Requests still pulling into `c` join its queue when their pulls land. Computed here, this
    // request joins now: ahead of them, so they are not in its queue and it delays each of them
    // by its prefill. Pulled, it lands after them (FCFS by landing) and delays none of them.
    let (queue_ms, landing_ahead) = if pulls {
        (ms(c.in_flight_uncached_tokens, rate) + overtaken_ms, 0)
    } else {
        (ms(c.queued_ahead_of_new_work(), rate), c.pulls_landing_in)
    };
    let total_ms = queue_ms + kv_wait_ms + own_ms + load_ms;
    let compute_ms = ms(computed, rate);
    let delays_pulling_ms = p.pulling_delay_weight * landing_ahead as f64 * compute_ms;
    Prediction {
        queue_ms,
        overtaken_ms,
        kv_wait_ms,
        own_ms,
        load_ms,
        total_ms,
        delays_pulling_ms,
        cost_ms: total_ms + (p.work_weight - 1.0) * compute_ms + delays_pulling_ms,
        best_pull,
        pulls,
    }
}

/// Prefill tokens the admission queue will place on `candidates[at]` and compute there while
/// this request's pull lands (see the module header). 0, without scanning the fleet, when no
/// cold request was held behind this one: the common case.
fn overtaking_tokens(
    ctx: &SchedulingContext<'_>,
    candidates: &[&Candidate],
    at: usize,
    p: &TtftParams,
) -> u64 {
    let Some(c) = candidates.get(at) else {
        return 0;
    };
    if ctx.backlog.cold_tokens.is_empty() {
        return 0;
    }
    let elsewhere = candidates
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != at)
        .map(|(_, o)| o.queued_ahead_of_new_work())
        .min()
        .unwrap_or(u64::MAX);
    ctx.backlog.overtaking(
        c.in_flight_uncached_tokens,
        c.queued_ahead_of_new_work(),
        elsewhere,
        p.pulling_delay_weight * (c.pulls_landing_in + 1) as f64,
    )
}

/// How long a request waits on `c` for its GPU tier to have room for its context (see the module
/// header): 0 while the in-flight context plus this request's fits, or when the capacity or the
/// decode time is unknown.
pub fn kv_wait_ms(ctx: &SchedulingContext<'_>, c: &Candidate) -> f64 {
    let (Some(capacity), Some(decode_ms)) = (c.gpu_capacity_tokens, c.decode_ms) else {
        return 0.0;
    };
    if capacity == 0 || !decode_ms.is_finite() || decode_ms <= 0.0 {
        return 0.0;
    }
    let own = (ctx.prompt_tokens as u64).saturating_sub(c.in_flight_shared_tokens)
        + ctx.max_tokens.unwrap_or(0);
    let need = c.in_flight_context_tokens.saturating_add(own);
    let over = need.saturating_sub(capacity);
    decode_ms * over as f64 / capacity as f64
}

/// A pull's time when `sharing` other transfers already use the busier of its two ends: the
/// setup floor is paid once, the bandwidth part is split `1 + sharing` ways (a node's link is
/// shared by everything it moves, as the sim's link model and a real NIC do). `base` is the
/// uncontended prediction, `floor` the cost model's per-pull setup.
pub fn contended_pull_ms(base: f64, floor: f64, sharing: u64) -> f64 {
    let floor = floor.min(base);
    floor + (base - floor) * (1 + sharing) as f64
}

/// Pull, compute what the source did not have, restore everything that came through the CPU tier;
/// plus the recompute a failing source is expected to leave ([`PullPlan::expected_recompute_ms`]).
fn pull_path_ms(plan: &PullPlan, prompt: u64, cpu_only: u64, rate: f64, restore: f64) -> f64 {
    let suffix = prompt.saturating_sub(plan.source_tokens);
    plan.pull_ms
        + plan.expected_recompute_ms()
        + suffix as f64 / rate * 1000.0
        + (cpu_only + plan.delta_tokens) as f64 / restore * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::Backlog;
    use crate::cost_model::CostModelParams;
    use crate::plugins::test_util::ctx;

    fn cm() -> CostModel {
        CostModel::new(CostModelParams::default())
    }

    fn cand(id: u32) -> Candidate {
        Candidate::idle(id, &format!("e{id}"))
    }

    /// An endpoint whose only request is still pulling its prefix, with `tokens` left to compute.
    fn landing_into(id: u32, tokens: u64) -> Candidate {
        let mut c = cand(id);
        (c.in_flight_requests, c.in_flight_uncached_tokens) = (1, tokens);
        (
            c.pulls_in,
            c.pulls_landing_in,
            c.pulls_landing_uncached_tokens,
        ) = (1, 1, tokens);
        c
    }

    #[test]
    fn queued_prefill_work_not_request_count_decides_the_wait() {
        // The issue's case: a tiny prompt; A has 34,891 queued prefill tokens in 1 request,
        // B has 3 short requests in flight. B must predict far lower.
        let mut a = cand(0);
        (a.in_flight_requests, a.in_flight_uncached_tokens) = (1, 34_891);
        let mut b = cand(1);
        (b.in_flight_requests, b.in_flight_uncached_tokens) = (3, 300);
        let p = TtftParams::default();
        let ctx = ctx(24, 16);
        let all = [&a, &b];
        let pa = predict(&ctx, &all, 0, &cm(), &p);
        let pb = predict(&ctx, &all, 1, &cm(), &p);
        assert!(pa.total_ms > 1000.0, "{pa:?}");
        assert!(pb.total_ms < 30.0, "{pb:?}");
    }

    #[test]
    fn a_prompt_held_in_a_cpu_tier_beats_recompute_on_an_idle_engine() {
        // 32,768 tokens entirely in A's CPU tier, A has 2 short requests in flight; B idle, cold.
        let mut a = cand(0);
        (a.cpu_blocks, a.any_blocks) = (2048, 2048);
        (a.in_flight_requests, a.in_flight_uncached_tokens) = (2, 500);
        let b = cand(1);
        let p = TtftParams::default();
        let ctx = ctx(32_768, 16);
        let all = [&a, &b];
        let pa = predict(&ctx, &all, 0, &cm(), &p);
        let pb = predict(&ctx, &all, 1, &cm(), &p);
        // Restore of 32K tokens ≈ 50 ms, recompute ≈ 1.3 s.
        assert!(pa.total_ms < 120.0, "{pa:?}");
        assert!(pb.total_ms > 1000.0, "{pb:?}");
    }

    #[test]
    fn a_pull_is_predicted_only_when_it_beats_recomputing_the_same_tokens() {
        let mut holder = cand(0);
        (holder.cpu_blocks, holder.any_blocks) = (1024, 1024); // 16,384 tokens
        let dest = cand(1);
        let on = TtftParams {
            p2p: true,
            ..TtftParams::default()
        };
        let ctx = ctx(16_384 + 256, 16);
        let all = [&holder, &dest];
        let with = predict(&ctx, &all, 1, &cm(), &on);
        let without = predict(&ctx, &all, 1, &cm(), &TtftParams::default());
        assert!(with.pulls, "{with:?}");
        assert!(with.total_ms < without.total_ms);
        let plan = with.best_pull.expect("plan");
        assert_eq!((plan.source, plan.delta_tokens), (EndpointId(0), 16_384));
        // A link already carrying 20 transfers makes the same pull lose to recompute.
        let mut busy = holder.clone();
        busy.pulls_out = 20;
        let all = [&busy, &dest];
        let shared = predict(&ctx, &all, 1, &cm(), &on);
        assert!(!shared.pulls, "{shared:?}");
        assert_eq!(shared.total_ms, without.total_ms);
        assert_eq!(shared.best_pull.expect("plan").sharing, 20);
    }

    #[test]
    fn an_engine_whose_gpu_tier_is_full_of_in_flight_work_waits_for_decodes_to_finish() {
        // A returning turn: 40K-token history. A holds it in its CPU tier and has a short prefill
        // queue, but 2x its 240K-token GPU tier in flight (decodes take 2 s there). B is cold
        // with room. On A the turn waits for ~280K tokens of decodes to end: more than B's
        // recompute. Without the capacity fact A looks fastest.
        let mut a = cand(0);
        (a.cpu_blocks, a.any_blocks) = (2_500, 2_500);
        (a.in_flight_requests, a.in_flight_uncached_tokens) = (10, 1_000);
        a.in_flight_context_tokens = 480_000;
        (a.gpu_capacity_tokens, a.decode_ms) = (Some(240_000), Some(2_000.0));
        let mut b = cand(1);
        b.in_flight_context_tokens = 60_000;
        (b.gpu_capacity_tokens, b.decode_ms) = (Some(240_000), Some(2_000.0));
        let turn = SchedulingContext {
            max_tokens: Some(200),
            ..ctx(41_000, 16)
        };
        let all = [&a, &b];
        let p = TtftParams::default();
        let (pa, pb) = (
            predict(&turn, &all, 0, &cm(), &p),
            predict(&turn, &all, 1, &cm(), &p),
        );
        // over = 480,000 + 41,200 − 240,000 = 281,200 → 2 s × 281,200 / 240,000.
        assert!((pa.kv_wait_ms - 2_343.3).abs() < 1.0, "{pa:?}");
        assert_eq!(pb.kv_wait_ms, 0.0);
        assert!(pb.total_ms < pa.total_ms, "{pa:?} {pb:?}");
        // Unknown capacity or decode time: no wait priced, A wins as before.
        let mut blind = a.clone();
        blind.gpu_capacity_tokens = None;
        let all = [&blind, &b];
        let (qa, qb) = (
            predict(&turn, &all, 0, &cm(), &p),
            predict(&turn, &all, 1, &cm(), &p),
        );
        assert_eq!(qa.kv_wait_ms, 0.0);
        assert!(qa.total_ms < qb.total_ms);
        // Blocks in-flight requests already hold are shared, not needed again.
        let mut sharing = a.clone();
        (
            sharing.in_flight_context_tokens,
            sharing.in_flight_shared_tokens,
        ) = (230_000, 40_000);
        let all = [&sharing, &b];
        assert_eq!(predict(&turn, &all, 0, &cm(), &p).kv_wait_ms, 0.0);
    }

    #[test]
    fn a_request_released_with_others_held_pulls_only_if_it_wins_after_they_overtake_it() {
        // skew-heavy's warm-up: an 8K-token prefix in O's CPU tier plus a 2K-token question.
        // O has a full prefill queue; E is idle. Placed directly, the request pulls into E.
        let mut owner = cand(0);
        (owner.cpu_blocks, owner.any_blocks) = (512, 512);
        (owner.in_flight_requests, owner.in_flight_uncached_tokens) = (2, 9_000);
        let idle = cand(1);
        let all = [&owner, &idle];
        let p = TtftParams {
            p2p: true,
            ..TtftParams::default()
        };
        let direct = ctx(10_240, 16);
        let placed = |ctx: &SchedulingContext<'_>| {
            (
                predict(ctx, &all, 0, &cm(), &p),
                predict(ctx, &all, 1, &cm(), &p),
            )
        };
        let (at_owner, at_idle) = placed(&direct);
        assert!(at_idle.pulls && at_idle.overtaken_ms == 0.0, "{at_idle:?}");
        assert!(
            at_idle.cost_ms < at_owner.cost_ms,
            "{at_owner:?} {at_idle:?}"
        );
        // Released from the admission queue with two first-seen 10K-token prompts still held:
        // up to the 8K-token share of them can be computed on E while the pull is in flight.
        // Pulling no longer beats recomputing on E, and the owner's queue is the better place.
        let released = SchedulingContext {
            backlog: Backlog {
                cold_tokens: &[10_240, 10_240],
                share_tokens: 8_192,
            },
            ..direct
        };
        let (held_owner, held_idle) = placed(&released);
        assert_eq!(held_owner, at_owner);
        assert!(
            !held_idle.pulls && held_idle.overtaken_ms == 0.0,
            "{held_idle:?}"
        );
        assert!(
            held_owner.cost_ms < held_idle.cost_ms,
            "{held_owner:?} {held_idle:?}"
        );
        // With only a 1K-token prompt held behind it, the pull still wins and waits for it.
        let few = SchedulingContext {
            backlog: Backlog {
                cold_tokens: &[1_000],
                share_tokens: 8_192,
            },
            ..direct
        };
        let (_, pulls_anyway) = placed(&few);
        assert!(pulls_anyway.pulls, "{pulls_anyway:?}");
        assert!((pulls_anyway.overtaken_ms - at_idle.queue_ms - 40.0).abs() < 1.0);
        assert!(pulls_anyway.cost_ms < at_owner.cost_ms);
        // A 30K-token prompt would rather queue behind a full share elsewhere than pay for
        // delaying the pull (0.5 × its prefill), so it does not overtake it.
        let long = SchedulingContext {
            backlog: Backlog {
                cold_tokens: &[30_000],
                share_tokens: 8_192,
            },
            ..direct
        };
        assert_eq!(placed(&long), (at_owner, at_idle));
    }

    #[test]
    fn released_cold_prompts_overtake_a_landing_pull_while_that_beats_waiting_elsewhere() {
        let backlog = Backlog {
            cold_tokens: &[1_000, 9_000],
            share_tokens: 8_192,
        };
        // An idle endpoint, 20K tokens queued elsewhere: both come here (9,000 × 0.5 + 1,000
        // ahead of it < 20,000), the second released while 1,000 ≤ the share.
        assert_eq!(backlog.overtaking(0, 0, 20_000, 0.5), 10_000);
        // 5,000 elsewhere: the 9,000-token prompt would wait 1,000 + 4,500 charged here.
        assert_eq!(backlog.overtaking(0, 0, 5_000, 0.5), 1_000);
        // Two pulls landing here double the charge.
        assert_eq!(backlog.overtaking(0, 0, 9_500, 0.5), 10_000);
        assert_eq!(backlog.overtaking(0, 0, 9_500, 1.0), 1_000);
        // 8,000 queued: the queue releases one more request onto it, then its share is full.
        assert_eq!(backlog.overtaking(8_000, 8_000, 20_000, 0.5), 1_000);
        // Over its share: the queue releases nothing while this endpoint is the one with room.
        assert_eq!(backlog.overtaking(9_000, 2_000, 20_000, 0.5), 0);
        assert_eq!(Backlog::default().overtaking(0, 0, 20_000, 0.5), 0);
    }

    #[test]
    fn a_long_prefill_avoids_an_endpoint_whose_requests_are_still_pulling() {
        // A pulled turn (2K tokens left to compute) is on its way into A: its pull lands in
        // ~200 ms and it then queues behind whatever A got meanwhile. B has 2.5K tokens queued
        // and nobody pulling. A cold 30K-token prompt must go to B: on A it would start 100 ms
        // sooner and make the pulled turn wait its whole 1.2 s prefill.
        let a = landing_into(0, 2_000);
        let mut b = cand(1);
        (b.in_flight_requests, b.in_flight_uncached_tokens) = (1, 2_500);
        let cold = ctx(30_000, 16);
        let all = [&a, &b];
        let p = TtftParams::default();
        let (pa, pb) = (
            predict(&cold, &all, 0, &cm(), &p),
            predict(&cold, &all, 1, &cm(), &p),
        );
        assert!(
            pa.total_ms < pb.total_ms,
            "A still starts it sooner: {pa:?} {pb:?}"
        );
        assert_eq!(pa.queue_ms, 0.0, "the pulled turn will be behind it");
        assert!(pa.delays_pulling_ms > 500.0 && pb.delays_pulling_ms == 0.0);
        assert!(pb.cost_ms < pa.cost_ms, "{pa:?} {pb:?}");
        // Weight 0 restores the greedy choice.
        let greedy = TtftParams {
            pulling_delay_weight: 0.0,
            ..TtftParams::default()
        };
        let (ga, gb) = (
            predict(&cold, &all, 0, &cm(), &greedy),
            predict(&cold, &all, 1, &cm(), &greedy),
        );
        assert!(ga.cost_ms < gb.cost_ms, "{ga:?} {gb:?}");
        // A short prompt is charged only its own short prefill.
        let short = predict(&ctx(512, 16), &all, 0, &cm(), &p);
        assert!(short.delays_pulling_ms < 25.0, "{short:?}");
    }

    #[test]
    fn a_first_seen_prompt_takes_the_engine_a_short_pulled_request_is_landing_on() {
        // A burst's warm-up: every engine but A is prefilling a first-seen 10K-token prompt; A
        // has only a pulled request (2K-token question) landing. The next first-seen prompt
        // starts at once on A, delaying the pulled one by its prefill, or waits a whole prefill
        // anywhere else: A (with pulls' delay counted at the default half weight).
        let a = landing_into(0, 2_048);
        let mut b = cand(1);
        (b.in_flight_requests, b.in_flight_uncached_tokens) = (1, 10_240);
        let cold = ctx(10_240, 16);
        let all = [&a, &b];
        let p = TtftParams::default();
        let (pa, pb) = (
            predict(&cold, &all, 0, &cm(), &p),
            predict(&cold, &all, 1, &cm(), &p),
        );
        assert!(pa.delays_pulling_ms > 0.0);
        assert!(pa.cost_ms < pb.cost_ms, "{pa:?} {pb:?}");
    }

    #[test]
    fn a_pulled_request_queues_behind_pulls_landing_before_it_and_delays_none() {
        // A holds nothing of the prompt; its three queued requests are all still pulling. The
        // request pulls its 16K-token prefix from H into A as well: it lands after them and
        // computes after them.
        let mut holder = cand(0);
        (holder.cpu_blocks, holder.any_blocks) = (1024, 1024);
        let mut a = cand(1);
        (
            a.in_flight_requests,
            a.in_flight_uncached_tokens,
            a.pulls_in,
            a.pulls_landing_in,
            a.pulls_landing_uncached_tokens,
        ) = (3, 6_000, 3, 3, 6_000);
        let on = TtftParams {
            p2p: true,
            ..TtftParams::default()
        };
        let warm = ctx(16_384 + 2_048, 16);
        let pa = predict(&warm, &[&holder, &a], 1, &cm(), &on);
        assert!(pa.pulls, "{pa:?}");
        assert!((pa.queue_ms - 240.0).abs() < 1e-9, "{pa:?}");
        assert_eq!(pa.delays_pulling_ms, 0.0);
    }

    #[test]
    fn a_pull_that_has_landed_is_not_delayed_by_what_comes_after_it() {
        // As above, but A's pull is over: the pulled turn already waits in A's queue, ahead of
        // anything placed now, until its first byte. The cold prompt goes where it starts first.
        let mut a = cand(0);
        (
            a.in_flight_requests,
            a.in_flight_uncached_tokens,
            a.pulls_in,
        ) = (1, 2_000, 1);
        let mut b = cand(1);
        (b.in_flight_requests, b.in_flight_uncached_tokens) = (1, 2_500);
        let cold = ctx(30_000, 16);
        let all = [&a, &b];
        let p = TtftParams::default();
        let (pa, pb) = (
            predict(&cold, &all, 0, &cm(), &p),
            predict(&cold, &all, 1, &cm(), &p),
        );
        assert_eq!(pa.delays_pulling_ms, 0.0);
        assert!(pa.cost_ms < pb.cost_ms, "{pa:?} {pb:?}");
    }

    #[test]
    fn small_deltas_and_sources_without_p2p_are_never_pulled() {
        let mut holder = cand(0);
        (holder.cpu_blocks, holder.any_blocks) = (16, 16); // 256 tokens < min_pull_tokens
        let dest = cand(1);
        let on = TtftParams {
            p2p: true,
            ..TtftParams::default()
        };
        let ctx = ctx(4096, 16);
        let pred = predict(&ctx, &[&holder, &dest], 1, &cm(), &on);
        assert!(pred.best_pull.is_none() && !pred.pulls);
        let mut no_p2p = holder.clone();
        (no_p2p.cpu_blocks, no_p2p.any_blocks, no_p2p.has_p2p) = (256, 256, false);
        let pred = predict(&ctx, &[&no_p2p, &dest], 1, &cm(), &on);
        assert!(pred.best_pull.is_none());
    }

    #[test]
    fn bad_params_are_refused() {
        let mut p = TtftParams::default();
        assert!(p.validate().is_ok());
        p.restore_tokens_per_second = 0.0;
        assert!(p.validate().is_err());
        let p = TtftParams {
            margin_ms: f64::NAN,
            ..TtftParams::default()
        };
        assert!(p.validate().is_err());
    }
}
