//! Decision audit: why an arm won or lost, from the router's own records.
//!
//! Joins each request the client sent (by `x-request-id`) with the decision the router recorded
//! for it (`/debug/decisions`) and answers three questions with numbers:
//!
//! 1. **Did the index tell the truth?** The router expected `any_tokens` of the prompt cached on
//!    the endpoint it chose (plus the tokens of a pull it named); the engine reports what it
//!    actually found (`usage.prompt_tokens_details.cached_tokens`). More expected than found is a
//!    stale index (evicted blocks still listed, or a pull that came back partial); less is a
//!    late one (events not yet seen).
//! 2. **How far was each placement from the cost function's choice?** Every candidate the
//!    router saw is re-priced with [`kvmesh_sched::predict`] on the router's view at decision
//!    time (its index matches, its in-flight prefill tokens and requests); the regret of a
//!    decision is the chosen endpoint's predicted TTFT minus the best one's. This is an oracle
//!    over the router's view, not over the engines' hidden state; item 1 bounds how wrong that
//!    view was at the chosen endpoint.
//! 3. **Did the pulls pay?** A pull paid when the engine found at least the tokens the router
//!    expected (the pull landed) — otherwise the request paid the pull and recomputed anyway.
//!
//! Pure: JSON in, summary out.

use std::sync::Arc;

use kvmesh_index::EndpointId;
use kvmesh_sched::cost_model::{CostModel, CostModelParams};
use kvmesh_sched::predict::{TtftParams, predict};
use kvmesh_sched::{Candidate, SchedulingContext};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What the client knows about one request.
#[derive(Debug, Clone)]
pub struct ClientView<'a> {
    pub request_id: &'a str,
    /// Model seconds.
    pub ttft_s: Option<f64>,
    pub cached_tokens: Option<u64>,
}

/// The audit of one arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Audit {
    /// Requests joined with a decision record.
    pub joined: usize,
    /// Index truth at the chosen endpoint (requests whose engine reported cached tokens).
    pub index_checked: usize,
    /// The engine found what the router expected, within one block.
    pub index_exact: usize,
    /// The router expected more than the engine found (stale index or partial pull).
    pub index_over: usize,
    pub index_over_tokens: u64,
    /// The engine found more than the router expected (events not yet indexed).
    pub index_under: usize,
    pub index_under_tokens: u64,
    /// Decisions whose chosen endpoint was predicted more than 10 ms slower than the best.
    pub regret_decisions: usize,
    pub regret_ms_mean: f64,
    pub regret_ms_p90: f64,
    /// Requests where no endpoint held more than `cold_max_tokens` of the prompt (placement
    /// alone decides): measured TTFT percentiles (model s).
    pub cold_requests: usize,
    pub cold_ttft_p50_s: f64,
    pub cold_ttft_p99_s: f64,
    /// Predicted TTFT (at the chosen endpoint) vs measured, median of measured / predicted.
    pub ttft_measured_over_predicted_p50: Option<f64>,
    pub pulls_named: usize,
    /// The engine found at least what the router expected after the pull.
    pub pulls_landed: usize,
    /// Tokens the router expected pulled that the engine did not find (recomputed).
    pub pull_tokens_missing: u64,
    /// Decisions whose P2P step skipped a source for cost (`mode: predicted` / `cost_model`).
    pub pulls_skipped_for_cost: usize,
}

/// A request "has nothing reusable" when no candidate holds more than this (the trace's shared
/// 512-token system block is everywhere).
pub const COLD_MAX_TOKENS: u64 = 512;

fn num(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

fn candidate_of(i: usize, c: &Value, block_size: u64) -> Candidate {
    let blocks = |key: &str| (num(c, key) as u64 / block_size.max(1)) as usize;
    let name = c.get("endpoint").and_then(Value::as_str).unwrap_or("");
    Candidate {
        endpoint: EndpointId(i as u32),
        name: Arc::from(name),
        gpu_blocks: blocks("gpu_tokens"),
        cpu_blocks: blocks("cpu_tokens"),
        any_blocks: blocks("any_tokens"),
        in_flight_requests: num(c, "in_flight_requests") as u64,
        in_flight_uncached_tokens: num(c, "in_flight_uncached_tokens") as u64,
        in_flight_decode_tokens: 0,
        in_flight_context_tokens: num(c, "in_flight_context_tokens") as u64,
        in_flight_shared_tokens: num(c, "in_flight_shared_tokens") as u64,
        gpu_capacity_tokens: c.get("gpu_capacity_tokens").and_then(Value::as_u64),
        decode_ms: c.get("decode_ms").and_then(Value::as_f64),
        waiting: c.get("waiting").and_then(Value::as_f64),
        running: c.get("running").and_then(Value::as_f64),
        kv_usage: c.get("kv_usage").and_then(Value::as_f64),
        has_p2p: true,
        pulls_in: num(c, "pulls_in") as u64,
        pulls_out: num(c, "pulls_out") as u64,
        // Decisions recorded before the router told landing pulls apart charged every pull
        // in flight.
        pulls_landing_in: c
            .get("pulls_landing_in")
            .and_then(Value::as_u64)
            .unwrap_or(num(c, "pulls_in") as u64),
        pulls_landing_uncached_tokens: num(c, "pulls_landing_uncached_tokens") as u64,
        // Recorded decisions name the group when the endpoint had one; pricing a replayed
        // placement must keep pulls inside it as the router did.
        kv_group: c.get("kv_group").and_then(Value::as_str).map(Arc::from),
        // Decision records do not carry reputations: replayed as a fleet with none.
        source_standing: Default::default(),
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Audits one arm. `decisions` is the router's `/debug/decisions` array; `pulls` says whether
/// the arm may pull (pull paths are then priced too); `block_size` is the router's.
pub fn audit(
    decisions: &[Value],
    clients: &[ClientView<'_>],
    pulls: bool,
    block_size: u64,
) -> Audit {
    let by_id: std::collections::HashMap<&str, &Value> = decisions
        .iter()
        .filter_map(|d| Some((d.get("request_id")?.as_str()?, d)))
        .collect();
    let cm = CostModel::new(CostModelParams::default());
    let params = TtftParams {
        p2p: pulls,
        ..TtftParams::default()
    };
    let mut a = Audit::default();
    let mut regrets = Vec::new();
    let mut cold = Vec::new();
    let mut ratios = Vec::new();
    for c in clients {
        let Some(d) = by_id.get(c.request_id) else {
            continue;
        };
        a.joined += 1;
        let Some(cands) = d.get("candidates").and_then(Value::as_array) else {
            continue;
        };
        let chosen_name = d.get("endpoint").and_then(Value::as_str).unwrap_or("");
        let Some(chosen) = cands
            .iter()
            .position(|x| x.get("endpoint").and_then(Value::as_str) == Some(chosen_name))
        else {
            continue;
        };
        let prompt = num(d, "prompt_tokens") as u64;
        let p2p = d.get("p2p").filter(|p| !p.is_null());
        let named = p2p
            .and_then(|p| p.get("source_endpoint"))
            .is_some_and(|s| !s.is_null())
            && p2p
                .and_then(|p| p.get("skipped"))
                .is_none_or(Value::is_null);
        if p2p
            .and_then(|p| p.get("skipped"))
            .and_then(Value::as_str)
            .is_some_and(|s| s == "cost")
        {
            a.pulls_skipped_for_cost += 1;
        }
        let local = num(&cands[chosen], "any_tokens") as u64;
        let pulled = if named {
            p2p.map_or(0.0, |p| num(p, "delta_tokens")).max(0.0) as u64
        } else {
            0
        };
        let expected = (local + pulled).min(prompt);
        if let Some(found) = c.cached_tokens {
            a.index_checked += 1;
            // vLLM recomputes the last token of a fully cached prompt: allow one block.
            if expected > found + block_size {
                a.index_over += 1;
                a.index_over_tokens += expected - found;
            } else if found > expected + block_size {
                a.index_under += 1;
                a.index_under_tokens += found - expected;
            } else {
                a.index_exact += 1;
            }
            if named {
                a.pulls_named += 1;
                if found + block_size >= expected {
                    a.pulls_landed += 1;
                } else {
                    a.pull_tokens_missing += (expected - found).min(pulled);
                }
            }
        } else if named {
            a.pulls_named += 1;
        }
        let view: Vec<Candidate> = cands
            .iter()
            .enumerate()
            .map(|(i, x)| candidate_of(i, x, block_size))
            .collect();
        let refs: Vec<&Candidate> = view.iter().collect();
        let ctx = SchedulingContext {
            request_id: c.request_id,
            prompt_tokens: prompt as usize,
            total_blocks: (prompt / block_size.max(1)) as usize,
            block_size: block_size as usize,
            max_tokens: None,
            backlog: Default::default(),
            may_pull: true,
        };
        let costs: Vec<f64> = (0..refs.len())
            .map(|i| predict(&ctx, &refs, i, &cm, &params).total_ms)
            .collect();
        let best = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let regret = costs[chosen] - best;
        if regret > 10.0 {
            a.regret_decisions += 1;
        }
        regrets.push(regret.max(0.0));
        let max_any = cands
            .iter()
            .map(|x| num(x, "any_tokens") as u64)
            .max()
            .unwrap_or(0);
        if let Some(t) = c.ttft_s {
            if max_any <= COLD_MAX_TOKENS {
                cold.push(t);
            }
            if costs[chosen] > 0.0 && costs[chosen].is_finite() {
                ratios.push(t * 1000.0 / costs[chosen]);
            }
        }
    }
    let sort = |v: &mut Vec<f64>| v.sort_by(|x, y| x.total_cmp(y));
    sort(&mut regrets);
    sort(&mut cold);
    sort(&mut ratios);
    if !regrets.is_empty() {
        a.regret_ms_mean = regrets.iter().sum::<f64>() / regrets.len() as f64;
        a.regret_ms_p90 = percentile(&regrets, 0.9);
    }
    a.cold_requests = cold.len();
    a.cold_ttft_p50_s = percentile(&cold, 0.5);
    a.cold_ttft_p99_s = percentile(&cold, 0.99);
    a.ttft_measured_over_predicted_p50 = (!ratios.is_empty()).then(|| percentile(&ratios, 0.5));
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cand(name: &str, any: u64, cpu: u64, queued: u64) -> Value {
        json!({"endpoint": name, "gpu_tokens": any - cpu.min(any), "cpu_tokens": cpu, "any_tokens": any,
               "in_flight_requests": u64::from(queued > 0), "in_flight_uncached_tokens": queued,
               "waiting": null, "running": null, "kv_usage": null, "kept": true, "scores": {}, "total": 1.0})
    }

    #[test]
    fn stale_index_regret_and_unpaid_pulls_are_counted() {
        let decisions = vec![
            // r1: sent to the busy engine although an idle one was as cold (regret ≈ 1.2 s).
            json!({"request_id": "r1", "endpoint": "a", "prompt_tokens": 2048,
                   "candidates": [cand("a", 0, 0, 30_000), cand("b", 0, 0, 0)], "p2p": null}),
            // r2: router expected 4,096 cached on b, engine found 1,024 (stale).
            json!({"request_id": "r2", "endpoint": "b", "prompt_tokens": 8192,
                   "candidates": [cand("a", 0, 0, 0), cand("b", 4096, 0, 0)], "p2p": null}),
            // r3: a pull of 4,096 tokens that landed only half.
            json!({"request_id": "r3", "endpoint": "a", "prompt_tokens": 8192,
                   "candidates": [cand("a", 0, 0, 0), cand("b", 4096, 4096, 0)],
                   "p2p": {"source_endpoint": "b", "skipped": null, "delta_tokens": 4096}}),
            json!({"request_id": "r4", "endpoint": "a", "prompt_tokens": 8192,
                   "candidates": [cand("a", 0, 0, 0), cand("b", 4096, 4096, 0)],
                   "p2p": {"source_endpoint": "b", "skipped": "cost", "delta_tokens": 4096}}),
        ];
        let clients = [
            ClientView {
                request_id: "r1",
                ttft_s: Some(1.3),
                cached_tokens: Some(0),
            },
            ClientView {
                request_id: "r2",
                ttft_s: Some(0.3),
                cached_tokens: Some(1024),
            },
            ClientView {
                request_id: "r3",
                ttft_s: Some(0.2),
                cached_tokens: Some(2048),
            },
            ClientView {
                request_id: "r4",
                ttft_s: Some(0.3),
                cached_tokens: Some(0),
            },
            ClientView {
                request_id: "unknown",
                ttft_s: Some(0.1),
                cached_tokens: Some(0),
            },
        ];
        let a = audit(&decisions, &clients, true, 16);
        assert_eq!(a.joined, 4);
        assert_eq!(a.index_checked, 4);
        assert_eq!((a.index_over, a.index_over_tokens), (2, 3072 + 2048));
        assert_eq!(a.index_exact, 2);
        assert_eq!(
            (a.pulls_named, a.pulls_landed, a.pull_tokens_missing),
            (1, 0, 2048)
        );
        assert_eq!(a.pulls_skipped_for_cost, 1);
        // r1 (busy engine), r3 (pulled to a while idle b holds it) and r4 (recomputed on a).
        assert_eq!(a.regret_decisions, 3, "{a:?}");
        assert!(a.regret_ms_p90 > 1000.0);
        // r1 is the one request where nobody held anything beyond 512 tokens.
        assert_eq!(a.cold_requests, 1);
        assert_eq!(a.cold_ttft_p50_s, 1.3);
    }
}
