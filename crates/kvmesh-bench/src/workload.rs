//! Workload generators for the reference experiments in `docs/architecture.md#reference-experiments`.
//!
//! A [`Workload`] is pure data: sessions of steps with explicit arrival rules, built from a seed.
//! Times are *model time* (what the published GPU runs saw); the driver divides them by the fleet's
//! time scale so a sped-up sim fleet sees the same shape. `quick` keeps each shape but shrinks
//! counts, lengths and durations so CI can run it.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::tokens::{Segment, TokenSpace, mix};

/// How big a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scale {
    /// Same shape, smaller counts/lengths/durations: minutes on 2 cores.
    Quick,
    /// The published sizes.
    Full,
}

impl std::str::FromStr for Scale {
    type Err = WorkloadError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "quick" => Ok(Self::Quick),
            "full" => Ok(Self::Full),
            other => Err(WorkloadError::Unknown(format!(
                "scale {other:?} (quick|full)"
            ))),
        }
    }
}

/// When a session's first step is sent.
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
    /// At this offset from the start of the run (open loop: Poisson, trace timestamps, bursts).
    At(Duration),
    /// `delay` after another session finished (fork children after their parent).
    After { session: usize, delay: Duration },
}

/// What a step is, for reports (per-branch plots, burst head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum StepKind {
    Seed,
    Probe,
    Parent,
    Child,
    Request,
    Turn,
}

/// One request of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Think/tool time after the previous step of the session completed.
    pub gap: Duration,
    /// Prepend the previous step's prompt and its answer (multi-turn history).
    pub history: bool,
    /// New tokens of this step (after the history, if any).
    pub segments: Vec<Segment>,
    /// Output length; sent with `ignore_eos` so it is exact.
    pub max_tokens: u32,
    pub kind: StepKind,
}

/// A chain of steps run one after another.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub start: Start,
    pub steps: Vec<Step>,
}

/// Fleet a workload was designed for (the runner builds the fleet from it unless told otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetShape {
    /// Aggregated (`both`) engines.
    pub engines: usize,
    /// P/D: prefill engines (0 = aggregated fleet).
    pub prefill: usize,
    /// P/D: decode engines.
    pub decode: usize,
    /// GPU-tier blocks per engine (block size 16).
    pub num_gpu_blocks: usize,
    /// Longest prompt + output the workload produces, for `--max-model-len`.
    pub max_model_len: usize,
    /// CPU-tier blocks per GPU-tier block (host memory for offloaded KV; 2 unless the
    /// experiment's premise is that the tier holds every live session).
    pub cpu_tier_ratio: usize,
}

/// A runnable workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Name in reports, e.g. `fork` or `pool@8`.
    pub name: String,
    pub description: String,
    pub seed: u64,
    pub token_space: TokenSpace,
    pub sessions: Vec<Session>,
    /// Closed loop: at most this many sessions in progress (others wait for a slot).
    pub max_active_sessions: Option<usize>,
    /// Nominal offered rate (req/s, model time) for open-loop workloads.
    pub offered_rate: Option<f64>,
    /// Client timeout per request (model time).
    pub request_timeout: Duration,
    pub fleet: FleetShape,
    /// `min_cached_token_delta` the P2P arms use (tokens).
    pub min_cached_token_delta: usize,
}

impl Workload {
    pub fn num_requests(&self) -> usize {
        self.sessions.iter().map(|s| s.steps.len()).sum()
    }
}

#[derive(Debug, Error)]
pub enum WorkloadError {
    #[error("unknown {0}")]
    Unknown(String),
    #[error("trace {path}: {reason}")]
    Trace { path: String, reason: String },
}

/// Knobs some workloads take from the command line.
#[derive(Debug, Clone, Default)]
pub struct WorkloadOptions {
    /// `pool`: offered rates (req/s); default 4,8,12,16 (quick: 4,12).
    pub rates: Option<Vec<f64>>,
    /// `trace`: replay speed-up of the timestamps (2.0 = twice as fast).
    pub speed: Option<f64>,
    /// `trace`: `(start, length)` of the replayed window in trace seconds.
    pub window: Option<(f64, f64)>,
    pub token_space: Option<TokenSpace>,
}

pub(crate) fn key(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x6b76_6d65_7368_u64, |acc, &p| mix(acc, p))
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

pub(crate) fn secs_f(v: f64) -> Duration {
    Duration::from_secs_f64(v.max(0.0))
}

pub(crate) const GPU_BLOCK_TOKENS: usize = 16;

/// Transfer pricing ladder through the fleet: each fresh prefix is sent twice, one after the other
/// (seed, then probe with another suffix); placement decides whether the probe hits, pulls or
/// recomputes. `kvmesh calibrate` times the same ladder on one pair directly.
pub fn ladder(scale: Scale, seed: u64) -> Workload {
    let (lengths, reps): (&[usize], usize) = match scale {
        Scale::Quick => (&[1024, 2048, 4096, 8192], 2),
        Scale::Full => (&[2048, 4096, 8192, 16384, 32768, 49152], 3),
    };
    let mut sessions = Vec::new();
    for (li, &len) in lengths.iter().enumerate() {
        for rep in 0..reps {
            let prefix = key(&[1, li as u64, rep as u64]);
            let step = |kind, suffix: u64, gap| Step {
                gap,
                history: false,
                segments: vec![
                    Segment::seeded(prefix, len),
                    Segment::seeded(key(&[2, prefix, suffix]), 16),
                ],
                max_tokens: 4,
                kind,
            };
            sessions.push(Session {
                start: Start::At(Duration::ZERO),
                steps: vec![
                    step(StepKind::Seed, 0, Duration::ZERO),
                    step(StepKind::Probe, 1, ms(500)),
                ],
            });
        }
    }
    let max_len = lengths.iter().copied().max().unwrap_or(0);
    Workload {
        name: "ladder".into(),
        description: format!(
            "fresh prefixes {lengths:?} tokens × {reps}: seed then probe, one at a time"
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: Some(1),
        offered_rate: None,
        request_timeout: Duration::from_secs(300),
        fleet: FleetShape {
            engines: 2,
            prefill: 0,
            decode: 0,
            num_gpu_blocks: (max_len * 4).div_ceil(GPU_BLOCK_TOKENS).max(4096),
            max_model_len: max_len + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 512,
    }
}

/// Fork burst: a parent builds a long context, then children sharing it arrive in a burst.
pub fn fork(scale: Scale, seed: u64) -> Workload {
    let (ctx, children, spacing_ms) = match scale {
        Scale::Quick => (8192usize, 16usize, 40u64),
        Scale::Full => (40960, 43, 60),
    };
    let context = key(&[10, seed]);
    let mut sessions = vec![Session {
        start: Start::At(Duration::ZERO),
        steps: vec![Step {
            gap: Duration::ZERO,
            history: false,
            segments: vec![
                Segment::seeded(context, ctx),
                Segment::seeded(key(&[11, 0]), 64),
            ],
            max_tokens: 16,
            kind: StepKind::Parent,
        }],
    }];
    for c in 0..children {
        sessions.push(Session {
            start: Start::After {
                session: 0,
                delay: ms(200 + spacing_ms * c as u64),
            },
            steps: vec![Step {
                gap: Duration::ZERO,
                history: false,
                segments: vec![
                    Segment::seeded(context, ctx),
                    Segment::seeded(key(&[12, c as u64]), 256),
                ],
                max_tokens: 32,
                kind: StepKind::Child,
            }],
        });
    }
    Workload {
        name: "fork".into(),
        description: format!(
            "parent builds a {ctx}-token context, then {children} children sharing it arrive {spacing_ms} ms apart"
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: None,
        offered_rate: None,
        request_timeout: Duration::from_secs(300),
        fleet: FleetShape {
            engines: 4,
            prefill: 0,
            decode: 0,
            num_gpu_blocks: (ctx * 8).div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: ctx + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 2048,
    }
}

/// What [`shared_prefix_arrivals`] generates: arrivals per second, for how long (model seconds),
/// the shared prefixes' length, each request's own question (tokens in) and answer (tokens out),
/// and `(seed, prefix tag, question tag)` for the segment keys.
pub(crate) struct SharedPrefixShape {
    pub rate: f64,
    pub duration_s: f64,
    pub prefix_len: usize,
    pub question_len: usize,
    pub max_tokens: u32,
    pub keys: (u64, u64, u64),
}

/// Open-loop single-request sessions: Poisson arrivals, each a shared prefix chosen by
/// `pick_prefix` plus a fresh question of `question_len` tokens. Per arrival the RNG draws the
/// gap first, then `pick_prefix` draws, so a workload stays the same for a seed.
pub(crate) fn shared_prefix_arrivals(
    rng: &mut ChaCha8Rng,
    shape: SharedPrefixShape,
    mut pick_prefix: impl FnMut(&mut ChaCha8Rng) -> u64,
) -> Vec<Session> {
    let (seed, prefix_tag, question_tag) = shape.keys;
    let mut t = 0.0f64;
    let mut sessions = Vec::new();
    for i in 0u64.. {
        // Exponential inter-arrival: -ln(U)/rate.
        let u: f64 = rng.random_range(f64::EPSILON..1.0);
        t += -u.ln() / shape.rate;
        if t >= shape.duration_s {
            break;
        }
        let p = pick_prefix(rng);
        sessions.push(Session {
            start: Start::At(secs_f(t)),
            steps: vec![Step {
                gap: Duration::ZERO,
                history: false,
                segments: vec![
                    Segment::seeded(key(&[prefix_tag, seed, p]), shape.prefix_len),
                    Segment::seeded(key(&[question_tag, seed, i]), shape.question_len),
                ],
                max_tokens: shape.max_tokens,
                kind: StepKind::Request,
            }],
        });
    }
    sessions
}

/// Shared-prefix pool: more shared prefixes than one server caches, Poisson arrivals at `rate`.
pub fn pool(scale: Scale, seed: u64, rate: f64) -> Workload {
    let (prefixes, len, duration_s) = match scale {
        Scale::Quick => (16usize, 4096usize, 20.0f64),
        Scale::Full => (64, 16384, 120.0),
    };
    let rate = if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        1.0
    };
    let mut rng = ChaCha8Rng::seed_from_u64(key(&[20, seed, rate.to_bits()]));
    let sessions = shared_prefix_arrivals(
        &mut rng,
        SharedPrefixShape {
            rate,
            duration_s,
            prefix_len: len,
            question_len: 128,
            max_tokens: 64,
            keys: (seed, 21, 22),
        },
        |rng| rng.random_range(0..prefixes as u64),
    );
    // What was actually offered: this Poisson realisation, not the nominal rate.
    let offered = sessions.len() as f64 / duration_s;
    // A server holds about a quarter of the pool, so no single server caches it all.
    let per_server_tokens = prefixes * len / 4;
    Workload {
        name: format!("pool@{rate}"),
        description: format!(
            "{prefixes} prefixes × {len} tokens, Poisson {rate} req/s for {duration_s} s"
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: None,
        offered_rate: Some(offered),
        request_timeout: Duration::from_secs(120),
        fleet: FleetShape {
            engines: 4,
            prefill: 0,
            decode: 0,
            num_gpu_blocks: per_server_tokens.div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: len + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 2048,
    }
}

/// Document Q&A: long documents, several short turns each, many conversations active.
pub fn docqa(scale: Scale, seed: u64) -> Workload {
    let (docs, len, turns, active, servers) = match scale {
        Scale::Quick => (24usize, 8192usize, 3usize, 16usize, 4usize),
        Scale::Full => (192, 49152, 6, 128, 16),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(key(&[30, seed]));
    let mut sessions = Vec::new();
    for d in 0..docs {
        let mut steps = Vec::new();
        for t in 0..turns {
            let mut segments = Vec::new();
            if t == 0 {
                segments.push(Segment::seeded(key(&[31, seed, d as u64]), len));
            }
            segments.push(Segment::seeded(
                key(&[32, seed, d as u64, t as u64]),
                rng.random_range(32..96),
            ));
            steps.push(Step {
                gap: if t == 0 {
                    Duration::ZERO
                } else {
                    ms(rng.random_range(200..1500))
                },
                history: t > 0,
                segments,
                max_tokens: 48,
                kind: StepKind::Turn,
            });
        }
        sessions.push(Session {
            start: Start::At(Duration::ZERO),
            steps,
        });
    }
    // The corpus fits in aggregate GPU capacity (owner contention, not capacity, is the point).
    let per_server_tokens = (docs * (len + turns * 200)).div_ceil(servers) * 5 / 4;
    Workload {
        name: "docqa".into(),
        description: format!(
            "{docs} documents × {len} tokens, {turns} short turns each, {active} conversations active"
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: Some(active),
        offered_rate: None,
        request_timeout: Duration::from_secs(60),
        fleet: FleetShape {
            engines: servers,
            prefill: 0,
            decode: 0,
            num_gpu_blocks: per_server_tokens.div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: len + turns * 256 + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 2048,
    }
}

/// Multi-turn agentic sessions over P/D: long system prompts, many turns, tool gaps.
pub fn agentic_pd(scale: Scale, seed: u64) -> Workload {
    struct Shape {
        convs: usize,
        sys: (usize, usize),
        turns: (usize, usize),
        input: (usize, usize),
        output: u32,
        gap_s: (f64, f64),
        prefill: usize,
        decode: usize,
    }
    let s = match scale {
        Scale::Quick => Shape {
            convs: 6,
            sys: (4096, 16384),
            turns: (2, 5),
            input: (200, 400),
            output: 64,
            gap_s: (1.0, 4.0),
            prefill: 1,
            decode: 2,
        },
        Scale::Full => Shape {
            convs: 24,
            sys: (10_000, 100_000),
            turns: (4, 40),
            input: (1200, 1800),
            output: 425,
            gap_s: (1.0, 20.0),
            prefill: 2,
            decode: 4,
        },
    };
    let mut rng = ChaCha8Rng::seed_from_u64(key(&[40, seed]));
    let mut sessions = Vec::new();
    let mut longest = 0usize;
    for c in 0..s.convs {
        let sys = rng.random_range(s.sys.0..=s.sys.1);
        let turns = rng.random_range(s.turns.0..=s.turns.1);
        let mut steps = Vec::new();
        let mut total = sys;
        for t in 0..turns {
            let input = rng.random_range(s.input.0..=s.input.1);
            let mut segments = Vec::new();
            if t == 0 {
                segments.push(Segment::seeded(key(&[41, seed, c as u64]), sys));
            }
            segments.push(Segment::seeded(key(&[42, seed, c as u64, t as u64]), input));
            total += input + s.output as usize;
            steps.push(Step {
                gap: if t == 0 {
                    Duration::ZERO
                } else {
                    secs_f(rng.random_range(s.gap_s.0..=s.gap_s.1))
                },
                history: t > 0,
                segments,
                max_tokens: s.output,
                kind: StepKind::Turn,
            });
        }
        longest = longest.max(total);
        // Sessions join over the first few seconds rather than all at t=0.
        sessions.push(Session {
            start: Start::At(secs_f(rng.random_range(0.0..s.gap_s.1 / 2.0))),
            steps,
        });
    }
    Workload {
        name: "agentic-pd".into(),
        description: format!(
            "{} conversations, system prompts {}–{} tokens, {}–{} turns of ~{} in / {} out, tool gaps {}–{} s",
            s.convs,
            s.sys.0,
            s.sys.1,
            s.turns.0,
            s.turns.1,
            (s.input.0 + s.input.1) / 2,
            s.output,
            s.gap_s.0,
            s.gap_s.1
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: None,
        offered_rate: None,
        request_timeout: Duration::from_secs(600),
        fleet: FleetShape {
            engines: 0,
            prefill: s.prefill,
            decode: s.decode,
            num_gpu_blocks: (longest * 3).div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: longest + 2048,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 1024,
    }
}

/// The nominal prompt length of every step, assuming each answer is exactly `max_tokens` long.
#[cfg(test)]
fn nominal_prompt_lengths(session: &Session) -> Vec<usize> {
    let mut out = Vec::new();
    let mut prev = 0usize;
    let mut prev_answer = 0usize;
    for step in &session.steps {
        let own: usize = step.segments.iter().map(Segment::len).sum();
        let len = if step.history {
            prev + prev_answer + own
        } else {
            own
        };
        out.push(len);
        prev = len;
        prev_answer = step.max_tokens as usize;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::build;
    use crate::tokens::TokenGen;

    #[test]
    fn deterministic_from_seed() {
        let a = build("pool", Scale::Quick, 1, &WorkloadOptions::default()).unwrap();
        let b = build("pool", Scale::Quick, 1, &WorkloadOptions::default()).unwrap();
        let c = build("pool", Scale::Quick, 2, &WorkloadOptions::default()).unwrap();
        assert_eq!(a[0].sessions, b[0].sessions);
        assert_ne!(a[0].sessions, c[0].sessions);
    }

    #[test]
    fn fork_children_share_the_parent_context_token_for_token() {
        let w = fork(Scale::Full, 3);
        assert_eq!(w.sessions.len(), 44);
        assert_eq!(w.fleet.engines, 4);
        let g = TokenGen::new(w.seed, w.token_space);
        let parent = g.render(&w.sessions[0].steps[0].segments);
        let c1 = g.render(&w.sessions[1].steps[0].segments);
        let c2 = g.render(&w.sessions[43].steps[0].segments);
        assert_eq!(&parent[..40960], &c1[..40960]);
        assert_eq!(&c1[..40960], &c2[..40960]);
        assert_ne!(&c1[40960..], &c2[40960..]);
        for s in &w.sessions[1..] {
            assert!(matches!(s.start, Start::After { session: 0, .. }));
        }
        // A burst: all 43 children within a few seconds.
        let last = match w.sessions[43].start {
            Start::After { delay, .. } => delay,
            Start::At(_) => unreachable!(),
        };
        assert!(last < Duration::from_secs(4));
    }

    #[test]
    fn pool_rate_and_prefix_count_follow_the_shape() {
        let ws = build("pool", Scale::Full, 5, &WorkloadOptions::default()).unwrap();
        assert_eq!(ws.len(), 4);
        for w in &ws {
            let rate: f64 = w.name.strip_prefix("pool@").unwrap().parse().unwrap();
            let n = w.sessions.len() as f64;
            // Poisson count over 120 s: within 20% of rate × 120.
            assert!(
                (n - rate * 120.0).abs() < rate * 120.0 * 0.2,
                "{} {n}",
                w.name
            );
            let mut prefixes: Vec<_> = w
                .sessions
                .iter()
                .map(|s| match &s.steps[0].segments[0] {
                    Segment::Seeded { key, len } => {
                        assert_eq!(*len, 16384);
                        *key
                    }
                    Segment::Literal(_) => unreachable!(),
                })
                .collect();
            prefixes.sort_unstable();
            prefixes.dedup();
            assert!(prefixes.len() <= 64);
            if rate >= 8.0 {
                assert!(prefixes.len() > 56);
            }
            // Arrivals are sorted and inside the window.
            let times: Vec<_> = w
                .sessions
                .iter()
                .map(|s| match s.start {
                    Start::At(t) => t,
                    Start::After { .. } => unreachable!(),
                })
                .collect();
            assert!(times.windows(2).all(|p| p[0] <= p[1]));
            assert!(times.last().unwrap() < &Duration::from_secs(120));
        }
    }

    #[test]
    fn docqa_shape() {
        let w = docqa(Scale::Full, 1);
        assert_eq!(w.sessions.len(), 192);
        assert_eq!(w.max_active_sessions, Some(128));
        assert_eq!(w.fleet.engines, 16);
        for s in &w.sessions {
            assert_eq!(s.steps.len(), 6);
            assert!(!s.steps[0].history && s.steps[1..].iter().all(|t| t.history));
            let lens = nominal_prompt_lengths(s);
            assert!(lens[0] > 49152 && lens[0] < 49152 + 100);
            assert!(lens.windows(2).all(|p| p[0] < p[1]));
        }
    }

    #[test]
    fn agentic_shape() {
        let w = agentic_pd(Scale::Full, 9);
        assert_eq!(w.sessions.len(), 24);
        assert_eq!((w.fleet.prefill, w.fleet.decode), (2, 4));
        let mut total_prompt = 0usize;
        let mut n = 0usize;
        for s in &w.sessions {
            assert!((4..=40).contains(&s.steps.len()));
            let sys = s.steps[0].segments[0].len();
            assert!((10_000..=100_000).contains(&sys));
            for t in &s.steps[1..] {
                assert!(t.gap >= Duration::from_secs(1) && t.gap <= Duration::from_secs(20));
                assert_eq!(t.max_tokens, 425);
            }
            for l in nominal_prompt_lengths(s) {
                total_prompt += l;
                n += 1;
            }
            assert!(nominal_prompt_lengths(s).last().unwrap() + 425 < w.fleet.max_model_len);
        }
        // The published run averaged 61.9K-token prompts; ours lands in the same range.
        let mean = total_prompt / n;
        assert!((35_000..=100_000).contains(&mean), "mean prompt {mean}");
    }

    #[test]
    fn ladder_probes_repeat_the_seeded_prefix() {
        let w = ladder(Scale::Full, 1);
        assert_eq!(w.sessions.len(), 18);
        let g = TokenGen::new(w.seed, w.token_space);
        for s in &w.sessions {
            let a = g.render(&s.steps[0].segments);
            let b = g.render(&s.steps[1].segments);
            let len = s.steps[0].segments[0].len();
            assert_eq!(a[..len], b[..len]);
            assert_ne!(a[len..], b[len..]);
        }
    }

    #[test]
    fn quick_keeps_the_shape_but_is_smaller() {
        for name in [
            "fork",
            "pool",
            "docqa",
            "agentic-pd",
            "ladder",
            "fanout",
            "skew",
            "skew-heavy",
        ] {
            let q = build(name, Scale::Quick, 1, &WorkloadOptions::default()).unwrap();
            let f = build(name, Scale::Full, 1, &WorkloadOptions::default()).unwrap();
            let requests = |ws: &[Workload]| ws.iter().map(Workload::num_requests).sum::<usize>();
            assert!(requests(&q) < requests(&f), "{name}");
            assert!(
                q[0].fleet.max_model_len < f[0].fleet.max_model_len,
                "{name}"
            );
        }
    }

    #[test]
    fn unknown_names_are_errors() {
        assert!(build("nope", Scale::Quick, 1, &WorkloadOptions::default()).is_err());
        assert!(build("pool@x", Scale::Quick, 1, &WorkloadOptions::default()).is_err());
        for bad in [
            "fanout@0",
            "fanout@x",
            "fanout-waves@0",
            "fanout-waves@65",
            "fanout-waves12",
            "skew@-1",
            "skew@nan",
            "skew@9",
            "skew-heavy@x",
            "skew-heavy1",
        ] {
            assert!(
                build(bad, Scale::Quick, 1, &WorkloadOptions::default()).is_err(),
                "{bad}"
            );
        }
        assert_eq!(
            build("skew@0.8", Scale::Quick, 1, &WorkloadOptions::default()).unwrap()[0].name,
            "skew@0.8"
        );
        assert_eq!(
            build(
                "skew-heavy@1.2",
                Scale::Quick,
                1,
                &WorkloadOptions::default()
            )
            .unwrap()[0]
                .name,
            "skew-heavy@1.2"
        );
        assert_eq!(
            build("pool@8", Scale::Quick, 1, &WorkloadOptions::default()).unwrap()[0].name,
            "pool@8"
        );
    }
}
