//! The P2P cost model: predicted recompute time vs predicted pull time, with rates learned online.
//!
//! Per endpoint a prefill rate (tokens/s) and per (source, destination) pair a pull rate
//! (tokens/s) plus a fixed per-pull floor (connection, lookup, first frame). Rates start at the
//! configured defaults (`docs/architecture.md#reference-experiments`: gpt-oss-120b on H200 recomputes ≈25K tok/s; pulls cost ≈26 ms +
//! 235K tok/s) and follow observations with an EWMA. Observations are the engines' own timings:
//! (1) prefill rates from each engine's reported counters between two scrapes — computed prompt
//! tokens (`vllm:prompt_tokens_by_source_total{source="local_compute"}`) per second of reported
//! TTFT minus queue time, in intervals without pulled tokens; (2) destination-level pull rates from
//! each engine's reported pull counters between two scrapes — blocks pulled in
//! (`kvmesh_p2p_blocks_total{direction="in"}`) times the block size, per second of reported pull
//! time (`kvmesh_p2p_pull_duration_seconds_sum`) minus the floor for each pull
//! (`…_count`). The engine does not say which peer it pulled from, so this rate belongs to the
//! destination (the engine that pulled) and covers all of its sources; (3) per request, the time
//! to first byte of a streamed response on an otherwise idle endpoint (so queueing does not
//! pollute it). A pull request's TTFT minus the predicted recompute of what it still computed,
//! minus the floor, is a per-pair pull-rate sample (the only source that knows the pair).
//! [`CostModel::pull_rate`] uses the pair's learned rate if it has one, else the destination's,
//! else the configured default.
//!
//! Learned pull rates are **uncontended** link rates. A pull's observed time includes whatever
//! shared its links (the sim's link model and a real NIC both split a link among its
//! transfers), and the predictions stretch the uncontended time by the transfers sharing the
//! link *now* ([`crate::predict::contended_pull_ms`]: bandwidth part × (1 + sharing)). Learning
//! the observed rate as is would count contention twice: pulls learned during a 6-way fan-out
//! would teach a ~6× slower rate, and the next fan-out would be stretched 6× again on top. So
//! each sample is first divided by the same factor the prediction multiplies by: the
//! per-request sample by its own `1 + pull_sharing`, the counter samples by the mean
//! `1 + sharing` of the pulls named into the destination over the interval
//! ([`uncontended_time`]). The router only knows the transfers already in flight when it names
//! a pull, not those that start later, so a sample from a burst stays partly contended (the
//! learned rate errs slow, never doubly).
//! The inverse holds exactly for a sample whose sharing stayed what it was when the pull was
//! named: learning it and predicting the same sharing gives back the observed time.
//! Plain data structure; the gateway and the scrape loop feed it and `/metrics` exports the learned
//! rates.

use std::collections::HashMap;
use std::time::Duration;

use kvmesh_index::EndpointId;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

/// Defaults and learning parameters (`cost_model:` in the router config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostModelParams {
    /// Prefill rate assumed for an endpoint before it has been observed.
    pub prefill_tokens_per_second: f64,
    /// Pull rate assumed for a pair before it has been observed.
    pub pull_tokens_per_second: f64,
    /// Fixed cost of any pull (ms).
    pub pull_floor_ms: f64,
    /// EWMA weight of a new sample.
    pub ewma_alpha: f64,
    /// Samples over fewer tokens are ignored (dominated by HTTP and scheduling overhead).
    pub min_sample_tokens: u64,
}

impl Default for CostModelParams {
    fn default() -> Self {
        CostModelParams {
            prefill_tokens_per_second: 25_000.0,
            pull_tokens_per_second: 235_000.0,
            pull_floor_ms: 26.0,
            ewma_alpha: 0.2,
            min_sample_tokens: 256,
        }
    }
}

/// A learned rate and how many samples shaped it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LearnedRate {
    pub tokens_per_second: f64,
    pub samples: u64,
}

/// One completed prefill as observed by the router.
#[derive(Debug, Clone, Copy)]
pub struct Observation {
    pub endpoint: EndpointId,
    /// Prompt tokens the endpoint computed itself (prompt − local prefix − pulled).
    pub computed_tokens: u64,
    /// The source and token count of a pull named for this request.
    pub pulled: Option<(EndpointId, u64)>,
    /// Transfers already on the busier end of that pull's links when it was named (what the
    /// prediction stretched it by); 0 without a pull.
    pub pull_sharing: u64,
    /// Time to first token.
    pub ttft: Duration,
}

pub struct CostModel {
    params: CostModelParams,
    prefill: RwLock<HashMap<EndpointId, LearnedRate>>,
    pull: RwLock<HashMap<(EndpointId, EndpointId), LearnedRate>>,
    /// Destination-level pull rates, from the engines' own pull counters (any source).
    pull_into: RwLock<HashMap<EndpointId, LearnedRate>>,
}

impl CostModel {
    pub fn new(params: CostModelParams) -> Self {
        CostModel {
            params,
            prefill: RwLock::new(HashMap::new()),
            pull: RwLock::new(HashMap::new()),
            pull_into: RwLock::new(HashMap::new()),
        }
    }

    pub fn params(&self) -> &CostModelParams {
        &self.params
    }

    pub fn prefill_rate(&self, endpoint: EndpointId) -> f64 {
        self.prefill
            .read()
            .get(&endpoint)
            .map_or(self.params.prefill_tokens_per_second, |r| {
                r.tokens_per_second
            })
    }

    /// Pull rate from `source` into `dest`: the pair's learned rate if it has samples, else the
    /// destination's learned rate (from its own pull counters) if it has samples, else the default.
    pub fn pull_rate(&self, source: EndpointId, dest: EndpointId) -> f64 {
        if let Some(r) = self
            .pull
            .read()
            .get(&(source, dest))
            .filter(|r| r.samples > 0)
        {
            return r.tokens_per_second;
        }
        self.pull_rate_into(dest)
    }

    /// Pull rate into `dest` from any source: its learned rate if it has samples, else the default.
    pub fn pull_rate_into(&self, dest: EndpointId) -> f64 {
        self.pull_into
            .read()
            .get(&dest)
            .filter(|r| r.samples > 0)
            .map_or(self.params.pull_tokens_per_second, |r| r.tokens_per_second)
    }

    /// Predicted time for `dest` to compute `tokens` prompt tokens (ms).
    pub fn predict_recompute_ms(&self, dest: EndpointId, tokens: u64) -> f64 {
        tokens as f64 / self.prefill_rate(dest).max(1e-9) * 1000.0
    }

    /// Predicted time to compute `tokens` prompt tokens at the configured prefill rate (ms): the
    /// same for every endpoint (the admission queue's priority).
    pub fn predict_recompute_ms_configured(&self, tokens: u64) -> f64 {
        tokens as f64 / self.params.prefill_tokens_per_second.max(1e-9) * 1000.0
    }

    /// Predicted time for `dest` to pull `tokens` tokens of KV from `source` (ms).
    pub fn predict_pull_ms(&self, source: EndpointId, dest: EndpointId, tokens: u64) -> f64 {
        self.params.pull_floor_ms + tokens as f64 / self.pull_rate(source, dest).max(1e-9) * 1000.0
    }

    /// Learns a prefill-rate sample: `tokens` computed in `time` (from the router's view of a
    /// request, or from the engine's own counters between two scrapes).
    pub fn observe_prefill_rate(&self, endpoint: EndpointId, tokens: u64, time: Duration) -> bool {
        let rate = self.sample_rate(tokens, time);
        if let Some(rate) = rate {
            let default = self.params.prefill_tokens_per_second;
            update(
                &mut self.prefill.write(),
                endpoint,
                rate,
                default,
                self.params.ewma_alpha,
            );
        }
        rate.is_some()
    }

    /// `tokens / time`, if the sample is big enough to learn from.
    fn sample_rate(&self, tokens: u64, time: Duration) -> Option<f64> {
        let secs = time.as_secs_f64();
        (tokens >= self.params.min_sample_tokens && secs > 0.0).then(|| tokens as f64 / secs)
    }

    /// Learns a destination-level pull-rate sample: `dest` pulled `tokens` tokens of KV (from any
    /// source) in `time`, the per-pull floor already taken out (from the engine's own pull
    /// counters between two scrapes).
    pub fn observe_pull_rate_into(&self, dest: EndpointId, tokens: u64, time: Duration) -> bool {
        let rate = self.sample_rate(tokens, time);
        if let Some(rate) = rate {
            let default = self.params.pull_tokens_per_second;
            update(
                &mut self.pull_into.write(),
                dest,
                rate,
                default,
                self.params.ewma_alpha,
            );
        }
        rate.is_some()
    }

    /// Learns from one observed prefill. Returns whether a rate was updated.
    pub fn observe(&self, obs: Observation) -> bool {
        let ttft_ms = obs.ttft.as_secs_f64() * 1000.0;
        if ttft_ms <= 0.0 {
            return false;
        }
        match obs.pulled {
            None => self.observe_prefill_rate(obs.endpoint, obs.computed_tokens, obs.ttft),
            Some((source, pulled)) => {
                if pulled < self.params.min_sample_tokens {
                    return false;
                }
                // The link's own time for these tokens: what the pull took beyond the floor,
                // with the share of the link the other transfers took given back.
                let transfer_ms = (ttft_ms
                    - self.predict_recompute_ms(obs.endpoint, obs.computed_tokens)
                    - self.params.pull_floor_ms)
                    / (1 + obs.pull_sharing) as f64;
                // A pull that seemingly took no time says more about noise than about the link.
                if transfer_ms <= 0.5 {
                    return false;
                }
                let sample = pulled as f64 / (transfer_ms / 1000.0);
                // A new pair starts from the destination's learned rate (the 10× bound applies to it).
                let default = self.pull_rate_into(obs.endpoint);
                update(
                    &mut self.pull.write(),
                    (source, obs.endpoint),
                    sample,
                    default,
                    self.params.ewma_alpha,
                );
                true
            }
        }
    }

    /// Learned prefill rates (observed endpoints only), sorted by endpoint.
    pub fn prefill_rates(&self) -> Vec<(EndpointId, LearnedRate)> {
        let mut v: Vec<_> = self.prefill.read().iter().map(|(k, r)| (*k, *r)).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Learned pull rates ((source, dest) → rate), sorted.
    pub fn pull_rates(&self) -> Vec<((EndpointId, EndpointId), LearnedRate)> {
        let mut v: Vec<_> = self.pull.read().iter().map(|(k, r)| (*k, *r)).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Learned destination-level pull rates (dest → rate, observed endpoints only), sorted.
    pub fn pull_into_rates(&self) -> Vec<(EndpointId, LearnedRate)> {
        let mut v: Vec<_> = self
            .pull_into
            .read()
            .iter()
            .map(|(k, r)| (*k, *r))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Drops everything learned about an endpoint that left the fleet.
    pub fn forget_endpoint(&self, endpoint: EndpointId) {
        self.prefill.write().remove(&endpoint);
        self.pull_into.write().remove(&endpoint);
        self.pull
            .write()
            .retain(|(s, d), _| *s != endpoint && *d != endpoint);
    }
}

/// The time `pulls` pulls would have taken alone, from the `time` they took beyond their floors
/// while sharing their links: `time` over their mean stretch factor, `share_sum / pulls` (each
/// pull's `1 + sharing`). Without pulls counted (`pulls == 0`, e.g. pulls another router named)
/// the time is taken as uncontended.
pub fn uncontended_time(time: Duration, pulls: u64, share_sum: u64) -> Duration {
    if pulls == 0 {
        return time;
    }
    let mean = (share_sum as f64 / pulls as f64).max(1.0);
    time.div_f64(mean)
}

fn update<K: std::hash::Hash + Eq>(
    map: &mut HashMap<K, LearnedRate>,
    key: K,
    sample: f64,
    default: f64,
    alpha: f64,
) {
    let entry = map.entry(key).or_insert(LearnedRate {
        tokens_per_second: default,
        samples: 0,
    });
    // One sample moves at most 10× either way: a hiccup cannot make the model absurd, yet a badly
    // wrong default (e.g. a sim fleet with --time-scale) is corrected within a few samples.
    let sample = sample.clamp(
        entry.tokens_per_second / 10.0,
        entry.tokens_per_second * 10.0,
    );
    entry.tokens_per_second = if entry.samples == 0 {
        sample
    } else {
        alpha * sample + (1.0 - alpha) * entry.tokens_per_second
    };
    entry.samples += 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: EndpointId = EndpointId(0);
    const B: EndpointId = EndpointId(1);

    #[test]
    fn defaults_predict_the_design_table() {
        let m = CostModel::new(CostModelParams::default());
        // 8192 tokens: recompute 8192/25000 s = 327.68 ms; pull 26 + 8192/235000 s = 60.86 ms.
        assert!((m.predict_recompute_ms(A, 8192) - 327.68).abs() < 1e-9);
        assert!((m.predict_pull_ms(B, A, 8192) - 60.859_574).abs() < 1e-4);
    }

    #[test]
    fn prefill_rate_learns_by_ewma() {
        let m = CostModel::new(CostModelParams::default());
        // First sample replaces the default: 10,000 tokens in 1 s.
        assert!(m.observe(Observation {
            endpoint: A,
            computed_tokens: 10_000,
            pulled: None,
            pull_sharing: 0,
            ttft: Duration::from_secs(1)
        }));
        assert!((m.prefill_rate(A) - 10_000.0).abs() < 1e-9);
        // Second: 20,000 tok/s → 0.2·20,000 + 0.8·10,000 = 12,000.
        m.observe(Observation {
            endpoint: A,
            computed_tokens: 10_000,
            pulled: None,
            pull_sharing: 0,
            ttft: Duration::from_millis(500),
        });
        assert!((m.prefill_rate(A) - 12_000.0).abs() < 1e-9);
        assert_eq!(m.prefill_rate(B), 25_000.0);
        // Tiny prompts are ignored.
        assert!(!m.observe(Observation {
            endpoint: B,
            computed_tokens: 10,
            pulled: None,
            pull_sharing: 0,
            ttft: Duration::from_millis(5)
        }));
    }

    #[test]
    fn pull_rate_subtracts_recompute_and_floor() {
        let m = CostModel::new(CostModelParams::default());
        m.observe(Observation {
            endpoint: A,
            computed_tokens: 10_000,
            pulled: None,
            pull_sharing: 0,
            ttft: Duration::from_secs(1),
        });
        // A pulled 4096 from B and computed 1000 itself: TTFT 142 ms = 100 ms recompute + 26 floor + 16 ms.
        let learned = m.observe(Observation {
            endpoint: A,
            computed_tokens: 1000,
            pulled: Some((B, 4096)),
            pull_sharing: 0,
            ttft: Duration::from_millis(142),
        });
        assert!(learned);
        assert!(
            (m.pull_rate(B, A) - 256_000.0).abs() < 1e-6,
            "{}",
            m.pull_rate(B, A)
        );
        assert_eq!(m.pull_rate(A, B), 235_000.0);
        m.forget_endpoint(B);
        assert_eq!(m.pull_rate(B, A), 235_000.0);
    }

    #[test]
    fn pull_rate_falls_back_pair_then_destination_then_default() {
        const C: EndpointId = EndpointId(2);
        let m = CostModel::new(CostModelParams::default());
        assert_eq!(m.pull_rate(B, A), 235_000.0);
        // Too few tokens, or no time: ignored.
        assert!(!m.observe_pull_rate_into(A, 100, Duration::from_millis(1)));
        assert!(!m.observe_pull_rate_into(A, 100_000, Duration::ZERO));
        assert_eq!(m.pull_rate_into(A), 235_000.0);
        // A's own counters: 100,000 tokens in 1 s → every source into A defaults to 100K tok/s.
        assert!(m.observe_pull_rate_into(A, 100_000, Duration::from_secs(1)));
        assert!((m.pull_rate_into(A) - 100_000.0).abs() < 1e-9);
        assert!((m.pull_rate(B, A) - 100_000.0).abs() < 1e-9);
        assert!((m.pull_rate(C, A) - 100_000.0).abs() < 1e-9);
        // Other destinations keep the default.
        assert_eq!(m.pull_rate(A, B), 235_000.0);
        // Second sample: 0.2·200,000 + 0.8·100,000 = 120,000.
        m.observe_pull_rate_into(A, 100_000, Duration::from_millis(500));
        assert!((m.pull_rate_into(A) - 120_000.0).abs() < 1e-6);
        // A learned pair rate wins over the destination's: B → A at 256K tok/s (see above).
        m.observe(Observation {
            endpoint: A,
            computed_tokens: 0,
            pulled: Some((B, 4096)),
            pull_sharing: 0,
            ttft: Duration::from_millis(42),
        });
        assert!((m.pull_rate(B, A) - 256_000.0).abs() < 1e-6);
        assert!((m.pull_rate(C, A) - 120_000.0).abs() < 1e-6);
        assert_eq!(m.pull_into_rates().len(), 1);
        m.forget_endpoint(A);
        assert_eq!(m.pull_rate(C, A), 235_000.0);
        assert!(m.pull_into_rates().is_empty());
    }

    #[test]
    fn contended_pulls_teach_the_uncontended_rate_so_contention_is_priced_once() {
        use crate::predict::contended_pull_ms;
        // A's prefill rate known (10K tok/s). B's link is at 256K tok/s alone, and A pulled
        // 4,096 tokens from B while 3 other pulls shared B's link: the bandwidth part took
        // 4 × 16 ms, TTFT = 100 ms recompute + 26 ms floor + 64 ms.
        let m = CostModel::new(CostModelParams::default());
        m.observe(Observation {
            endpoint: A,
            computed_tokens: 10_000,
            pulled: None,
            pull_sharing: 0,
            ttft: Duration::from_secs(1),
        });
        assert!(m.observe(Observation {
            endpoint: A,
            computed_tokens: 1000,
            pulled: Some((B, 4096)),
            pull_sharing: 3,
            ttft: Duration::from_millis(190),
        }));
        // The link rate, not a 4× slower one: a lone pull is predicted at 26 + 16 ms ...
        assert!((m.pull_rate(B, A) - 256_000.0).abs() < 1e-6);
        assert!((m.predict_pull_ms(B, A, 4096) - 42.0).abs() < 1e-6);
        // ... and the same 3-way sharing gives back what was observed (90 ms), not 4 × that.
        let again = contended_pull_ms(m.predict_pull_ms(B, A, 4096), 26.0, 3);
        assert!((again - 90.0).abs() < 1e-6, "{again}");
        // The scraped counters get the same correction: 4 pulls that each shared with 3 others
        // took 4 × 64 ms beyond their floors, i.e. 64 ms of link time alone.
        let alone = uncontended_time(Duration::from_millis(256), 4, 16);
        assert_eq!(alone, Duration::from_millis(64));
        assert!(m.observe_pull_rate_into(B, 4 * 4096, alone));
        assert!((m.pull_rate_into(B) - 256_000.0).abs() < 1e-6);
        // Pulls the router did not count are taken as uncontended.
        assert_eq!(
            uncontended_time(Duration::from_millis(256), 0, 0),
            Duration::from_millis(256)
        );
    }

    #[test]
    fn one_sample_moves_at_most_tenfold() {
        let m = CostModel::new(CostModelParams::default());
        m.observe(Observation {
            endpoint: A,
            computed_tokens: 1_000_000,
            pulled: None,
            pull_sharing: 0,
            ttft: Duration::from_millis(1),
        });
        assert!((m.prefill_rate(A) - 250_000.0).abs() < 1e-6);
    }
}
