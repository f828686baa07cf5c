//! Transfer pricing ladder: recompute vs pull on one consumer/producer pair (`docs/architecture.md#reference-experiments`, workload 1).
//!
//! For each prefix length, fresh random prefixes (never seen by the consumer) are (a) recomputed
//! on the consumer and (b) seeded on the source and then pulled by the consumer via
//! `kv_transfer_params.remote_kv_source`. A warm-up pull first pays the one-time connection cost.
//! Every pull is verified on the consumer's `vllm:external_prefix_cache_hits_total`.

use std::time::Duration;

use kvmesh_core::{KvTransferParams, RemoteKvSource};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::client::{self, CompletionRequest, Outcome};
use crate::fleet::scrape;
use crate::metrics::{parse_exposition, sum};
use crate::tokens::{Segment, TokenGen, TokenSpace, mix};

/// One row of the ladder (model milliseconds, medians over repetitions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LadderRow {
    pub prefix_tokens: usize,
    pub recompute_ms: f64,
    pub pull_ms: f64,
    pub recompute_samples_ms: Vec<f64>,
    pub pull_samples_ms: Vec<f64>,
    /// External-hit tokens the consumer counted across this row's pulls.
    pub verified_pulled_tokens: f64,
}

/// Result of a calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub rows: Vec<LadderRow>,
    /// Prefix length above which a pull beats recompute (see [`crossover`]).
    pub crossover_tokens: Option<f64>,
    pub recommended_min_cached_token_delta: usize,
    pub margin: f64,
    /// Every pull row was confirmed by the consumer's external-hit counter. Without it the "pull"
    /// times may be recomputes and the recommendation means nothing.
    pub verified: bool,
    /// Problems (unverified pulls, failures).
    pub warnings: Vec<String>,
}

#[derive(Debug, Error)]
pub enum CalibrateError {
    #[error("request to {url} failed: {detail}")]
    Request { url: String, detail: String },
    #[error("config: {0}")]
    Config(String),
}

/// Prefix length above which pulling beats recomputing, from the measured points: linear
/// interpolation of `recompute − pull` between the last losing and the first winning length, or
/// extrapolated below the smallest length when pull already wins there (recompute is convex in
/// the prefix length, so one global line fits it badly). `None` when pull does not win at the
/// longest measured prefix.
pub fn crossover(rows: &[LadderRow]) -> Option<f64> {
    let mut pts: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.prefix_tokens as f64, r.recompute_ms - r.pull_ms))
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let last = *pts.last()?;
    if last.1 <= 0.0 {
        return None;
    }
    let interp = |(x0, d0): (f64, f64), (x1, d1): (f64, f64)| {
        if d1 == d0 {
            x0
        } else {
            x0 - d0 * (x1 - x0) / (d1 - d0)
        }
    };
    match pts.iter().rposition(|p| p.1 <= 0.0) {
        Some(i) => Some(interp(pts[i], pts[i + 1])),
        None if pts.len() >= 2 && pts[1].1 > pts[0].1 => {
            Some(interp(pts[0], pts[1]).clamp(0.0, pts[0].0))
        }
        None => Some(0.0),
    }
}

/// Whether pull already won at the shortest measured prefix (the crossover is then only an
/// extrapolation, and the threshold stays at the shortest length where a win was measured).
fn wins_everywhere(rows: &[LadderRow]) -> bool {
    !rows.is_empty() && rows.iter().all(|r| r.pull_ms < r.recompute_ms)
}

/// The threshold to configure: above the measured crossover by `margin`; when pull won at every
/// measured length, the shortest measured length (never an extrapolation below the data).
pub fn recommend(rows: &[LadderRow], block_size: usize, margin: f64) -> usize {
    let max_len = rows.iter().map(|r| r.prefix_tokens).max().unwrap_or(0);
    if wins_everywhere(rows) {
        let min_len = rows.iter().map(|r| r.prefix_tokens).min().unwrap_or(0);
        return recommend_delta(Some(min_len as f64), max_len, block_size, 1.0);
    }
    recommend_delta(crossover(rows), max_len, block_size, margin)
}

/// Threshold above the crossover with a multiplicative margin, rounded up to whole blocks
/// (at least one block, llm-d requires ≥ 1).
fn recommend_delta(
    crossover: Option<f64>,
    max_measured: usize,
    block_size: usize,
    margin: f64,
) -> usize {
    let bs = block_size.max(1);
    let raw = match crossover {
        Some(x) => x * margin.max(1.0),
        // Pull never wins in range: only pull beyond what was measured.
        None => max_measured as f64 * margin.max(1.0),
    };
    (raw.ceil() as usize).div_ceil(bs).max(1) * bs
}

/// Sets every P2P pull threshold in a router YAML document: `min_cached_token_delta` (the
/// `p2p-source-producer`'s, outside `mode: predicted`) and `min_pull_tokens` (the
/// `predicted-ttft-scorer`'s, which owns it in the default placement), in either spelling.
pub fn write_threshold(yaml: &str, value: usize) -> Result<String, CalibrateError> {
    let mut doc: serde_norway::Value =
        serde_norway::from_str(yaml).map_err(|e| CalibrateError::Config(e.to_string()))?;
    let mut n = 0usize;
    set_keys(&mut doc, value, &mut n);
    if n == 0 {
        return Err(CalibrateError::Config(
            "no min_cached_token_delta or min_pull_tokens key found (add a p2p-source-producer \
             or a predicted-ttft-scorer first)"
                .into(),
        ));
    }
    serde_norway::to_string(&doc).map_err(|e| CalibrateError::Config(e.to_string()))
}

fn set_keys(v: &mut serde_norway::Value, value: usize, n: &mut usize) {
    match v {
        serde_norway::Value::Mapping(m) => {
            for (k, child) in m.iter_mut() {
                if matches!(
                    k.as_str(),
                    Some(
                        "min_cached_token_delta"
                            | "minCachedTokenDelta"
                            | "min_pull_tokens"
                            | "minPullTokens"
                    )
                ) {
                    *child = serde_norway::Value::Number((value as u64).into());
                    *n += 1;
                } else {
                    set_keys(child, value, n);
                }
            }
        }
        serde_norway::Value::Sequence(s) => s.iter_mut().for_each(|c| set_keys(c, value, n)),
        _ => {}
    }
}

/// Where to measure.
#[derive(Debug, Clone)]
pub struct PairConfig {
    pub consumer_url: String,
    pub source_url: String,
    /// Source P2P `host:port` as the consumer should dial it.
    pub source_p2p: (String, u16),
    pub model: String,
    pub lengths: Vec<usize>,
    pub reps: usize,
    pub time_scale: f64,
    pub token_space: TokenSpace,
    pub seed: u64,
    pub block_size: usize,
    pub margin: f64,
    /// Wait after seeding the source (offload to its CPU tier), model time.
    pub offload_wait: Duration,
}

/// The default ladder (the lengths in `docs/architecture.md#reference-experiments`).
pub const DEFAULT_LENGTHS: &[usize] = &[2048, 8192, 16384, 32768, 49152];

async fn ttft(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    prompt: &[u32],
    p: Option<KvTransferParams>,
) -> Result<f64, CalibrateError> {
    let c = client::complete(
        http,
        CompletionRequest {
            base_url: url,
            model,
            prompt,
            // Real-model token spaces are not text: the ladder always sends ids.
            prompt_format: client::PromptFormat::Tokens,
            max_tokens: 1,
            kv_transfer_params: p,
            session_id: None,
            request_id: None,
            want_token_ids: false,
            timeout: Duration::from_secs(600),
        },
    )
    .await;
    match (c.outcome, c.ttft_s) {
        (Outcome::Ok, Some(t)) => Ok(t),
        (o, _) => Err(CalibrateError::Request {
            url: url.into(),
            detail: format!("{o:?}"),
        }),
    }
}

async fn external_hits(http: &reqwest::Client, url: &str) -> f64 {
    scrape(http, url)
        .await
        .map(|t| {
            sum(
                &parse_exposition(&t),
                "vllm:external_prefix_cache_hits_total",
            )
        })
        .unwrap_or(0.0)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() { 0.0 } else { s[s.len() / 2] }
}

/// Runs the ladder; `on_row` sees each row as it completes (for live printing).
pub async fn calibrate(
    cfg: &PairConfig,
    mut on_row: impl FnMut(&LadderRow),
) -> Result<Calibration, CalibrateError> {
    let http = reqwest::Client::new();
    let tg = TokenGen::new(cfg.seed, cfg.token_space);
    let ts = if cfg.time_scale > 0.0 {
        cfg.time_scale
    } else {
        1.0
    };
    let mut counter = 0u64;
    let mut fresh = |len: usize| {
        counter += 1;
        tg.render(&[Segment::seeded(mix(cfg.seed, 0xCA11_0000 + counter), len)])
    };
    let suffix = |p: &[u32], tag: u64| {
        let mut v = p.to_vec();
        tg.extend(
            &Segment::seeded(mix(tag, p.len() as u64 ^ 0x5eed), 16),
            &mut v,
        );
        v
    };
    let params = |id: String| KvTransferParams {
        remote_kv_source: Some(RemoteKvSource {
            kv_request_id: id,
            remote_host: cfg.source_p2p.0.clone(),
            remote_port: cfg.source_p2p.1,
        }),
        ..Default::default()
    };
    let mut warnings = Vec::new();
    // Warm-up: one small pull pays connection set-up (and a recompute warms the consumer).
    {
        let p = fresh(cfg.block_size.max(16) * 64);
        ttft(&http, &cfg.source_url, &cfg.model, &suffix(&p, 1), None).await?;
        tokio::time::sleep(cfg.offload_wait.div_f64(ts)).await;
        ttft(
            &http,
            &cfg.consumer_url,
            &cfg.model,
            &suffix(&p, 2),
            Some(params(format!("warmup-{}", cfg.seed))),
        )
        .await?;
        let q = fresh(cfg.block_size.max(16) * 64);
        ttft(&http, &cfg.consumer_url, &cfg.model, &suffix(&q, 3), None).await?;
    }
    let mut rows = Vec::new();
    for &len in &cfg.lengths {
        let mut rec = Vec::new();
        let mut pull = Vec::new();
        let before = external_hits(&http, &cfg.consumer_url).await;
        for rep in 0..cfg.reps.max(1) {
            let a = fresh(len);
            rec.push(
                ttft(&http, &cfg.consumer_url, &cfg.model, &suffix(&a, 4), None).await?
                    * ts
                    * 1000.0,
            );
            let b = fresh(len);
            ttft(&http, &cfg.source_url, &cfg.model, &suffix(&b, 5), None).await?;
            tokio::time::sleep(cfg.offload_wait.div_f64(ts)).await;
            let id = format!("calib-{}-{len}-{rep}", cfg.seed);
            pull.push(
                ttft(
                    &http,
                    &cfg.consumer_url,
                    &cfg.model,
                    &suffix(&b, 6),
                    Some(params(id)),
                )
                .await?
                    * ts
                    * 1000.0,
            );
        }
        let after = external_hits(&http, &cfg.consumer_url).await;
        let verified = after - before;
        let expected =
            (len / cfg.block_size.max(1) * cfg.block_size.max(1) * cfg.reps.max(1)) as f64;
        if verified < expected * 0.9 {
            warnings.push(format!(
                "{len} tokens: consumer counted {verified:.0} external-hit tokens, expected ≈{expected:.0} — pulls not verified"
            ));
        }
        let row = LadderRow {
            prefix_tokens: len,
            recompute_ms: median(&rec),
            pull_ms: median(&pull),
            recompute_samples_ms: rec,
            pull_samples_ms: pull,
            verified_pulled_tokens: verified,
        };
        on_row(&row);
        rows.push(row);
    }
    let x = crossover(&rows);
    Ok(Calibration {
        recommended_min_cached_token_delta: recommend(&rows, cfg.block_size, cfg.margin),
        crossover_tokens: x,
        margin: cfg.margin,
        rows,
        verified: warnings.is_empty(),
        warnings,
    })
}

/// The first model id an OpenAI server lists at `/v1/models`.
pub async fn served_model(url: &str) -> Result<String, CalibrateError> {
    let u = format!("{}/v1/models", url.trim_end_matches('/'));
    let err = |detail: String| CalibrateError::Request {
        url: u.clone(),
        detail,
    };
    let v: serde_json::Value = reqwest::get(&u)
        .await
        .map_err(|e| err(e.to_string()))?
        .json()
        .await
        .map_err(|e| err(e.to_string()))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| err("no model listed".into()))
}

impl Calibration {
    pub fn markdown(&self) -> String {
        let mut s = String::from(
            "| prefix tokens | recompute | P2P pull | delta | verified pulled tokens |\n|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let d = if r.recompute_ms > 0.0 {
                (r.pull_ms - r.recompute_ms) / r.recompute_ms * 100.0
            } else {
                0.0
            };
            s.push_str(&format!(
                "| {} | {:.0} ms | {:.0} ms | {:+.0}% | {:.0} |\n",
                r.prefix_tokens, r.recompute_ms, r.pull_ms, d, r.verified_pulled_tokens
            ));
        }
        match self.crossover_tokens {
            Some(_) if wins_everywhere(&self.rows) => s.push_str(&format!(
                "\nCrossover: below the shortest measured prefix ({} tokens): pull won at every length \
                 (measure shorter prefixes to locate it).",
                self.rows.iter().map(|r| r.prefix_tokens).min().unwrap_or(0)
            )),
            Some(x) => s.push_str(&format!("\nCrossover (interpolated): {x:.0} tokens.")),
            None => s.push_str("\nCrossover: pull never beats recompute in the measured range."),
        }
        if self.verified {
            s.push_str(&format!(
                "\nRecommended `min_cached_token_delta`: {} ({}, whole blocks).\n",
                self.recommended_min_cached_token_delta,
                if wins_everywhere(&self.rows) {
                    "shortest length with a measured win".to_owned()
                } else {
                    format!("crossover × {:.2} margin", self.margin)
                }
            ));
        } else {
            s.push_str("\nNo recommendation: the pulls were not verified (see warnings), so the pull column may be recomputes.\n");
        }
        for w in &self.warnings {
            s.push_str(&format!("\nWARNING: {w}"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published() -> Vec<LadderRow> {
        [
            (2048, 78.0, 35.0),
            (8192, 250.0, 57.0),
            (16384, 510.0, 86.0),
            (32768, 1173.0, 165.0),
            (49152, 1988.0, 235.0),
        ]
        .iter()
        .map(|&(n, r, p)| LadderRow {
            prefix_tokens: n,
            recompute_ms: r,
            pull_ms: p,
            recompute_samples_ms: vec![r],
            pull_samples_ms: vec![p],
            verified_pulled_tokens: n as f64,
        })
        .collect()
    }

    #[test]
    fn published_gpt_oss_ladder_pulls_from_small_prefixes() {
        let x = crossover(&published()).unwrap();
        // Pull won at every measured length: the crossover is below 2K.
        assert!(x < 2048.0, "{x}");
        let d = recommend_delta(Some(x), 49152, 16, 1.5);
        assert!(d.is_multiple_of(16) && (16..=3072).contains(&d), "{d}");
        // ...but the recommendation never extrapolates below the data: 2048, llm-d's own setting.
        assert!(wins_everywhere(&published()));
        assert_eq!(recommend(&published(), 16, 1.5), 2048);
    }

    #[test]
    fn glm_like_ladder_crosses_near_8k() {
        // Pull floor ~1.25 s, recompute ~0.15 ms/token: tie near 8K.
        let rows: Vec<LadderRow> = [2048usize, 8192, 16384, 32768]
            .iter()
            .map(|&n| LadderRow {
                prefix_tokens: n,
                recompute_ms: 0.155 * n as f64,
                pull_ms: 1250.0 + 0.005 * n as f64,
                recompute_samples_ms: vec![],
                pull_samples_ms: vec![],
                verified_pulled_tokens: 0.0,
            })
            .collect();
        let x = crossover(&rows).unwrap();
        assert!((8000.0..8800.0).contains(&x), "{x}");
        assert_eq!(recommend_delta(Some(x), 32768, 64, 1.25) % 64, 0);
        // Pull never wins: threshold beyond the measured range.
        let never: Vec<LadderRow> = rows
            .iter()
            .cloned()
            .map(|mut r| {
                r.pull_ms = r.recompute_ms * 2.0;
                r
            })
            .collect();
        assert!(crossover(&never).is_none());
        assert!(recommend_delta(None, 32768, 16, 1.5) >= 32768);
    }

    #[test]
    fn threshold_is_written_into_router_yaml() {
        let y = "plugins:\n  - type: p2p-source-producer\n    parameters:\n      minCachedTokenDelta: 1\n";
        let out = write_threshold(y, 3072).unwrap();
        assert!(out.contains("minCachedTokenDelta: 3072"), "{out}");
        assert!(write_threshold("plugins: []\n", 1).is_err());
        let snake = write_threshold("p2p:\n  min_cached_token_delta: 5\n", 64).unwrap();
        assert!(snake.contains("min_cached_token_delta: 64"));
        // The default placement: the scorer owns the threshold.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/router.yaml");
        let out = write_threshold(&std::fs::read_to_string(path).unwrap(), 4096).unwrap();
        assert!(out.contains("min_pull_tokens: 4096"), "{out}");
    }
}
