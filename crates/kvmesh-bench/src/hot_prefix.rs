//! Workloads where one prefix is much more wanted than the rest, the fleet dynamics the reference
//! experiments stop short of (`docs/benchmarks.md#hot-prefixes`):
//!
//! - [`fanout`]: one engine holds a long prefix and `pullers` requests sharing it arrive at the
//!   same instant, so as many engines want it at once. With transfer physics that share the
//!   holder's link, each pull slows as `pullers` grows: the experiment asks whether the router
//!   still pulls, spreads sources or recomputes.
//! - [`skew`]: Poisson arrivals over a pool of shared prefixes whose popularity is Zipf with
//!   exponent `s` (0 = uniform, the control): the hot owners' queues and per-engine prefill
//!   balance.
//!
//! Pure data like every [`Workload`]; times are model time.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::tokens::{Segment, TokenSpace};
use crate::workload::{
    FleetShape, GPU_BLOCK_TOKENS, Scale, Session, SharedPrefixShape, Start, Step, StepKind,
    Workload, key, shared_prefix_arrivals,
};

/// Default puller counts `fanout` runs (one workload, one fresh fleet per count and arm).
pub fn fanout_pullers(scale: Scale) -> Vec<usize> {
    match scale {
        Scale::Quick => vec![2, 6],
        Scale::Full => vec![2, 4, 8],
    }
}

/// Default Zipf exponents `skew` runs; 0 is the uniform control.
pub fn skew_exponents(scale: Scale) -> Vec<f64> {
    match scale {
        Scale::Quick => vec![0.0, 1.2],
        Scale::Full => vec![0.0, 0.8, 1.2],
    }
}

/// Hot-prefix fan-out: a parent computes a `ctx`-token prefix on one engine; once it is done (and
/// its blocks are in the holder's CPU tier and the router's index), `pullers` children sharing the
/// prefix arrive together. The fleet has one engine more than the largest default puller count
/// (or than `pullers`, if larger), so every child can land on an engine without the prefix.
pub fn fanout(scale: Scale, seed: u64, pullers: usize) -> Workload {
    fanout_shaped(scale, seed, pullers, None)
}

/// Name stem of [`fanout_waves`].
pub const FANOUT_WAVES: &str = "fanout-waves";

/// Children in the first wave of [`fanout_waves`].
pub const WAVE_SIZE: usize = 4;

/// Model time between the two waves of [`fanout_waves`]: long enough for the first wave's pulls
/// of the quick scale's 8K-token prefix, four sharing one link (~170 ms), to land and be
/// announced, so the second wave finds the first wave's engines as holders.
pub const WAVE_GAP: Duration = Duration::from_millis(600);

/// The same fan-out in two waves (`fanout-waves@N`): [`WAVE_SIZE`] children first, the other
/// `pullers − WAVE_SIZE` together [`WAVE_GAP`] later. The second, larger burst finds the prefix
/// on the holder *and* on the engines that pulled it in the first: whether its pulls pile onto
/// one link or spread over the replicas is up to the router's choice of source.
pub fn fanout_waves(scale: Scale, seed: u64, pullers: usize) -> Workload {
    fanout_shaped(scale, seed, pullers, Some((WAVE_SIZE, WAVE_GAP)))
}

fn fanout_shaped(
    scale: Scale,
    seed: u64,
    pullers: usize,
    waves: Option<(usize, Duration)>,
) -> Workload {
    let pullers = pullers.max(1);
    let (ctx, engines) = match scale {
        Scale::Quick => (8192usize, 7usize),
        Scale::Full => (32768, 9),
    };
    // One engine per child plus the holder: more pullers than the default fleet would otherwise
    // put two children on one engine and measure that engine's ingress, not the holder's link.
    let engines = engines.max(pullers + 1);
    let context = key(&[60, seed]);
    let mut sessions = vec![Session {
        start: Start::At(Duration::ZERO),
        steps: vec![Step {
            gap: Duration::ZERO,
            history: false,
            segments: vec![
                Segment::seeded(context, ctx),
                Segment::seeded(key(&[61, seed]), 64),
            ],
            max_tokens: 16,
            kind: StepKind::Parent,
        }],
    }];
    for c in 0..pullers {
        sessions.push(Session {
            // Same instant for every child (of a wave): the pulls overlap on the holder's link.
            start: Start::After {
                session: 0,
                delay: Duration::from_millis(500)
                    + waves.map_or(
                        Duration::ZERO,
                        |(first, gap)| {
                            if c < first { Duration::ZERO } else { gap }
                        },
                    ),
            },
            steps: vec![Step {
                gap: Duration::ZERO,
                history: false,
                segments: vec![
                    Segment::seeded(context, ctx),
                    Segment::seeded(key(&[62, seed, c as u64]), 128),
                ],
                max_tokens: 32,
                kind: StepKind::Child,
            }],
        });
    }
    let (name, arrive) = match waves {
        None => (format!("fanout@{pullers}"), "at once".to_owned()),
        Some((first, gap)) => (
            format!("{FANOUT_WAVES}@{pullers}"),
            format!(
                "{} first, the rest together {} ms later",
                first.min(pullers),
                gap.as_millis()
            ),
        ),
    };
    Workload {
        name,
        description: format!(
            "one engine holds a {ctx}-token prefix; {pullers} requests sharing it arrive {arrive} on a {engines}-engine fleet"
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: None,
        offered_rate: None,
        request_timeout: Duration::from_secs(300),
        fleet: FleetShape {
            engines,
            prefill: 0,
            decode: 0,
            num_gpu_blocks: (ctx * 4).div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: ctx + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 2048,
    }
}

/// Cumulative Zipf(s) weights over ranks 1..=n (the last entry is 1).
/// `kvmesh_router_replications_total` by outcome from a router's `/metrics` text (empty when
/// no hot prefix was ever considered).
pub fn replication_outcomes(text: &str) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    for sample in kvmesh_core::exposition::parse_exposition(text) {
        if sample.name != "kvmesh_router_replications_total" {
            continue;
        }
        if let Some((_, outcome)) = sample.labels.iter().find(|(k, _)| k == "outcome") {
            *out.entry(outcome.clone()).or_insert(0.0) += sample.value;
        }
    }
    out
}

fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let weights: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect()
}

/// The rank (0-based) `u` in [0, 1) falls on.
fn zipf_rank(cdf: &[f64], u: f64) -> usize {
    cdf.partition_point(|&c| c <= u)
        .min(cdf.len().saturating_sub(1))
}

/// Hot-prefix skew (`skew@s`): Poisson arrivals at a fixed rate, each a shared prefix drawn
/// Zipf(`exponent`) from the pool plus a fresh 128-token question. A server's GPU tier holds about
/// a quarter of the pool, enough for the hot head, not for everything. The fleet stays lightly
/// loaded: the hot owners' queues stay short.
pub fn skew(scale: Scale, seed: u64, exponent: f64) -> Workload {
    let shape = match scale {
        Scale::Quick => SkewShape {
            prefixes: 32,
            prefix_len: 4096,
            question_len: 128,
            rate: 6.0,
            duration_s: 20.0,
            engines: 4,
        },
        Scale::Full => SkewShape {
            prefixes: 64,
            prefix_len: 8192,
            question_len: 128,
            rate: 10.0,
            duration_s: 120.0,
            engines: 8,
        },
    };
    skew_shaped("skew", shape, seed, exponent)
}

/// The same popularity with 2K-token questions at a higher rate (`skew-heavy@s`): every request
/// brings real prefill work of its own, so at s = 1.2 the hottest prefix's requests alone keep one
/// engine about 80 % busy (full: 32 req/s, 29 % of them for rank 1, ~85 ms of prefill each) while
/// the fleet as a whole stays about a third busy. Locality then breaks by itself: the hot owner
/// queues, and only placement that spreads its requests (pulling the prefix or recomputing it
/// elsewhere) keeps the tail down.
pub fn skew_heavy(scale: Scale, seed: u64, exponent: f64) -> Workload {
    let shape = match scale {
        Scale::Quick => SkewShape {
            prefixes: 32,
            prefix_len: 4096,
            question_len: 2048,
            rate: 16.0,
            duration_s: 20.0,
            engines: 4,
        },
        Scale::Full => SkewShape {
            prefixes: 64,
            prefix_len: 8192,
            question_len: 2048,
            rate: 32.0,
            duration_s: 120.0,
            engines: 8,
        },
    };
    skew_shaped(SKEW_HEAVY, shape, seed, exponent)
}

/// Name stem of [`skew_heavy`].
pub const SKEW_HEAVY: &str = "skew-heavy";

struct SkewShape {
    prefixes: usize,
    prefix_len: usize,
    question_len: usize,
    rate: f64,
    duration_s: f64,
    engines: usize,
}

fn skew_shaped(stem: &str, shape: SkewShape, seed: u64, exponent: f64) -> Workload {
    let SkewShape {
        prefixes,
        prefix_len: len,
        question_len,
        rate,
        duration_s,
        engines,
    } = shape;
    let exponent = if exponent.is_finite() && exponent >= 0.0 {
        exponent
    } else {
        0.0
    };
    let cdf = zipf_cdf(prefixes, exponent);
    // The stem keeps `skew` draws as they were and gives each variant its own arrivals.
    let variant = if stem == "skew" { 0 } else { 1 };
    let mut rng = ChaCha8Rng::seed_from_u64(key(&[70 + variant, seed, exponent.to_bits()]));
    let sessions = shared_prefix_arrivals(
        &mut rng,
        SharedPrefixShape {
            rate,
            duration_s,
            prefix_len: len,
            question_len,
            max_tokens: 64,
            keys: (seed, 71, 72),
        },
        |rng| zipf_rank(&cdf, rng.random_range(0.0..1.0)) as u64,
    );
    let offered = sessions.len() as f64 / duration_s;
    let per_server_tokens = prefixes * len / 4;
    Workload {
        name: format!("{stem}@{exponent}"),
        description: format!(
            "{prefixes} prefixes × {len} tokens + {question_len}-token questions, Zipf popularity s={exponent}, Poisson {rate} req/s for {duration_s} s on {engines} engines"
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: None,
        offered_rate: Some(offered),
        request_timeout: Duration::from_secs(120),
        fleet: FleetShape {
            engines,
            prefill: 0,
            decode: 0,
            num_gpu_blocks: per_server_tokens.div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: len + question_len + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 2048,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::tokens::TokenGen;

    fn prefix_key(s: &Session) -> u64 {
        match &s.steps[0].segments[0] {
            Segment::Seeded { key, .. } => *key,
            Segment::Literal(_) => unreachable!(),
        }
    }

    #[test]
    fn fanout_children_share_the_prefix_and_arrive_together() {
        let w = fanout(Scale::Full, 3, 8);
        assert_eq!(w.name, "fanout@8");
        assert_eq!(w.sessions.len(), 9);
        assert!(w.fleet.engines > 8, "every child can land on a non-holder");
        let g = TokenGen::new(w.seed, w.token_space);
        let parent = g.render(&w.sessions[0].steps[0].segments);
        let starts: Vec<_> = w.sessions[1..]
            .iter()
            .map(|s| match s.start {
                Start::After { session: 0, delay } => delay,
                _ => panic!("children start after the parent"),
            })
            .collect();
        assert!(starts.windows(2).all(|p| p[0] == p[1]), "one instant");
        let c1 = g.render(&w.sessions[1].steps[0].segments);
        let c2 = g.render(&w.sessions[2].steps[0].segments);
        assert_eq!(parent[..32768], c1[..32768]);
        assert_eq!(c1[..32768], c2[..32768]);
        assert_ne!(c1[32768..], c2[32768..]);
    }

    #[test]
    fn fanout_waves_arrive_in_two_bursts_on_a_fleet_with_an_engine_per_child() {
        let w = fanout_waves(Scale::Quick, 3, 12);
        assert_eq!(w.name, "fanout-waves@12");
        assert_eq!(w.fleet.engines, 13);
        let starts: Vec<_> = w.sessions[1..]
            .iter()
            .map(|s| match s.start {
                Start::After { session: 0, delay } => delay,
                _ => panic!("children start after the parent"),
            })
            .collect();
        let ms = |m: u64| Duration::from_millis(m);
        assert_eq!(&starts[..4], &[ms(500); 4]);
        assert_eq!(&starts[4..], &[ms(1100); 8]);
        // The plain fan-out grows its fleet the same way and keeps the default otherwise.
        assert_eq!(fanout(Scale::Quick, 3, 12).fleet.engines, 13);
        assert_eq!(fanout(Scale::Quick, 3, 6).fleet.engines, 7);
    }

    #[test]
    fn zipf_head_grows_with_the_exponent_and_zero_is_uniform() {
        let share_of_top = |s: f64| {
            let w = skew(Scale::Full, 5, s);
            let mut counts = std::collections::HashMap::new();
            for sess in &w.sessions {
                *counts.entry(prefix_key(sess)).or_insert(0usize) += 1;
            }
            let mut c: Vec<usize> = counts.into_values().collect();
            c.sort_unstable_by(|a, b| b.cmp(a));
            (c[0] as f64 / w.sessions.len() as f64, c.len())
        };
        let (uniform_top, uniform_distinct) = share_of_top(0.0);
        let (mid_top, _) = share_of_top(0.8);
        let (hot_top, hot_distinct) = share_of_top(1.2);
        // Uniform over 64: the most popular prefix gets a few percent, almost all are used.
        assert!(uniform_top < 0.05, "{uniform_top}");
        assert!(uniform_distinct >= 60, "{uniform_distinct}");
        // Zipf(1.2) over 64: rank 1 carries ~24% of the mass.
        assert!(hot_top > 0.18 && hot_top < 0.32, "{hot_top}");
        assert!(uniform_top < mid_top && mid_top < hot_top);
        assert!(hot_distinct <= uniform_distinct);
    }

    #[test]
    fn replication_outcomes_come_from_the_router_counters() {
        let text = "# TYPE kvmesh_router_replications counter\n\
            kvmesh_router_replications_total{outcome=\"issued\"} 3\n\
            kvmesh_router_replications_total{outcome=\"landed\"} 2\n\
            kvmesh_router_requests_total 9\n";
        let got = replication_outcomes(text);
        assert_eq!(got.get("issued"), Some(&3.0));
        assert_eq!(got.get("landed"), Some(&2.0));
        assert_eq!(got.len(), 2);
        assert!(replication_outcomes("kvmesh_router_requests_total 9\n").is_empty());
    }

    #[test]
    fn zipf_cdf_is_a_distribution() {
        let cdf = zipf_cdf(10, 1.0);
        assert!((cdf[9] - 1.0).abs() < 1e-12);
        assert!(cdf.windows(2).all(|p| p[0] < p[1]));
        assert_eq!(zipf_rank(&cdf, 0.0), 0);
        assert_eq!(zipf_rank(&cdf, 0.999_999_999), 9);
        // Harmonic(10) = 2.929: rank 1 has 1/2.929 = 34% of the mass.
        assert!((cdf[0] - 0.3414).abs() < 1e-3);
    }

    #[test]
    fn skew_arrivals_are_poisson_at_the_rate() {
        let w = skew(Scale::Full, 9, 1.2);
        let n = w.sessions.len() as f64;
        assert!((n - 1200.0).abs() < 1200.0 * 0.15, "{n}");
        assert_eq!(w.name, "skew@1.2");
    }

    #[test]
    fn heavy_skew_brings_long_questions_and_its_own_arrivals() {
        let light = skew(Scale::Full, 9, 1.2);
        let heavy = skew_heavy(Scale::Full, 9, 1.2);
        assert_eq!(heavy.name, "skew-heavy@1.2");
        let n = heavy.sessions.len() as f64;
        assert!((n - 3840.0).abs() < 3840.0 * 0.1, "{n}");
        let question = |s: &Session| s.steps[0].segments[1].len();
        assert!(heavy.sessions.iter().all(|s| question(s) == 2048));
        assert!(light.sessions.iter().all(|s| question(s) == 128));
        // The hottest prefix takes ~29% of requests at s = 1.2.
        let mut counts = std::collections::HashMap::new();
        for s in &heavy.sessions {
            *counts.entry(prefix_key(s)).or_insert(0usize) += 1;
        }
        let max = counts.values().copied().max().unwrap_or(0) as f64;
        assert!((max / n - 0.29).abs() < 0.04, "{}", max / n);
        assert!(heavy.fleet.max_model_len >= 8192 + 2048 + 64);
    }
}
