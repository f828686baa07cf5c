//! Scale-out warm-up (issue 17): a cold engine joins a loaded fleet mid-run. How long until it
//! serves at the fleet's TTFT, with and without P2P?
//!
//! The workload is multi-turn conversations over a pool of long shared system prefixes (Poisson
//! session arrivals), on a fleet one engine short. At [`JOIN_FRACTION`] of the run the runner
//! starts one more engine and rewrites the router's config file; the router hot-reloads its static
//! endpoint list (`docs/discovery.md`), so the newcomer is found the way an operator would add
//! one. From then on the harness scrapes the newcomer's counters once per window (computed,
//! locally hit and pulled prompt tokens) and, after the run, joins every request with the router's
//! decision log to know where it ran. Per window: the newcomer's TTFT (p50 and mean) against the
//! rest of the fleet's; the warm-up time is the first window from which the newcomer's mean TTFT
//! keeps up with the fleet average ([`warm_up_window`]). The mean, not the p50, is judged: a
//! newcomer whose median request already hits can still recompute a prefix every few requests,
//! and those recomputes are what warming up removes. The arms to compare are `load` (a cold newcomer recomputes every prefix
//! it meets) and `load-p2p` (it pulls them).
//!
//! Pure parts (workload, windows, warm-up time, tables) are unit-tested; [`join_one`] does the I/O.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::watch;

use crate::client::Outcome;
use crate::driver::{self, RequestRecord};
use crate::fleet::{Fleet, FleetSpec};
use crate::metrics::EngineEvidence;
use crate::stats::Latency;
use crate::tokens::{Segment, TokenSpace};
use crate::workload::{
    FleetShape, GPU_BLOCK_TOKENS, Scale, Session, Start, Step, StepKind, Workload, key, secs_f,
};

/// Name of the workload in `kvmesh bench --workload`.
pub const NAME: &str = "scaleout";

/// The newcomer starts at this fraction of the arrival span: the fleet has been loaded (and its
/// caches filled) for a while, and most of the run is left to watch the newcomer warm up.
pub const JOIN_FRACTION: f64 = 0.3;

/// Windows the arrival span is cut into (quick: 4 s each, full: 7.5 s).
pub const WINDOWS: f64 = 12.0;

/// Warm = the newcomer's window mean TTFT within this factor of the rest of the fleet's...
pub const TOLERANCE: f64 = 1.2;
/// ...or this close in absolute terms (model s), so two ~20 ms cache hits count as equal.
pub const SLACK_S: f64 = 0.010;
/// Windows with fewer requests (on the newcomer, or on the rest) say nothing either way.
pub const MIN_REQUESTS: usize = 3;
/// Consecutive windows with data that must all keep up.
pub const SUSTAIN: usize = 2;

/// Conversations over shared system prefixes, Poisson arrivals, 1–3 turns each.
pub fn scaleout(scale: Scale, seed: u64) -> Workload {
    let (engines, prefixes, prefix_len, rate, duration_s) = match scale {
        // ~11 req/s on 3 engines (quick), ~20 req/s on 8 (full): loaded, though the rest of the
        // fleet still answers at cache-hit speed, so a gap is the newcomer's cold cache. Both
        // stay under the router's 2,048-record decision log, which attributes requests.
        Scale::Quick => (3usize, 16u64, 8192usize, 6.0f64, 48.0f64),
        Scale::Full => (8, 32, 16384, 10.0, 90.0),
    };
    let question = 128usize;
    let answer = 48u32;
    let mut rng = ChaCha8Rng::seed_from_u64(key(&[60, seed]));
    let mut sessions = Vec::new();
    let mut t = 0.0f64;
    for i in 0u64.. {
        // Exponential inter-arrival: -ln(U)/rate (U in (0, 1]).
        let u: f64 = 1.0 - rng.random::<f64>();
        t += -u.ln() / rate;
        if t >= duration_s {
            break;
        }
        let prefix = rng.random_range(0..prefixes);
        let turns = rng.random_range(1..=3u64);
        let steps = (0..turns)
            .map(|turn| {
                let mut segments = Vec::new();
                if turn == 0 {
                    segments.push(Segment::seeded(key(&[61, seed, prefix]), prefix_len));
                }
                segments.push(Segment::seeded(key(&[62, seed, i, turn]), question));
                Step {
                    gap: if turn == 0 {
                        Duration::ZERO
                    } else {
                        Duration::from_millis(rng.random_range(500..2000))
                    },
                    history: turn > 0,
                    segments,
                    max_tokens: answer,
                    kind: StepKind::Turn,
                }
            })
            .collect();
        sessions.push(Session {
            start: Start::At(secs_f(t)),
            steps,
        });
    }
    Workload {
        name: NAME.into(),
        description: format!(
            "{prefixes} shared {prefix_len}-token prefixes, conversations of 1–3 turns arriving at \
             {rate}/s for {duration_s} s on {engines} engines; a cold engine joins at {:.0} % of the run",
            JOIN_FRACTION * 100.0
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: None,
        offered_rate: None,
        request_timeout: Duration::from_secs(60),
        fleet: FleetShape {
            engines,
            prefill: 0,
            decode: 0,
            // Every prefix twice over: capacity is not what the newcomer lacks.
            num_gpu_blocks: (prefixes as usize * prefix_len * 2).div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: prefix_len + 3 * (question + answer as usize) + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 2048,
    }
}

/// When the newcomer joins and how the run is windowed (model seconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScaleOutShape {
    pub join_at_s: f64,
    pub window_s: f64,
}

/// The scale-out schedule of `w`, if it is a scale-out workload.
pub fn shape_of(w: &Workload) -> Option<ScaleOutShape> {
    if w.name != NAME {
        return None;
    }
    let span = w
        .sessions
        .iter()
        .filter_map(|s| match s.start {
            Start::At(t) => Some(t.as_secs_f64()),
            Start::After { .. } => None,
        })
        .fold(0.0f64, f64::max)
        .ceil()
        .max(1.0);
    Some(ScaleOutShape {
        join_at_s: span * JOIN_FRACTION,
        window_s: span / WINDOWS,
    })
}

/// One request for the window tables: when it was sent, its TTFT, whether the newcomer ran it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Model seconds since the run started.
    pub sent_s: f64,
    pub ttft_s: f64,
    pub on_new: bool,
}

/// One window after the join.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowRow {
    /// Model seconds after the newcomer became routable.
    pub start_s: f64,
    pub new_requests: usize,
    pub new_ttft_p50_s: Option<f64>,
    pub new_ttft_mean_s: Option<f64>,
    pub fleet_requests: usize,
    pub fleet_ttft_p50_s: Option<f64>,
    pub fleet_ttft_mean_s: Option<f64>,
    /// The newcomer's counters over the window (blocks of 16 tokens): prompt KV it computed,
    /// found in its own cache, and pulled from peers. `None` when a scrape failed.
    pub computed_blocks: Option<f64>,
    pub hit_blocks: Option<f64>,
    pub pulled_blocks: Option<f64>,
}

/// Cuts the requests sent from `join_s` on into windows of `window_s` (model s).
pub fn windows(samples: &[Sample], join_s: f64, window_s: f64) -> Vec<WindowRow> {
    if window_s.is_nan() || window_s <= 0.0 {
        return Vec::new();
    }
    let last = samples
        .iter()
        .filter(|s| s.sent_s >= join_s)
        .map(|s| s.sent_s)
        .fold(f64::NAN, f64::max);
    if !last.is_finite() {
        return Vec::new();
    }
    let n = ((last - join_s) / window_s).floor() as usize + 1;
    (0..n)
        .map(|k| {
            let lo = join_s + k as f64 * window_s;
            let hi = lo + window_s;
            let pick = |new: bool| -> Vec<f64> {
                samples
                    .iter()
                    .filter(|s| s.on_new == new && s.sent_s >= lo && s.sent_s < hi)
                    .map(|s| s.ttft_s)
                    .collect()
            };
            let (mine, rest) = (pick(true), pick(false));
            let lm = Latency::from_secs(mine.iter().copied());
            let lr = Latency::from_secs(rest.iter().copied());
            WindowRow {
                start_s: k as f64 * window_s,
                new_requests: mine.len(),
                new_ttft_p50_s: (!mine.is_empty()).then_some(lm.p50),
                new_ttft_mean_s: (!mine.is_empty()).then_some(lm.mean),
                fleet_requests: rest.len(),
                fleet_ttft_p50_s: (!rest.is_empty()).then_some(lr.p50),
                fleet_ttft_mean_s: (!rest.is_empty()).then_some(lr.mean),
                ..Default::default()
            }
        })
        .collect()
}

/// Whether a window has enough requests on both sides to judge, and if so whether the newcomer's
/// mean TTFT kept up with the rest's ([`TOLERANCE`] or [`SLACK_S`]).
fn keeps_up(r: &WindowRow) -> Option<bool> {
    if r.new_requests < MIN_REQUESTS || r.fleet_requests < MIN_REQUESTS {
        return None;
    }
    let (mine, fleet) = (r.new_ttft_mean_s?, r.fleet_ttft_mean_s?);
    Some(mine <= (fleet * TOLERANCE).max(fleet + SLACK_S))
}

/// The first window from which the newcomer keeps up in [`SUSTAIN`] consecutive judged windows
/// (windows without enough requests are skipped, neither confirming nor breaking; at the end of
/// the run fewer judged windows suffice if all of them keep up). `None` = not within the run.
fn warm_up_window(rows: &[WindowRow]) -> Option<usize> {
    let judged: Vec<(usize, bool)> = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| keeps_up(r).map(|k| (i, k)))
        .collect();
    (0..judged.len()).find_map(|j| {
        let run = &judged[j..(j + SUSTAIN).min(judged.len())];
        run.iter().all(|&(_, k)| k).then_some(judged[j].0)
    })
}

/// What the warm-up cost the newcomer's requests: over the windows after the join, the
/// newcomer's requests × how much its mean TTFT exceeded the rest's (model s; windows where it
/// was faster count 0, windows without requests on either side are skipped). Two arms that warm
/// up in the same number of windows can differ here: a pulled prefix costs its requests less
/// than a recomputed one.
fn excess_ttft_s(rows: &[WindowRow]) -> f64 {
    rows.iter()
        .filter_map(|r| {
            let gap = r.new_ttft_mean_s? - r.fleet_ttft_mean_s?;
            Some(r.new_requests as f64 * gap.max(0.0))
        })
        .sum()
}

/// What happened to the newcomer in one arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ScaleOutResult {
    pub engines_before: usize,
    pub new_engine: String,
    /// Model s after the run started: when the newcomer was started, and when the router's
    /// config named it (it was healthy by then).
    pub started_at_s: f64,
    pub routable_at_s: f64,
    /// Wall seconds from process start to a healthy `/health` (not modelled time).
    pub startup_wall_s: f64,
    pub window_s: f64,
    pub rows: Vec<WindowRow>,
    /// Start of the first window (model s after routable) from which it kept up.
    pub warm_up_s: Option<f64>,
    /// [`excess_ttft_s`] over the run.
    #[serde(default)]
    pub excess_ttft_s: f64,
    /// Requests the newcomer ran, and its counters over the whole run (tokens).
    pub new_requests: usize,
    pub new_computed_tokens: f64,
    pub new_hit_tokens: f64,
    pub new_pulled_tokens: f64,
    /// Requests without a decision record (not attributable to an engine).
    pub unattributed: usize,
    /// Why the join did not happen or was incomplete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What [`join_one`] saw, in wall seconds from the start of the drive.
#[derive(Debug, Clone, Default)]
pub struct JoinLog {
    pub engine: Option<(String, String)>,
    pub started_wall_s: f64,
    pub ready_wall_s: f64,
    pub routable_wall_s: f64,
    /// Scrapes of the newcomer at the window boundaries after it became routable.
    pub scrapes: Vec<Option<EngineEvidence>>,
    pub error: Option<String>,
}

/// Starts one more engine like the fleet's first group at the shape's join time, tells the
/// router, then scrapes the newcomer at every window boundary until `done` turns true.
#[allow(clippy::too_many_arguments)]
pub async fn join_one(
    fleet: &mut Fleet,
    spec: &FleetSpec,
    exe: &Path,
    shape: ScaleOutShape,
    time_scale: f64,
    start: Instant,
    mut done: watch::Receiver<bool>,
    pb: Option<ProgressBar>,
) -> JoinLog {
    let ts = crate::stats::usable_time_scale(time_scale);
    let mut log = JoinLog::default();
    let at = start + Duration::from_secs_f64(shape.join_at_s / ts);
    tokio::select! {
        _ = tokio::time::sleep_until(at.into()) => {}
        _ = done.wait_for(|d| *d) => {
            log.error = Some("the run ended before the join time".into());
            return log;
        }
    }
    let Some(group) = spec.engines.first() else {
        log.error = Some("the fleet has no engine group to copy".into());
        return log;
    };
    let group = crate::fleet::EngineGroup {
        count: 1,
        ..group.clone()
    };
    log.started_wall_s = start.elapsed().as_secs_f64();
    let ready = Duration::from_secs_f64(spec.ready_timeout_s.unwrap_or(60.0));
    let idx = match fleet.add_engine(exe, &group, ready).await {
        Ok(i) => i,
        Err(e) => {
            log.error = Some(format!("starting the new engine: {e}"));
            return log;
        }
    };
    log.ready_wall_s = start.elapsed().as_secs_f64();
    if let Err(e) = fleet.publish_endpoints(spec) {
        log.error = Some(format!("telling the router: {e}"));
        return log;
    }
    log.routable_wall_s = start.elapsed().as_secs_f64();
    let (name, url) = match fleet.engines.get(idx) {
        Some(e) => (e.name.clone(), e.url.clone()),
        None => return log,
    };
    if let Some(pb) = &pb {
        pb.set_message(format!(
            "{name} joined at {:.1} s",
            log.routable_wall_s * ts
        ));
    }
    log.engine = Some((name, url.clone()));
    let http = reqwest::Client::new();
    let window = Duration::from_secs_f64(shape.window_s / ts);
    let routable = start + Duration::from_secs_f64(log.routable_wall_s);
    for k in 0u32.. {
        // Boundary k is the start of window k; the last scrape closes the last window.
        let finished = *done.borrow();
        log.scrapes.push(
            crate::fleet::scrape(&http, &url)
                .await
                .ok()
                .map(|t| EngineEvidence::from_exposition(&url, &t)),
        );
        if finished {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep_until((routable + window * (k + 1)).into()) => {}
            _ = done.wait_for(|d| *d) => {}
        }
    }
    log
}

/// request id → the endpoint the router chose, from `/debug/decisions`.
fn endpoints_by_request(decisions: &str) -> std::collections::HashMap<String, String> {
    let parsed: Vec<Value> = serde_json::from_str(decisions).unwrap_or_default();
    parsed
        .iter()
        .filter_map(|d| {
            Some((
                d.get("request_id")?.as_str()?.to_owned(),
                d.get("endpoint")?.as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// Joins the run's records with the router's decisions and the newcomer's scrapes.
pub fn analyse(
    records: &[RequestRecord],
    decisions: &str,
    seed: u64,
    time_scale: f64,
    shape: ScaleOutShape,
    engines_before: usize,
    join: &JoinLog,
) -> ScaleOutResult {
    let ts = crate::stats::usable_time_scale(time_scale);
    let mut out = ScaleOutResult {
        engines_before,
        started_at_s: join.started_wall_s * ts,
        routable_at_s: join.routable_wall_s * ts,
        startup_wall_s: join.ready_wall_s - join.started_wall_s,
        window_s: shape.window_s,
        error: join.error.clone(),
        ..Default::default()
    };
    let Some((name, _)) = &join.engine else {
        return out;
    };
    out.new_engine = name.clone();
    let by_id = endpoints_by_request(decisions);
    let mut samples = Vec::new();
    for r in records.iter().filter(|r| r.outcome == Outcome::Ok) {
        let Some(ttft) = r.ttft_s else { continue };
        let Some(ep) = by_id.get(&driver::request_id(seed, r.session, r.step)) else {
            out.unattributed += 1;
            continue;
        };
        samples.push(Sample {
            sent_s: r.sent_s * ts,
            ttft_s: ttft * ts,
            on_new: ep == name,
        });
    }
    out.new_requests = samples.iter().filter(|s| s.on_new).count();
    out.rows = windows(&samples, out.routable_at_s, shape.window_s);
    let block = GPU_BLOCK_TOKENS as f64;
    for (k, row) in out.rows.iter_mut().enumerate() {
        if let (Some(Some(a)), Some(Some(b))) = (join.scrapes.get(k), join.scrapes.get(k + 1)) {
            let d = b.since(a);
            row.computed_blocks = Some(d.source_tokens("local_compute") / block);
            row.hit_blocks = Some(d.source_tokens("local_cache_hit") / block);
            row.pulled_blocks = Some(d.source_tokens("external_kv_transfer") / block);
        }
    }
    if let Some(last) = join.scrapes.iter().rev().flatten().next() {
        out.new_computed_tokens = last.source_tokens("local_compute");
        out.new_hit_tokens = last.source_tokens("local_cache_hit");
        out.new_pulled_tokens = last.source_tokens("external_kv_transfer");
    }
    out.warm_up_s = warm_up_window(&out.rows).and_then(|i| out.rows.get(i).map(|r| r.start_s));
    out.excess_ttft_s = excess_ttft_s(&out.rows);
    out
}

fn ms(v: Option<f64>) -> String {
    v.map(|s| format!("{:.0}", s * 1000.0))
        .unwrap_or_else(|| "–".into())
}

fn blocks(v: Option<f64>) -> String {
    v.map(|b| format!("{b:.0}")).unwrap_or_else(|| "?".into())
}

/// The scale-out section of a report: one summary row per arm, then each arm's windows.
pub fn markdown(arms: &[(&str, &ScaleOutResult)]) -> String {
    let Some((_, first)) = arms.first() else {
        return String::new();
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n**Scale-out warm-up** — the newcomer joins a fleet of {} at {:.1} s; windows of {:.1} s \
         (model time). Warm = its window mean TTFT ≤ max({TOLERANCE} × the rest's mean, rest + {:.0} ms) \
         in {SUSTAIN} consecutive windows with ≥ {MIN_REQUESTS} requests on each side; the warm-up \
         time is the start of the first such window after the join (resolution: one window). \
         Requests are attributed to engines by the router's decision log; blocks (16 tokens) are \
         the newcomer's own `vllm:prompt_tokens_by_source_total` deltas.\n",
        first.engines_before,
        first.routable_at_s,
        first.window_s,
        SLACK_S * 1000.0
    );
    s.push_str("| arm | warm-up | newcomer requests | newcomer TTFT p50 / mean, first window → last | excess TTFT: Σ requests × (its mean − rest's mean) | its computed / locally hit / pulled blocks (whole run) | notes |\n|---|---|---|---|---|---|---|\n");
    for (r, so) in arms {
        let first = so.rows.first();
        let last = so.rows.iter().rev().find(|w| w.new_requests > 0);
        let pm = |w: Option<&WindowRow>| {
            format!(
                "{} / {}",
                ms(w.and_then(|w| w.new_ttft_p50_s)),
                ms(w.and_then(|w| w.new_ttft_mean_s))
            )
        };
        let mut notes = Vec::new();
        if let Some(e) = &so.error {
            notes.push(e.clone());
        }
        if so.unattributed > 0 {
            notes.push(format!("{} requests without a decision", so.unattributed));
        }
        notes.push(format!(
            "routable at {:.1} s, {:.1} s wall to start",
            so.routable_at_s, so.startup_wall_s
        ));
        let b = GPU_BLOCK_TOKENS as f64;
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} → {} ms | {:.2} s | {:.0} / {:.0} / {:.0} | {} |",
            r,
            so.warm_up_s
                .map(|w| format!("{w:.1} s"))
                .unwrap_or_else(|| "not within the run".into()),
            so.new_requests,
            pm(first),
            pm(last),
            so.excess_ttft_s,
            so.new_computed_tokens / b,
            so.new_hit_tokens / b,
            so.new_pulled_tokens / b,
            notes.join("; ")
        );
    }
    for (r, so) in arms {
        let _ = writeln!(
            s,
            "\n`{}` per window (s after the join; TTFT in ms):\n\n| window | newcomer req | newcomer p50 / mean | rest req | rest p50 / mean | newcomer's computed / hit / pulled blocks | keeps up |\n|---|---|---|---|---|---|---|",
            r
        );
        for w in &so.rows {
            let _ = writeln!(
                s,
                "| {:.0}–{:.0} | {} | {} / {} | {} | {} / {} | {} / {} / {} | {} |",
                w.start_s,
                w.start_s + so.window_s,
                w.new_requests,
                ms(w.new_ttft_p50_s),
                ms(w.new_ttft_mean_s),
                w.fleet_requests,
                ms(w.fleet_ttft_p50_s),
                ms(w.fleet_ttft_mean_s),
                blocks(w.computed_blocks),
                blocks(w.hit_blocks),
                blocks(w.pulled_blocks),
                match keeps_up(w) {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "–",
                }
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A window by (requests, mean TTFT) on the newcomer and on the rest; the p50s are set
    /// apart from the means to show they are not what is judged.
    fn row(new: (usize, f64), fleet: (usize, f64)) -> WindowRow {
        WindowRow {
            new_requests: new.0,
            new_ttft_p50_s: Some(0.001),
            new_ttft_mean_s: Some(new.1),
            fleet_requests: fleet.0,
            fleet_ttft_p50_s: Some(1.0),
            fleet_ttft_mean_s: Some(fleet.1),
            ..Default::default()
        }
    }

    #[test]
    fn warm_up_is_the_first_window_that_keeps_up_and_stays_up() {
        let rows = vec![
            row((5, 0.25), (20, 0.03)), // cold: recomputes
            row((5, 0.03), (20, 0.03)), // one good window...
            row((5, 0.20), (20, 0.03)), // ...not sustained
            row((5, 0.035), (20, 0.03)),
            row((1, 0.90), (20, 0.03)), // too few to judge: skipped
            row((6, 0.04), (20, 0.03)), // within the 10 ms slack
        ];
        assert_eq!(warm_up_window(&rows), Some(3));
        // Never keeps up.
        let cold = vec![row((5, 0.3), (20, 0.03)); 4];
        assert_eq!(warm_up_window(&cold), None);
        // Keeps up from the start; the last judged window alone suffices at the end of a run.
        assert_eq!(warm_up_window(&[row((3, 0.02), (3, 0.02))]), Some(0));
        assert_eq!(
            warm_up_window(&[row((3, 0.5), (3, 0.02)), row((3, 0.02), (3, 0.02))]),
            Some(1)
        );
        // Excess TTFT = Σ requests × (mean gap); windows at par add 0, unjudged ones still count.
        assert!(
            (excess_ttft_s(&rows) - (5.0 * 0.22 + 5.0 * 0.17 + 5.0 * 0.005 + 0.87 + 6.0 * 0.01))
                .abs()
                < 1e-9
        );
        // Relative tolerance for slow fleets: 1.15 s against 1.0 s keeps up, 1.3 s does not.
        assert_eq!(keeps_up(&row((3, 1.15), (3, 1.0))), Some(true));
        assert_eq!(keeps_up(&row((3, 1.3), (3, 1.0))), Some(false));
    }

    #[test]
    fn windows_split_requests_after_the_join_by_engine() {
        let s = |sent_s, ttft_s, on_new| Sample {
            sent_s,
            ttft_s,
            on_new,
        };
        let samples = [
            s(1.0, 0.5, false), // before the join: ignored
            s(10.5, 0.30, true),
            s(11.0, 0.10, true),
            s(12.0, 0.02, false),
            s(14.5, 0.03, true),
        ];
        let rows = windows(&samples, 10.0, 4.0);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].new_requests, rows[0].fleet_requests), (2, 1));
        assert_eq!(rows[0].start_s, 0.0);
        assert_eq!(rows[1].start_s, 4.0);
        // hdrhistogram keeps 3 significant digits.
        assert!((rows[1].new_ttft_p50_s.unwrap() - 0.03).abs() < 1e-4);
        assert_eq!(rows[1].fleet_ttft_p50_s, None);
        assert!(windows(&samples, 100.0, 4.0).is_empty());
        assert!(windows(&samples, 0.0, 0.0).is_empty());
    }

    #[test]
    fn the_workload_names_its_join_and_windows() {
        let w = scaleout(Scale::Quick, 1);
        let shape = shape_of(&w).unwrap();
        assert!((shape.join_at_s - 14.4).abs() < 1e-9, "{shape:?}");
        assert!((shape.window_s - 4.0).abs() < 1e-9);
        assert!(shape_of(&crate::workload::docqa(Scale::Quick, 1)).is_none());
        assert_eq!(w.fleet.engines, 3);
        // Loaded, but within the router's decision log (2,048 records) at both scales.
        assert!(
            (150..2048).contains(&w.num_requests()),
            "{}",
            w.num_requests()
        );
        assert!(scaleout(Scale::Full, 1).num_requests() < 2048);
        // Same seed, same workload.
        assert_eq!(scaleout(Scale::Quick, 1).sessions, w.sessions);
    }

    #[test]
    fn analysis_attributes_requests_and_reads_the_newcomers_counters() {
        let rec = |session, sent_s, ttft| RequestRecord {
            session,
            step: 0,
            kind: StepKind::Turn,
            prompt_tokens: 8320,
            novel_tokens: None,
            sent_s,
            ttft_s: Some(ttft),
            e2e_s: ttft + 0.1,
            output_tokens: 48,
            cached_tokens: None,
            outcome: Outcome::Ok,
        };
        let records = [rec(0, 10.5, 0.3), rec(1, 10.6, 0.02), rec(2, 10.7, 0.02)];
        let decisions = serde_json::json!([
            {"request_id": driver::request_id(1, 0, 0), "endpoint": "engine-3-both"},
            {"request_id": driver::request_id(1, 1, 0), "endpoint": "engine-0-both"},
        ])
        .to_string();
        let scrape = |computed: u32, pulled: u32| {
            Some(EngineEvidence::from_exposition(
                "u",
                &format!(
                    "vllm:prompt_tokens_by_source_total{{source=\"local_compute\"}} {computed}\n\
                     vllm:prompt_tokens_by_source_total{{source=\"external_kv_transfer\"}} {pulled}\n"
                ),
            ))
        };
        let join = JoinLog {
            engine: Some(("engine-3-both".into(), "u".into())),
            started_wall_s: 9.0,
            ready_wall_s: 9.5,
            routable_wall_s: 10.0,
            scrapes: vec![scrape(0, 0), scrape(160, 8192)],
            error: None,
        };
        let shape = ScaleOutShape {
            join_at_s: 9.0,
            window_s: 4.0,
        };
        let r = analyse(&records, &decisions, 1, 1.0, shape, 3, &join);
        assert_eq!(r.unattributed, 1);
        assert_eq!(r.new_requests, 1);
        assert_eq!(r.rows.len(), 1);
        assert_eq!(r.rows[0].computed_blocks, Some(10.0));
        assert_eq!(r.rows[0].pulled_blocks, Some(512.0));
        assert_eq!(r.new_pulled_tokens, 8192.0);
        assert_eq!(r.startup_wall_s, 0.5);
    }
}
