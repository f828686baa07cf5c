//! The restart experiments (issue 19: restart recovery). A replacement comes back at its
//! predecessor's address (a pod restarting behind its Service), so a router with a fixed worker
//! list — a peer's — finds it too; kvmesh's router sees the killed process refuse connections,
//! drops its index entries and keeps the survivors'.
//!
//! - `restart`: agentic P/D conversations, and midway every prefill engine is killed and
//!   replaced (new process, same ports, empty caches — a Kubernetes pod restart). `pd` /
//!   `pd-load` recompute each conversation's history on its next prefill (a synchronized storm
//!   right after the restart); `pd-bidir` / `pd-load-bidir` read it from the decoder that holds
//!   it. Read from the new prefillers' counters (which start at zero with them).
//! - `restart-agg`: the `agentic` sessions on an aggregated fleet, and midway half the engines
//!   are replaced. A session whose owner died has its history only where a pull or prefetch
//!   copied it before: with P2P the router finds those surviving copies, without it every such
//!   session recomputes. Read from every engine's counters since the restart.
//!
//! Measured: TTFT of returning turns in windows before and after the restart, the time until it
//! is back to steady state, and what the fleet computed vs read from peers after it.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::driver::RequestRecord;
use crate::fleet::{Fleet, FleetSpec};
use crate::launch::Role;
use crate::metrics::EngineEvidence;
use crate::stats::{Latency, fmt_ms};
use crate::workload::{Scale, StepKind, Workload, agentic_pd};

pub const NAME: &str = "restart";
/// The aggregated variant.
pub const NAME_AGG: &str = "restart-agg";

/// When the restart happens and how the timeline is cut (model seconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RestartShape {
    pub restart_at_s: f64,
    pub window_s: f64,
}

/// Agentic P/D conversations (as `agentic-pd`) with the prefill fleet restarted midway.
pub fn restart(scale: Scale, seed: u64) -> Workload {
    let mut w = agentic_pd(scale, seed);
    w.name = NAME.into();
    let shape = shape(scale);
    w.description = format!(
        "{}; every prefill engine restarted (new process, empty caches) at {} s",
        w.description, shape.restart_at_s
    );
    w
}

/// The `agentic` sessions (tool gaps and all) on an aggregated fleet with half the engines
/// restarted midway.
pub fn restart_agg(scale: Scale, seed: u64) -> Workload {
    let mut w = crate::agentic::agentic(scale, seed, crate::agentic::gaps(scale));
    w.name = NAME_AGG.into();
    let shape = shape(scale);
    w.description = format!(
        "{}; half the engines restarted (new processes, empty caches) at {} s",
        w.description, shape.restart_at_s
    );
    w
}

fn shape(scale: Scale) -> RestartShape {
    match scale {
        Scale::Quick => RestartShape {
            restart_at_s: 8.0,
            window_s: 2.0,
        },
        Scale::Full => RestartShape {
            restart_at_s: 60.0,
            window_s: 10.0,
        },
    }
}

/// The restart schedule of `w` run at `scale` (`quick` / `full`), if it is this experiment.
pub fn shape_of(w: &Workload, scale: &str) -> Option<RestartShape> {
    let scale: Scale = scale.parse().ok()?;
    (w.name == NAME || w.name == NAME_AGG).then(|| shape(scale))
}

/// Whether `w` restarts aggregated engines (`restart-agg`) rather than a prefill fleet.
pub fn is_aggregated(w: &Workload) -> bool {
    w.name == NAME_AGG
}

/// The engines a restart replaces: every prefill engine of a P/D fleet, else the first half of
/// the aggregated engines (at least one).
fn engines_to_replace(roles: &[Role]) -> Vec<usize> {
    let prefill: Vec<usize> = (0..roles.len())
        .filter(|&i| roles[i] == Role::Prefill)
        .collect();
    if !prefill.is_empty() {
        return prefill;
    }
    let both: Vec<usize> = (0..roles.len())
        .filter(|&i| roles[i] == Role::Both)
        .collect();
    let half = both.len().div_ceil(2);
    both.into_iter().take(half).collect()
}

/// What the restart task saw (wall seconds from the start of the drive).
#[derive(Debug, Clone, Default)]
pub struct RestartLog {
    pub restarted: Vec<String>,
    pub killed_wall_s: f64,
    pub routable_wall_s: f64,
    pub error: Option<String>,
    /// The surviving engines' counters just before the kill (aggregated restarts read the
    /// fleet's work after the restart as the difference; replacements count from zero).
    pub before: Option<crate::metrics::Evidence>,
}

/// At the shape's time, replaces the engines [`engines_to_replace`] names and tells the router.
pub async fn restart_engines(
    fleet: &mut Fleet,
    spec: &FleetSpec,
    exe: &Path,
    shape: RestartShape,
    time_scale: f64,
    start: Instant,
    mut done: watch::Receiver<bool>,
) -> RestartLog {
    let ts = crate::stats::usable_time_scale(time_scale);
    let mut log = RestartLog::default();
    let at = start + Duration::from_secs_f64(shape.restart_at_s / ts);
    tokio::select! {
        _ = tokio::time::sleep_until(at.into()) => {}
        _ = done.wait_for(|d| *d) => {
            log.error = Some("the run ended before the restart".into());
            return log;
        }
    }
    let roles: Vec<Role> = fleet.engines.iter().map(|e| e.role).collect();
    let replace = engines_to_replace(&roles);
    let Some(role) = replace.first().map(|&i| roles[i]) else {
        log.error = Some("the fleet has no engine to restart".into());
        return log;
    };
    let Some(group) = spec.engines.iter().find(|g| g.role == role) else {
        log.error = Some(format!("the fleet spec has no {} engines", role.as_str()));
        return log;
    };
    let ready = Duration::from_secs_f64(spec.ready_timeout_s.unwrap_or(60.0));
    let before = scrape_fleet(fleet).await;
    // The replacements count from zero at the same address: their predecessors' counters are
    // left out of `before`, or the work after the restart would be diffed against them.
    let replaced_urls: Vec<String> = replace
        .iter()
        .map(|&i| fleet.engines[i].url.clone())
        .collect();
    log.before = Some(before.without(&replaced_urls));
    log.killed_wall_s = start.elapsed().as_secs_f64();
    let mut moved = false;
    for i in replace {
        match fleet.replace_engine(i, exe, group, ready).await {
            Ok(m) => {
                moved |= m;
                log.restarted.push(fleet.engines[i].name.clone());
            }
            Err(e) => {
                log.error = Some(format!("replacing {}: {e}", fleet.engines[i].name));
                return log;
            }
        }
    }
    // Only when a port was taken meanwhile and a replacement came back elsewhere.
    if moved && let Err(e) = fleet.publish_endpoints(spec) {
        log.error = Some(format!("telling the router: {e}"));
        return log;
    }
    log.routable_wall_s = start.elapsed().as_secs_f64();
    log
}

/// Every engine's counters now (an engine that does not answer counts as all zero and is named
/// in the evidence's scrape errors).
async fn scrape_fleet(fleet: &Fleet) -> crate::metrics::Evidence {
    let http = reqwest::Client::new();
    let mut engines = Vec::new();
    let mut errors = Vec::new();
    for e in &fleet.engines {
        match crate::fleet::scrape(&http, &e.url).await {
            Ok(text) => engines.push(EngineEvidence::from_exposition(&e.url, &text)),
            Err(err) => {
                errors.push(format!("{}: {err}", e.url));
                engines.push(EngineEvidence {
                    url: e.url.clone(),
                    ..Default::default()
                });
            }
        }
    }
    crate::metrics::Evidence::from_engines(engines, errors)
}

/// One window of the timeline (model seconds relative to the restart).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub from_s: f64,
    pub turns: u64,
    pub ttft: Latency,
}

/// The experiment's result for one arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RestartResult {
    pub shape: Option<RestartShape>,
    /// Returning turns sent before the restart: the steady state.
    pub before: Option<Latency>,
    pub windows: Vec<Window>,
    /// Model seconds after the restart until a window's TTFT p90 is within 1.5x the steady
    /// state's again (and stays there for the next window); None if it never is.
    pub recovered_after_s: Option<f64>,
    /// After the restart: prompt tokens computed, and history tokens read from peers. P/D: the
    /// new prefillers' counters (they start with them), history read from decoders. Aggregated:
    /// every engine's counters since the restart, external-hit tokens.
    pub computed_after: f64,
    pub history_read_after: f64,
    /// An aggregated fleet's restart (`restart-agg`).
    #[serde(default)]
    pub aggregated: bool,
    pub restarted: Vec<String>,
    pub error: Option<String>,
}

/// The window index from which TTFT p90 is back within `factor` × `steady` for good (this and
/// every later window with turns in it).
fn recovered_from(windows: &[Window], steady_p90: f64, factor: f64) -> Option<usize> {
    let ok = |w: &Window| w.turns == 0 || w.ttft.p90 <= steady_p90 * factor;
    (0..windows.len()).find(|&i| windows[i].turns > 0 && windows[i..].iter().all(ok))
}

/// What the engines did after the restart, as [`analyse`] reads it.
pub enum AfterRestart<'a> {
    /// The new prefillers' counters (P/D): history read from decoders.
    Prefillers(&'a [&'a EngineEvidence]),
    /// Every engine's counters since the restart (aggregated): history read = external hits.
    Fleet(&'a [EngineEvidence]),
}

/// Cuts the returning turns into windows around the restart and reads the engines' counters.
pub fn analyse(
    records: &[RequestRecord],
    time_scale: f64,
    shape: RestartShape,
    log: &RestartLog,
    after: AfterRestart<'_>,
) -> RestartResult {
    let ts = crate::stats::usable_time_scale(time_scale);
    let restart_s = log.killed_wall_s * ts;
    let turns: Vec<(f64, f64)> = records
        .iter()
        .filter(|r| r.kind == StepKind::Turn && r.step > 0)
        .filter_map(|r| Some((r.sent_s * ts - restart_s, r.ttft_s? * ts)))
        .collect();
    let before = Latency::from_secs(turns.iter().filter(|t| t.0 < 0.0).map(|t| t.1));
    let last = turns.iter().map(|t| t.0).fold(0.0_f64, f64::max);
    let n = (last / shape.window_s).floor().max(0.0) as usize + 1;
    let windows: Vec<Window> = (0..n)
        .map(|k| {
            let from = k as f64 * shape.window_s;
            let inside: Vec<f64> = turns
                .iter()
                .filter(|t| t.0 >= from && t.0 < from + shape.window_s)
                .map(|t| t.1)
                .collect();
            Window {
                from_s: from,
                turns: inside.len() as u64,
                ttft: Latency::from_secs(inside),
            }
        })
        .collect();
    let recovered_after_s = (before.count > 0)
        .then(|| recovered_from(&windows, before.p90, 1.5))
        .flatten()
        .map(|k| windows[k].from_s);
    // Folds from 0.0: an empty `f64` sum is -0.0, which tables print as "-0".
    let computed = |evs: &mut dyn Iterator<Item = &EngineEvidence>| {
        evs.fold(0.0, |acc, e| acc + e.source_tokens("local_compute"))
    };
    let (computed_after, history_read_after, aggregated) = match after {
        AfterRestart::Prefillers(evs) => (
            computed(&mut evs.iter().copied()),
            evs.iter().fold(0.0, |acc, e| {
                acc + e
                    .pd
                    .iter()
                    .filter(|(k, _)| {
                        k.starts_with("kvmesh_engine_pd_remote_read_tokens")
                            && k.contains("history")
                    })
                    .fold(0.0, |a, (_, v)| a + v)
            }),
            false,
        ),
        AfterRestart::Fleet(evs) => (
            computed(&mut evs.iter()),
            evs.iter().fold(0.0, |acc, e| acc + e.external_hit_tokens),
            true,
        ),
    };
    RestartResult {
        shape: Some(shape),
        before: Some(before),
        windows,
        recovered_after_s,
        computed_after,
        history_read_after,
        aggregated,
        restarted: log.restarted.clone(),
        error: log.error.clone(),
    }
}

/// The restart table: one row per arm, then each arm's windows.
pub fn markdown(rows: &[(&str, &RestartResult)]) -> String {
    let mut s = String::new();
    if rows.is_empty() {
        return s;
    }
    let aggregated = rows.iter().any(|(_, r)| r.aggregated);
    if aggregated {
        s.push_str("\n**restart: half the engines replaced mid-run**\n\n");
        s.push_str("| arm | returning-turn TTFT p90 before | first window after: p50 / p90 | back within 1.5x after | fleet after the restart: computed / read from peers (tokens) |\n");
    } else {
        s.push_str("\n**restart: the prefill fleet replaced mid-run**\n\n");
        s.push_str("| arm | returning-turn TTFT p90 before | first window after: p50 / p90 | back within 1.5x after | new prefillers: computed / history read from decoders (tokens) |\n");
    }
    s.push_str("|---|---|---|---|---|\n");
    for (arm, r) in rows {
        let first = r.windows.first();
        let _ = writeln!(
            s,
            "| {arm} | {} | {} | {} | {:.0} / {:.0}{} |",
            r.before.as_ref().map_or("—".into(), |b| fmt_ms(b.p90)),
            first.map_or("—".into(), |w| format!(
                "{} / {}",
                fmt_ms(w.ttft.p50),
                fmt_ms(w.ttft.p90)
            )),
            r.recovered_after_s
                .map_or("never".into(), |t| format!("{t:.0} s")),
            r.computed_after,
            r.history_read_after,
            r.error
                .as_ref()
                .map_or(String::new(), |e| format!(" (error: {e})")),
        );
    }
    for (arm, r) in rows {
        let _ = write!(
            s,
            "\n`{arm}` returning-turn TTFT p90 by window after the restart:"
        );
        for w in &r.windows {
            let _ = write!(s, " +{:.0}s {} ({})", w.from_s, fmt_ms(w.ttft.p90), w.turns);
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Outcome;

    fn record(step: usize, sent_s: f64, ttft_s: f64) -> RequestRecord {
        RequestRecord {
            session: 0,
            step,
            kind: StepKind::Turn,
            prompt_tokens: 1000,
            novel_tokens: None,
            sent_s,
            ttft_s: Some(ttft_s),
            e2e_s: ttft_s,
            output_tokens: 1,
            cached_tokens: None,
            outcome: Outcome::Ok,
        }
    }

    #[test]
    fn recovery_is_the_first_window_that_stays_near_the_steady_state() {
        let shape = RestartShape {
            restart_at_s: 10.0,
            window_s: 2.0,
        };
        let log = RestartLog {
            killed_wall_s: 10.0,
            ..RestartLog::default()
        };
        let mut records = vec![record(0, 0.0, 5.0)]; // first turns never count
        for t in 0..10 {
            records.push(record(1, t as f64, 0.1)); // steady: 100 ms
        }
        // Storm in the first two windows after the restart, a relapse in the third, then fine.
        records.extend([
            record(1, 10.5, 2.0),
            record(1, 12.5, 1.0),
            record(1, 14.5, 0.12),
            record(1, 16.5, 0.9),
            record(1, 18.5, 0.11),
            record(1, 20.5, 0.1),
        ]);
        let r = analyse(&records, 1.0, shape, &log, AfterRestart::Prefillers(&[]));
        assert_eq!(r.before.as_ref().unwrap().count, 10);
        assert_eq!(r.windows.len(), 6);
        assert_eq!(r.windows[0].turns, 1);
        assert_eq!(r.recovered_after_s, Some(8.0), "{:?}", r.windows);
        let table = markdown(&[("pd", &r)]);
        assert!(table.contains("| pd | 100 ms | "), "{table}");
        assert!(table.contains(" | 8 s | 0 / 0 |"), "{table}");
    }

    #[test]
    fn the_workload_is_agentic_pd_with_a_restart() {
        let w = restart(Scale::Quick, 3);
        assert_eq!(w.name, NAME);
        assert!(w.fleet.prefill > 0);
        assert_eq!(shape_of(&w, "quick").map(|s| s.restart_at_s), Some(8.0));
        assert!(shape_of(&agentic_pd(Scale::Quick, 3), "quick").is_none());
    }

    #[test]
    fn the_aggregated_variant_restarts_half_the_fleet_and_reads_every_engine() {
        let w = restart_agg(Scale::Full, 3);
        assert_eq!(w.name, NAME_AGG);
        assert!(is_aggregated(&w) && !is_aggregated(&restart(Scale::Full, 3)));
        assert_eq!((w.fleet.prefill, w.fleet.decode), (0, 0));
        assert_eq!(shape_of(&w, "full").map(|s| s.restart_at_s), Some(60.0));
        let both = vec![Role::Both; 8];
        assert_eq!(engines_to_replace(&both), vec![0, 1, 2, 3]);
        assert_eq!(engines_to_replace(&[Role::Both]), vec![0]);
        let pd = [Role::Prefill, Role::Decode, Role::Prefill, Role::Decode];
        assert_eq!(engines_to_replace(&pd), vec![0, 2]);
        let ev = |computed: f64, pulled: f64| {
            let mut e = EngineEvidence {
                external_hit_tokens: pulled,
                ..Default::default()
            };
            e.prompt_tokens_by_source
                .insert("local_compute".into(), computed);
            e
        };
        let fleet = [ev(100.0, 0.0), ev(50.0, 400.0)];
        let log = RestartLog::default();
        let r = analyse(
            &[],
            1.0,
            shape(Scale::Quick),
            &log,
            AfterRestart::Fleet(&fleet),
        );
        assert_eq!((r.computed_after, r.history_read_after), (150.0, 400.0));
        assert!(r.aggregated);
        assert!(markdown(&[("ttft-p2p", &r)]).contains("read from peers"));
    }
}
