//! Drives a [`Workload`] against one OpenAI endpoint (normally the router) and records every request.
//!
//! Each session runs as its own task; arrival rules are explicit (`Start::At` for open-loop
//! arrivals, `Start::After` for forks, a semaphore for closed-loop concurrency). Model times are
//! divided by the time scale so a sped-up sim fleet sees the same shape.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kvmesh_core::chain::chain_keys;
use kvmesh_core::{ChainKey, TokenId};
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, watch};

use crate::client::{self, CompletionRequest, Outcome, PromptFormat};
use crate::tokens::{Segment, TokenGen, mix};
use crate::workload::{Start, StepKind, Workload};

/// One request as the client saw it. Times are wall seconds from the start of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub session: usize,
    pub step: usize,
    pub kind: StepKind,
    pub prompt_tokens: usize,
    /// Prompt tokens no earlier request of the run began with (see [`crate::bound`]).
    #[serde(default)]
    pub novel_tokens: Option<usize>,
    pub sent_s: f64,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    pub output_tokens: usize,
    pub cached_tokens: Option<u64>,
    pub outcome: Outcome,
}

/// The `x-request-id` of step `step` of session `session` (deterministic per run seed, so a
/// router's decision records join with [`RequestRecord`]s).
pub fn request_id(seed: u64, session: usize, step: usize) -> String {
    format!("bench-{seed:x}-{session}-{step}")
}

/// The block size [`PrefixesSeen`] matches prefixes at (the bench fleets' engines use 16).
pub const BOUND_BLOCK: usize = 16;

/// Every prompt block sent so far in a run (shared by its sessions, in send order): what the
/// physical bound ([`crate::bound`]) counts as cached somewhere.
#[derive(Debug, Default)]
pub struct PrefixesSeen(Mutex<HashSet<ChainKey>>);

impl PrefixesSeen {
    /// The tokens of `prompt` past its longest leading run of blocks some earlier prompt also
    /// began with; records `prompt`'s blocks for the prompts after it.
    pub fn novel_tokens(&self, prompt: &[TokenId]) -> usize {
        let keys = chain_keys(prompt, BOUND_BLOCK);
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let cached = keys.iter().take_while(|k| seen.contains(k)).count();
        seen.extend(keys);
        prompt.len() - cached * BOUND_BLOCK
    }
}

/// Where and how to drive.
#[derive(Clone)]
pub struct DriveConfig {
    /// Where requests go: one router, or several replicas taken in turn, request by request in
    /// the order they are sent (as a Kubernetes Service spreads connections).
    pub base_urls: Vec<String>,
    pub model: String,
    /// Model-time divisor (1.0 = real time).
    pub time_scale: f64,
    /// Prompts as text (default) or token ids; every arm of a run gets the same.
    pub prompt_format: PromptFormat,
    pub progress: Option<ProgressBar>,
}

/// Runs the workload to completion and returns one record per request, in (session, step) order.
pub async fn drive(workload: &Workload, cfg: &DriveConfig) -> Vec<RequestRecord> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap_or_default();
    let ts = if cfg.time_scale.is_finite() && cfg.time_scale > 0.0 {
        cfg.time_scale
    } else {
        1.0
    };
    let scale = move |d: Duration| d.div_f64(ts);
    let tg = TokenGen::new(workload.seed, workload.token_space);
    let n = workload.sessions.len();
    let (done_tx, done_rx): (Vec<_>, Vec<_>) = (0..n).map(|_| watch::channel(false)).unzip();
    let slots = workload
        .max_active_sessions
        .map(|k| Arc::new(Semaphore::new(k.max(1))));
    let start = Instant::now();
    let timeout = scale(workload.request_timeout);
    let turn = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = Arc::new(PrefixesSeen::default());
    // Which steps' answers feed a later turn (ask the server for their token ids).
    let mut tasks = Vec::with_capacity(n);
    for (si, (session, done)) in workload.sessions.iter().cloned().zip(done_tx).enumerate() {
        let wait_for = match &session.start {
            Start::After {
                session: parent, ..
            } => done_rx.get(*parent).cloned(),
            Start::At(_) => None,
        };
        let http = http.clone();
        let cfg = cfg.clone();
        let slots = slots.clone();
        let turn = Arc::clone(&turn);
        let seen = Arc::clone(&seen);
        let seed = workload.seed;
        tasks.push(tokio::spawn(async move {
            match session.start {
                Start::At(t) => tokio::time::sleep_until((start + scale(t)).into()).await,
                Start::After { delay, .. } => {
                    if let Some(mut rx) = wait_for {
                        // A dropped sender means the parent task ended: start anyway.
                        let _ = rx.wait_for(|d| *d).await;
                    }
                    tokio::time::sleep(scale(delay)).await;
                }
            }
            let _permit = match &slots {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            let mut records = Vec::with_capacity(session.steps.len());
            let mut history: Vec<TokenId> = Vec::new();
            for (i, step) in session.steps.iter().enumerate() {
                if i > 0 {
                    tokio::time::sleep(scale(step.gap)).await;
                }
                let mut prompt = if step.history {
                    std::mem::take(&mut history)
                } else {
                    Vec::new()
                };
                for seg in &step.segments {
                    tg.extend(seg, &mut prompt);
                }
                let next_uses_history = session.steps.get(i + 1).is_some_and(|s| s.history);
                let session_id = (session.steps.len() > 1).then(|| format!("conv-{seed:x}-{si}"));
                let novel_tokens = Some(seen.novel_tokens(&prompt));
                let sent = start.elapsed().as_secs_f64();
                let k = turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let base_url = cfg
                    .base_urls
                    .get(k % cfg.base_urls.len().max(1))
                    .map_or("", String::as_str);
                let c = client::complete(
                    &http,
                    CompletionRequest {
                        base_url,
                        model: &cfg.model,
                        prompt: &prompt,
                        prompt_format: cfg.prompt_format,
                        max_tokens: step.max_tokens,
                        kv_transfer_params: None,
                        session_id,
                        request_id: Some(request_id(seed, si, i)),
                        want_token_ids: next_uses_history,
                        timeout,
                    },
                )
                .await;
                if let Some(pb) = &cfg.progress {
                    pb.inc(1);
                }
                let ok = c.outcome == Outcome::Ok;
                records.push(RequestRecord {
                    session: si,
                    step: i,
                    kind: step.kind,
                    prompt_tokens: prompt.len(),
                    novel_tokens,
                    sent_s: sent,
                    ttft_s: c.ttft_s,
                    e2e_s: c.e2e_s,
                    output_tokens: c.output_tokens,
                    cached_tokens: c.cached_tokens,
                    outcome: c.outcome,
                });
                if next_uses_history {
                    // The next turn repeats this prompt plus the answer: the real token ids when
                    // the server returned them (so a decoder's retained blocks can match), else a
                    // deterministic stand-in of the same length.
                    let byte_space = tg.space().hi <= 257;
                    let answer = match c.token_ids {
                        Some(ids) if ok && !ids.is_empty() => ids,
                        // Byte-tokenizer engines: the text *is* the token ids.
                        _ if ok
                            && byte_space
                            && c.text.len() == c.output_tokens
                            && !c.text.is_empty() =>
                        {
                            c.text.bytes().map(TokenId::from).collect()
                        }
                        _ => {
                            let key = mix(mix(seed, si as u64), i as u64 + 0xA5);
                            tg.render(&[Segment::seeded(key, step.max_tokens as usize)])
                        }
                    };
                    prompt.extend_from_slice(&answer);
                    history = prompt;
                }
            }
            let _ = done.send(true);
            records
        }));
    }
    let mut out = Vec::with_capacity(workload.num_requests());
    for t in tasks {
        if let Ok(mut r) = t.await {
            out.append(&mut r);
        }
    }
    out.sort_by_key(|r| (r.session, r.step));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_no_earlier_prompt_began_with_is_novel() {
        let seen = PrefixesSeen::default();
        let a: Vec<TokenId> = (0..100).collect();
        assert_eq!(seen.novel_tokens(&a), 100);
        // The same 6 whole blocks, then 60 new tokens.
        let mut b: Vec<TokenId> = (0..96).collect();
        b.extend(1000..1060);
        assert_eq!(seen.novel_tokens(&b), 60);
        // A prompt that shares a later block but not the first shares nothing.
        let c: Vec<TokenId> = (16..200).collect();
        assert_eq!(seen.novel_tokens(&c), 184);
    }

    use crate::tokens::TokenSpace;
    use crate::workload::{FleetShape, Session, Step};
    use axum::response::IntoResponse;
    use parking_lot::Mutex;

    type Seen = Arc<Mutex<Vec<(Instant, Vec<u32>)>>>;

    async fn serve(seen: Seen) -> String {
        let app = axum::Router::new().route(
            "/v1/completions",
            axum::routing::post(move |body: axum::body::Bytes| {
                let seen = seen.clone();
                async move {
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    let p: Vec<u32> = match &v["prompt"] {
                        serde_json::Value::String(t) => t.bytes().map(u32::from).collect(),
                        ids => serde_json::from_value(ids.clone()).unwrap(),
                    };
                    seen.lock().push((Instant::now(), p));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let chunks = "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"token_ids\":[7,7]}]}\n\n\
                                  data: [DONE]\n\n";
                    ([("content-type", "text/event-stream")], chunks).into_response()
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}")
    }

    fn step(kind: StepKind, key: u64, history: bool, gap_ms: u64) -> Step {
        Step {
            gap: Duration::from_millis(gap_ms),
            history,
            segments: vec![Segment::seeded(key, 8)],
            max_tokens: 2,
            kind,
        }
    }

    #[tokio::test]
    async fn fork_children_wait_for_the_parent_and_history_is_carried() {
        let seen: Seen = Arc::default();
        let base = serve(seen.clone()).await;
        let w = Workload {
            name: "t".into(),
            description: String::new(),
            seed: 1,
            token_space: TokenSpace::default(),
            sessions: vec![
                Session {
                    start: Start::At(Duration::ZERO),
                    steps: vec![step(StepKind::Parent, 1, false, 0)],
                },
                Session {
                    start: Start::After {
                        session: 0,
                        delay: Duration::from_millis(10),
                    },
                    steps: vec![step(StepKind::Child, 2, false, 0)],
                },
                Session {
                    start: Start::At(Duration::from_millis(200)),
                    steps: vec![
                        step(StepKind::Turn, 3, false, 0),
                        step(StepKind::Turn, 4, true, 50),
                    ],
                },
            ],
            max_active_sessions: None,
            offered_rate: None,
            request_timeout: Duration::from_secs(5),
            fleet: FleetShape {
                engines: 1,
                prefill: 0,
                decode: 0,
                num_gpu_blocks: 1,
                max_model_len: 1,
                cpu_tier_ratio: 2,
            },
            min_cached_token_delta: 1,
        };
        // Time scale 2: the 200 ms start becomes 100 ms.
        let cfg = DriveConfig {
            base_urls: vec![base],
            model: "m".into(),
            time_scale: 2.0,
            prompt_format: PromptFormat::Text,
            progress: None,
        };
        let recs = tokio::time::timeout(Duration::from_secs(10), drive(&w, &cfg))
            .await
            .unwrap();
        assert_eq!(recs.len(), 4);
        assert!(recs.iter().all(|r| r.outcome == Outcome::Ok));
        // The child was sent after the parent finished.
        assert!(recs[1].sent_s >= recs[0].sent_s + recs[0].e2e_s);
        assert!(
            recs[2].sent_s >= 0.09 && recs[2].sent_s < 0.5,
            "{}",
            recs[2].sent_s
        );
        // Turn 2 = turn 1 prompt + the returned answer ids + its own 8 tokens.
        let seen = seen.lock();
        assert_eq!(recs[2].prompt_tokens, 8);
        let t2 = &seen.iter().find(|(_, p)| p.len() == 18).unwrap().1;
        assert_eq!(recs[3].prompt_tokens, 18);
        assert_eq!(&t2[8..10], &[7, 7]);
        let g = TokenGen::new(1, TokenSpace::default());
        assert_eq!(t2[..8], g.render(&[Segment::seeded(3, 8)])[..]);
        assert_eq!(t2[10..], g.render(&[Segment::seeded(4, 8)])[..]);
    }

    #[tokio::test]
    async fn closed_loop_caps_active_sessions_and_failures_are_recorded() {
        let seen: Seen = Arc::default();
        let base = serve(seen.clone()).await;
        let sessions = (0..6)
            .map(|i| Session {
                start: Start::At(Duration::ZERO),
                steps: vec![step(StepKind::Request, i, false, 0)],
            })
            .collect();
        let w = Workload {
            name: "t".into(),
            description: String::new(),
            seed: 1,
            token_space: TokenSpace::default(),
            sessions,
            max_active_sessions: Some(2),
            offered_rate: None,
            request_timeout: Duration::from_secs(5),
            fleet: FleetShape {
                engines: 1,
                prefill: 0,
                decode: 0,
                num_gpu_blocks: 1,
                max_model_len: 1,
                cpu_tier_ratio: 2,
            },
            min_cached_token_delta: 1,
        };
        let cfg = DriveConfig {
            base_urls: vec![base],
            model: "m".into(),
            time_scale: 1.0,
            prompt_format: PromptFormat::Tokens,
            progress: None,
        };
        let recs = drive(&w, &cfg).await;
        // 6 requests of 20 ms, 2 at a time: the last starts after ≥ 2 rounds.
        let last = recs.iter().map(|r| r.sent_s).fold(0.0, f64::max);
        assert!(last >= 0.035, "{last}");
        let bad = DriveConfig {
            base_urls: vec!["http://127.0.0.1:9".into()],
            model: "m".into(),
            time_scale: 1.0,
            prompt_format: PromptFormat::Tokens,
            progress: None,
        };
        let recs = drive(&w, &bad).await;
        assert_eq!(recs.len(), 6);
        assert!(recs.iter().all(|r| matches!(r.outcome, Outcome::Error(_))));
    }
}
