//! Scraping engines' `/metrics` and turning the counters into *verified* pull evidence, plus
//! what the engines say about placement: requests served and local prefix-cache hit rate per
//! engine (read the same way for `kvmesh router` and peer-router arms).
//!
//! P2P counters are read by prefix (`kvmesh_p2p_*`) rather than by exact name, so a rename shows
//! up as a different key in the report instead of a silent zero. Bytes moved are counted once: the
//! consumer's received bytes and the producer's sent bytes describe the same transfer, so the
//! evidence takes the larger of the per-direction totals rather than their sum.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::driver::RequestRecord;

pub use kvmesh_core::exposition::{Sample, parse_exposition};

/// Sum of all samples of `name` (across label sets); 0 when there are none (`Iterator::sum` of
/// no `f64` is -0.0, which reports print as "-0").
pub fn sum(samples: &[Sample], name: &str) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .fold(0.0, |acc, s| acc + s.value)
}

/// Totals of every counter whose name starts with `prefix`, keyed by name plus its distinguishing
/// labels (e.g. `kvmesh_p2p_payload_bytes_total{direction=in}`).
fn totals_by_prefix(samples: &[Sample], prefix: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name.starts_with(prefix)) {
        // Histogram buckets would multiply-count; keep only their _sum/_count.
        if s.name.ends_with("_bucket") {
            continue;
        }
        // Keep the labels that distinguish *what* was counted (direction, outcome, reason), drop
        // the ones that only say *where* (engine, model), so totals add up across engines.
        let mut labels: Vec<String> = s
            .labels
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "engine" | "model_name" | "model" | "peer" | "instance"
                )
            })
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        labels.sort();
        let dir = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", labels.join(","))
        };
        *out.entry(format!("{}{dir}", s.name)).or_insert(0.0) += s.value;
    }
    out
}

/// What one engine's counters say happened during an arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineEvidence {
    pub url: String,
    /// `vllm:external_prefix_cache_hits_total` — tokens that arrived through a pull.
    pub external_hit_tokens: f64,
    /// `vllm:prefix_cache_hits_total` — local prefix hits (tokens).
    pub local_hit_tokens: f64,
    /// `vllm:prefix_cache_queries_total` — prompt tokens looked up in the local prefix cache.
    #[serde(default)]
    pub prefix_cache_queries: f64,
    /// `vllm:request_success_total` (all finish reasons) — requests this engine served.
    #[serde(default)]
    pub requests: f64,
    /// `vllm:time_to_first_token_seconds` sum and count: the engine's own TTFT, in wall seconds
    /// from the request's arrival at the engine (after its body was read and tokenized).
    #[serde(default)]
    pub engine_ttft_sum_s: f64,
    #[serde(default)]
    pub engine_ttft_count: f64,
    pub prompt_tokens_by_source: BTreeMap<String, f64>,
    /// Every `kvmesh_p2p_*` counter (by name and direction label).
    pub p2p: BTreeMap<String, f64>,
    /// Every P/D counter (`kvmesh_engine_pd_*`, `vllm:nixl_num_kv_expired_reqs`).
    #[serde(default)]
    pub pd: BTreeMap<String, f64>,
    /// Movements between the engine's own tiers (see [`TIER_COUNTERS`]).
    #[serde(default)]
    pub tiers: BTreeMap<String, f64>,
}

/// Counter prefixes of [`EngineEvidence::tiers`]: CPU→GPU restores (blocks, modelled copy time,
/// time requests waited for copies), the part of them restored ahead of a request, and GPU-tier
/// evictions.
pub const TIER_COUNTERS: &[&str] = &[
    "kvmesh_engine_cpu_restore",
    "kvmesh_engine_prefetch_restored_blocks",
    "kvmesh_engine_gpu_evicted_blocks",
];

/// `after − before` per key (a key missing on one side counts 0 there).
fn map_delta(
    after: &BTreeMap<String, f64>,
    before: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .collect()
}

impl EngineEvidence {
    /// Prompt tokens of one `vllm:prompt_tokens_by_source_total` source (`local_compute`,
    /// `local_cache_hit`, `external_kv_transfer`); 0 when absent.
    pub fn source_tokens(&self, source: &str) -> f64 {
        self.prompt_tokens_by_source
            .get(source)
            .copied()
            .unwrap_or(0.0)
    }

    /// What the counters rose by since `before` (an earlier scrape of the same engine): the
    /// evidence of one phase of a run. Gauges among the P2P keys come out as differences too,
    /// which nothing reads.
    pub fn since(&self, before: &EngineEvidence) -> EngineEvidence {
        EngineEvidence {
            url: self.url.clone(),
            external_hit_tokens: self.external_hit_tokens - before.external_hit_tokens,
            local_hit_tokens: self.local_hit_tokens - before.local_hit_tokens,
            prefix_cache_queries: self.prefix_cache_queries - before.prefix_cache_queries,
            requests: self.requests - before.requests,
            engine_ttft_sum_s: self.engine_ttft_sum_s - before.engine_ttft_sum_s,
            engine_ttft_count: self.engine_ttft_count - before.engine_ttft_count,
            prompt_tokens_by_source: map_delta(
                &self.prompt_tokens_by_source,
                &before.prompt_tokens_by_source,
            ),
            p2p: map_delta(&self.p2p, &before.p2p),
            pd: map_delta(&self.pd, &before.pd),
            tiers: map_delta(&self.tiers, &before.tiers),
        }
    }

    pub fn from_exposition(url: &str, text: &str) -> Self {
        let samples = parse_exposition(text);
        let mut by_source = BTreeMap::new();
        for s in samples
            .iter()
            .filter(|s| s.name == "vllm:prompt_tokens_by_source_total")
        {
            if let Some((_, v)) = s.labels.iter().find(|(k, _)| k == "source") {
                *by_source.entry(v.clone()).or_insert(0.0) += s.value;
            }
        }
        Self {
            url: url.to_owned(),
            external_hit_tokens: sum(&samples, "vllm:external_prefix_cache_hits_total"),
            local_hit_tokens: sum(&samples, "vllm:prefix_cache_hits_total"),
            prefix_cache_queries: sum(&samples, "vllm:prefix_cache_queries_total"),
            requests: sum(&samples, "vllm:request_success_total"),
            engine_ttft_sum_s: sum(&samples, "vllm:time_to_first_token_seconds_sum"),
            engine_ttft_count: sum(&samples, "vllm:time_to_first_token_seconds_count"),
            prompt_tokens_by_source: by_source,
            p2p: totals_by_prefix(&samples, "kvmesh_p2p_"),
            pd: {
                let mut pd = totals_by_prefix(&samples, "kvmesh_engine_pd_");
                pd.extend(totals_by_prefix(&samples, "vllm:nixl_num_kv_expired_reqs"));
                pd
            },
            tiers: TIER_COUNTERS
                .iter()
                .flat_map(|p| totals_by_prefix(&samples, p))
                .collect(),
        }
    }
}

/// Fleet-wide evidence for one arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    pub engines: Vec<EngineEvidence>,
    pub external_hit_tokens: f64,
    /// Wire bytes moved by P2P pulls (counted once; see the module doc). A sim engine's payload
    /// is scaled down (`--sim-kv-bytes-per-token`): see `p2p_modelled_bytes`.
    pub p2p_bytes: f64,
    /// Modelled bytes of those pulls: what the sim engines' modelled links carried (the real
    /// model's KV, `kvmesh_p2p_modelled_bytes_total`); 0 for real engines and ladder mode.
    #[serde(default)]
    pub p2p_modelled_bytes: f64,
    /// Blocks moved by P2P pulls (counted once).
    pub p2p_blocks: f64,
    /// Pulls that moved at least one block (outcome complete/partial), when the engines report it.
    pub p2p_pulls: f64,
    /// All `kvmesh_p2p_*` counters summed over engines.
    pub p2p_counters: BTreeMap<String, f64>,
    /// Engines whose `/metrics` could not be read (evidence incomplete).
    pub scrape_errors: Vec<String>,
    /// All P/D counters summed over engines.
    #[serde(default)]
    pub pd_counters: BTreeMap<String, f64>,
    /// Fork: the children's wave as the engines counted it (counter deltas from just before the
    /// first child to the end; see [`crate::waves`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child_wave: Option<WaveCounters>,
    /// Tokens of conversation history read decoder → prefiller (bi-directional P/D).
    #[serde(default)]
    pub pd_history_tokens: f64,
    /// Prompt tokens read prefiller → decoder (the P/D handoff).
    #[serde(default)]
    pub pd_decode_tokens: f64,
}

impl Evidence {
    pub fn from_engines(engines: Vec<EngineEvidence>, scrape_errors: Vec<String>) -> Self {
        let mut counters: BTreeMap<String, f64> = BTreeMap::new();
        for e in &engines {
            for (k, v) in &e.p2p {
                *counters.entry(k.clone()).or_insert(0.0) += v;
            }
        }
        let max_of = |pred: &dyn Fn(&str) -> bool| {
            counters
                .iter()
                .filter(|(k, _)| pred(k))
                .map(|(_, v)| *v)
                .fold(0.0f64, f64::max)
        };
        let is_counter = |k: &str| !k.contains("_seconds") && !k.contains("duration");
        let p2p_bytes =
            max_of(&|k| is_counter(k) && k.contains("bytes") && !k.contains("modelled"));
        let p2p_modelled_bytes = max_of(&|k| is_counter(k) && k.contains("modelled_bytes"));
        let p2p_blocks = max_of(&|k| is_counter(k) && k.contains("blocks"));
        let p2p_pulls = counters
            .iter()
            .filter(|(k, _)| {
                k.contains("pulls")
                    && ["=complete", "=partial", "=hit", "=ok", "=success"]
                        .iter()
                        .any(|o| k.contains(o))
            })
            .map(|(_, v)| *v)
            .sum();
        let mut pd_counters: BTreeMap<String, f64> = BTreeMap::new();
        for e in &engines {
            for (k, v) in &e.pd {
                *pd_counters.entry(k.clone()).or_insert(0.0) += v;
            }
        }
        let read_tokens = |leg: &str| -> f64 {
            pd_counters
                .iter()
                .filter(|(k, _)| {
                    k.starts_with("kvmesh_engine_pd_remote_read_tokens")
                        && k.contains(&format!("leg={leg}"))
                })
                // `sum()` of no f64 is -0.0, which reports print as "-0 tokens".
                .fold(0.0, |acc, (_, v)| acc + v)
        };
        let pd_history_tokens = read_tokens("history");
        let pd_decode_tokens = read_tokens("decode");
        Self {
            child_wave: None,
            pd_counters,
            pd_history_tokens,
            pd_decode_tokens,
            external_hit_tokens: engines
                .iter()
                .fold(0.0, |acc, e| acc + e.external_hit_tokens),
            engines,
            p2p_bytes,
            p2p_modelled_bytes,
            p2p_blocks,
            p2p_pulls,
            p2p_counters: counters,
            scrape_errors,
        }
    }

    /// The fleet's total of one [`EngineEvidence::tiers`] counter (its full name).
    pub fn tier_total(&self, name: &str) -> f64 {
        self.engines
            .iter()
            .filter_map(|e| e.tiers.get(name))
            .fold(0.0, |acc, v| acc + v)
    }

    /// The fleet's evidence since `before` (an earlier scrape): engines are paired by URL, an
    /// engine absent from `before` (started in between) counts from zero.
    pub fn since(&self, before: &Evidence) -> Evidence {
        let engines = self
            .engines
            .iter()
            .map(|e| match before.engines.iter().find(|b| b.url == e.url) {
                Some(b) => e.since(b),
                None => e.clone(),
            })
            .collect();
        let mut errors = before.scrape_errors.clone();
        errors.extend(self.scrape_errors.iter().cloned());
        Evidence::from_engines(engines, errors)
    }

    /// The same evidence without the engines at `urls` (engines that were replaced at the same
    /// address: a diff against their predecessors' counters would be wrong).
    pub fn without(self, urls: &[String]) -> Evidence {
        let engines = self
            .engines
            .into_iter()
            .filter(|e| !urls.contains(&e.url))
            .collect();
        Evidence::from_engines(engines, self.scrape_errors)
    }

    /// Whether anything was verifiably pulled.
    pub fn moved_anything(&self) -> bool {
        self.p2p_bytes > 0.0 || self.p2p_blocks > 0.0
    }

    /// Fleet-wide local prefix-cache hit rate: hit tokens / queried tokens over every engine
    /// (`None` when no engine reported a query).
    pub fn local_hit_rate(&self) -> Option<f64> {
        let q = self
            .engines
            .iter()
            .fold(0.0, |a, e| a + e.prefix_cache_queries);
        let h = self.engines.iter().fold(0.0, |a, e| a + e.local_hit_tokens);
        (q > 0.0).then(|| h / q)
    }

    /// The engines' mean TTFT over every request they answered (wall seconds; `None` without
    /// samples).
    pub fn engine_ttft_mean_s(&self) -> Option<f64> {
        let n = self
            .engines
            .iter()
            .fold(0.0, |a, e| a + e.engine_ttft_count);
        let sum = self
            .engines
            .iter()
            .fold(0.0, |a, e| a + e.engine_ttft_sum_s);
        (n > 0.0).then(|| sum / n)
    }

    /// Per-engine prefill balance: the most prompt tokens one engine computed itself
    /// (`prompt_tokens_by_source{source="local_compute"}`) over the fleet mean. 1.0 = even; a
    /// hot owner computing everything pushes it towards the engine count. `None` when nothing
    /// was computed.
    pub fn prefill_balance(&self) -> Option<f64> {
        let computed: Vec<f64> = self
            .engines
            .iter()
            .map(|e| {
                e.prompt_tokens_by_source
                    .get("local_compute")
                    .copied()
                    .unwrap_or(0.0)
            })
            .collect();
        let total: f64 = computed.iter().sum();
        if computed.is_empty() || total <= 0.0 {
            return None;
        }
        let max = computed.iter().copied().fold(0.0f64, f64::max);
        Some(max / (total / computed.len() as f64))
    }

    /// The fewest and the most requests one engine served (`None` without engines).
    pub fn requests_per_engine(&self) -> Option<(f64, f64)> {
        let mut it = self.engines.iter().map(|e| e.requests);
        let first = it.next()?;
        Some(it.fold((first, first), |(lo, hi), v| (lo.min(v), hi.max(v))))
    }
}

/// Fork: the children's wave counted by the engines (built by [`crate::waves`]'s two-wave
/// drive; kept here, with the evidence it is derived from).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WaveCounters {
    /// Children sent.
    pub children: usize,
    /// Tokens of the context every child shares with the parent.
    pub shared_tokens: usize,
    /// Requests the engines finished during the wave.
    pub requests: f64,
    /// Prompt tokens by where their KV came from, summed over the fleet.
    pub computed_tokens: f64,
    pub local_hit_tokens: f64,
    pub pulled_tokens: f64,
    /// The children's own tokens (prompt minus the shared context): computed in every arm.
    pub own_tokens: f64,
    /// `(computed − own) ÷ shared`: how many times the shared context was computed again. A
    /// child that pulled or hit part of the context and computed the rest adds a fraction.
    pub recomputed_children: f64,
    /// Tokens each engine computed during the wave (fleet order).
    pub computed_per_engine: Vec<f64>,
}

impl WaveCounters {
    /// From the counter deltas over the children's wave (`delta` = after − before) and the
    /// children's records (their prompt lengths).
    pub fn from_delta(delta: &Evidence, children: &[&RequestRecord], shared: usize) -> Self {
        let by = |src: &str| {
            delta
                .engines
                .iter()
                .fold(0.0, |a, e| a + e.source_tokens(src))
        };
        let computed = by("local_compute");
        let prompts: f64 = children.iter().map(|r| r.prompt_tokens as f64).sum();
        let own = (prompts - (children.len() * shared) as f64).max(0.0);
        let recomputed = if shared > 0 {
            ((computed - own) / shared as f64).max(0.0)
        } else {
            0.0
        };
        Self {
            children: children.len(),
            shared_tokens: shared,
            requests: delta.engines.iter().fold(0.0, |a, e| a + e.requests),
            computed_tokens: computed,
            local_hit_tokens: by("local_cache_hit"),
            pulled_tokens: by("external_kv_transfer"),
            own_tokens: own,
            recomputed_children: recomputed,
            computed_per_engine: delta
                .engines
                .iter()
                .map(|e| e.source_tokens("local_compute"))
                .collect(),
        }
    }

    /// How the number was derived, for reports.
    pub fn explain(&self) -> String {
        format!(
            "{} = (Δ computed {:.0} − children's own {:.0} tokens) ÷ {}-token context; Δ local hit {:.0}, Δ pulled {:.0} tokens; {:.0} requests",
            fmt_children(self.recomputed_children),
            self.computed_tokens,
            self.own_tokens,
            self.shared_tokens,
            self.local_hit_tokens,
            self.pulled_tokens,
            self.requests
        )
    }
}

/// Whole children print as integers, partial recomputes with one decimal.
pub fn fmt_children(v: f64) -> String {
    if (v - v.round()).abs() < 0.05 {
        format!("{:.0}", v.round())
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"# HELP vllm:external_prefix_cache_hits_total External hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="sim"} 4096.0
vllm:prefix_cache_hits_total{engine="0",model_name="sim"} 100
vllm:prefix_cache_queries_total{engine="0",model_name="sim"} 400
vllm:request_success_total{engine="0",model_name="sim",finished_reason="length"} 3
vllm:request_success_total{engine="0",model_name="sim",finished_reason="stop"} 2
vllm:time_to_first_token_seconds_sum{engine="0",model_name="sim"} 0.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="sim"} 5
vllm:prompt_tokens_by_source_total{source="local_compute",model_name="sim"} 50
vllm:prompt_tokens_by_source_total{source="external_kv_transfer",model_name="sim"} 4096
kvmesh_p2p_bytes_total{direction="pulled"} 131072
kvmesh_p2p_bytes_total{direction="served"} 0
kvmesh_p2p_blocks_total{direction="pulled"} 256
kvmesh_p2p_pull_duration_seconds_bucket{le="0.1"} 3
kvmesh_p2p_pull_duration_seconds_sum 0.25
kvmesh_p2p_pulls_total{outcome="complete",reason="none"} 2
kvmesh_p2p_pulls_total{outcome="partial",reason="miss"} 1
kvmesh_p2p_pulls_total{outcome="failed",reason="timeout"} 4
weird line without value
"#;

    #[test]
    fn parses_labels_and_values() {
        let s = parse_exposition(SAMPLE);
        assert_eq!(sum(&s, "vllm:external_prefix_cache_hits_total"), 4096.0);
        let l = s
            .iter()
            .find(|x| x.name == "vllm:prompt_tokens_by_source_total")
            .map(|x| x.labels.clone());
        assert_eq!(
            l.as_deref().map(|l| l[0].clone()),
            Some(("source".into(), "local_compute".into()))
        );
        let e = parse_exposition(r#"a{x="q\"uo,te",y="2"} 3"#);
        assert_eq!(
            e[0].labels,
            vec![("x".into(), "q\"uo,te".into()), ("y".into(), "2".into())]
        );
    }

    /// The sim's modelled bytes (the real model's KV) are reported next to the wire bytes,
    /// never as them.
    #[test]
    fn modelled_bytes_are_kept_apart_from_wire_bytes() {
        let e = EngineEvidence::from_exposition(
            "x",
            "kvmesh_p2p_payload_bytes_total{direction=\"in\"} 32768
             kvmesh_p2p_modelled_bytes_total{direction=\"in\"} 75497472
             kvmesh_p2p_blocks_total{direction=\"in\"} 64
",
        );
        let ev = Evidence::from_engines(vec![e], vec![]);
        assert_eq!(ev.p2p_bytes, 32768.0);
        assert_eq!(ev.p2p_modelled_bytes, 75_497_472.0);
        assert_eq!(ev.p2p_blocks, 64.0);
    }

    /// An engine replaced at the same address counts from zero after its restart: diffed
    /// against its predecessor's counters, its work would vanish.
    #[test]
    fn a_replaced_engine_counts_from_zero_after_the_restart() {
        let scrape = |url: &str, hits: u64| {
            EngineEvidence::from_exposition(
                url,
                &format!("vllm:external_prefix_cache_hits_total {hits}\n"),
            )
        };
        let before = Evidence::from_engines(vec![scrape("a", 500), scrape("b", 700)], vec![]);
        // "b" restarted: its new process counted 300 since; "a" survived and counted 100 more.
        let after = Evidence::from_engines(vec![scrape("a", 600), scrape("b", 300)], vec![]);
        let since = after.since(&before.without(&["b".to_owned()]));
        assert_eq!(since.external_hit_tokens, 400.0);
    }

    #[test]
    fn pd_reads_are_split_by_leg() {
        let prefill = EngineEvidence::from_exposition(
            "p",
            "kvmesh_engine_pd_remote_read_tokens_total{leg=\"history\",outcome=\"pulled\",engine=\"0\"} 4096\n\
             kvmesh_engine_pd_remote_reads_total{leg=\"history\",outcome=\"complete\"} 2\n\
             vllm:nixl_num_kv_expired_reqs_total 1\n",
        );
        let decoder = EngineEvidence::from_exposition(
            "d",
            "kvmesh_engine_pd_remote_read_tokens_total{leg=\"decode\",outcome=\"pulled\"} 8192\n\
             kvmesh_engine_pd_retained_total{role=\"decode\"} 3\n",
        );
        let ev = Evidence::from_engines(vec![prefill, decoder], vec![]);
        assert_eq!(ev.pd_history_tokens, 4096.0);
        assert_eq!(ev.pd_decode_tokens, 8192.0);
        assert_eq!(
            ev.pd_counters
                .get("kvmesh_engine_pd_remote_reads_total{leg=history,outcome=complete}"),
            Some(&2.0)
        );
        assert_eq!(
            ev.pd_counters.get("vllm:nixl_num_kv_expired_reqs_total"),
            Some(&1.0)
        );
    }

    #[test]
    fn prefill_balance_is_the_busiest_engine_over_the_mean() {
        let engine = |computed: u32| {
            EngineEvidence::from_exposition(
                "e",
                &format!(
                    "vllm:prompt_tokens_by_source_total{{source=\"local_compute\"}} {computed}\n\
                     vllm:prompt_tokens_by_source_total{{source=\"local_cache_hit\"}} 5000\n"
                ),
            )
        };
        let even = Evidence::from_engines(vec![engine(200), engine(200)], vec![]);
        assert_eq!(even.prefill_balance(), Some(1.0));
        let hot = Evidence::from_engines(vec![engine(300), engine(100), engine(200)], vec![]);
        assert_eq!(hot.prefill_balance(), Some(1.5));
    }

    #[test]
    fn evidence_counts_a_transfer_once_across_directions() {
        let producer = EngineEvidence::from_exposition(
            "p",
            "kvmesh_p2p_bytes_total{direction=\"served\"} 131072\nkvmesh_p2p_blocks_total{direction=\"served\"} 256\n",
        );
        let consumer = EngineEvidence::from_exposition("c", SAMPLE);
        assert_eq!(
            consumer.prompt_tokens_by_source.get("external_kv_transfer"),
            Some(&4096.0)
        );
        let ev = Evidence::from_engines(vec![producer, consumer], vec![]);
        assert_eq!(ev.p2p_bytes, 131072.0);
        assert_eq!(ev.p2p_blocks, 256.0);
        assert_eq!(ev.external_hit_tokens, 4096.0);
        assert_eq!(ev.p2p_pulls, 3.0);
        // Hit rate over the fleet; requests per engine (the producer served none).
        assert_eq!(ev.local_hit_rate(), Some(0.25));
        assert_eq!(ev.requests_per_engine(), Some((0.0, 5.0)));
        assert_eq!(ev.engine_ttft_mean_s(), Some(0.1));
        assert!(ev.moved_anything());
        assert!(!ev.p2p_counters.keys().any(|k| k.ends_with("_bucket")));
    }

    #[test]
    fn evidence_since_an_earlier_scrape_is_the_counter_delta() {
        let before = EngineEvidence::from_exposition(
            "c",
            "vllm:prompt_tokens_by_source_total{source=\"local_compute\"} 50\n\
             vllm:external_prefix_cache_hits_total 96\n",
        );
        let after = EngineEvidence::from_exposition("c", SAMPLE);
        let fresh = EngineEvidence::from_exposition("new", SAMPLE);
        let d = Evidence::from_engines(vec![after, fresh], vec![])
            .since(&Evidence::from_engines(vec![before], vec![]));
        assert_eq!(d.engines[0].source_tokens("local_compute"), 0.0);
        assert_eq!(d.engines[0].source_tokens("external_kv_transfer"), 4096.0);
        assert_eq!(d.engines[0].external_hit_tokens, 4000.0);
        // An engine that joined in between counts from zero.
        assert_eq!(d.engines[1].external_hit_tokens, 4096.0);
        assert_eq!(d.external_hit_tokens, 8096.0);
    }

    #[test]
    fn renamed_counters_still_count() {
        let e =
            EngineEvidence::from_exposition("x", "kvmesh_p2p_transfer_bytes_received_total 10\n");
        let ev = Evidence::from_engines(vec![e], vec![]);
        assert_eq!(ev.p2p_bytes, 10.0);
        let none = Evidence::from_engines(vec![EngineEvidence::from_exposition("y", "")], vec![]);
        assert!(!none.moved_anything());
        assert_eq!(none.local_hit_rate(), None);
        assert_eq!(Evidence::default().requests_per_engine(), None);
        assert_eq!(Evidence::default().prefill_balance(), None);
        assert_eq!(none.engine_ttft_mean_s(), None);
    }
}
