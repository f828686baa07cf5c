//! Results of a benchmark run: JSON, a Markdown table with baseline comparisons, and SVG plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

pub use crate::arm_result::ArmResult;
use crate::client::PromptFormat;
use crate::driver::RequestRecord;
use crate::metrics::Evidence;
use crate::stats::ArmStats;
use crate::workload::StepKind;

/// A whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchReport {
    pub command: String,
    pub scale: String,
    pub seed: u64,
    /// How prompts were sent (text or token ids), the same for every arm.
    #[serde(default)]
    pub prompt_format: PromptFormat,
    pub results: Vec<ArmResult>,
    /// Every arm against the control (the first arm), kept current by [`BenchReport::add_result`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paired: Vec<crate::repeat::PairedComparison>,
}

/// The flags an arm earns from its evidence and outcomes.
pub fn flags_for(
    pulls: bool,
    moves_otherwise: bool,
    stats: &ArmStats,
    ev: &Evidence,
) -> Vec<String> {
    let mut f = Vec::new();
    if pulls && !ev.moved_anything() {
        f.push(
            "MISCONFIGURED: P2P arm moved 0 bytes (check kvmesh_p2p_* counters, router p2p config)"
                .into(),
        );
    }
    if pulls && ev.moved_anything() && ev.external_hit_tokens <= 0.0 {
        f.push("UNVERIFIED: bytes moved but no vllm:external_prefix_cache_hits_total".into());
    }
    if !pulls && !moves_otherwise && ev.moved_anything() {
        f.push(format!(
            "UNEXPECTED: non-P2P arm moved {:.0} bytes",
            ev.p2p_bytes
        ));
    }
    if stats.failed > 0 {
        f.push(format!("{} requests failed", stats.failed));
    }
    if stats.timeouts > 0 {
        f.push(format!("{} client timeouts", stats.timeouts));
    }
    if !ev.scrape_errors.is_empty() {
        f.push(format!(
            "metrics unreadable on {} engine(s): evidence incomplete",
            ev.scrape_errors.len()
        ));
    }
    f
}

/// Flags of a P/D arm: `moves_history` arms (`pd-bidir`, `pd-load-bidir`) must have read
/// conversation history into prefill engines (verified twice: the engines' history-read counter
/// and the prefill engines' external hits); the controls (`pd`, `pd-load`) must have read none.
pub fn pd_flags(
    moves_history: bool,
    prefill_external_hit_tokens: f64,
    ev: &Evidence,
) -> Vec<String> {
    let mut f = Vec::new();
    if ev.pd_decode_tokens <= 0.0 {
        f.push("MISCONFIGURED: P/D arm read no prompt KV into decoders (kvmesh_engine_pd_remote_read_tokens_total{leg=decode} = 0)".into());
    }
    if moves_history && ev.pd_history_tokens <= 0.0 {
        f.push("MISCONFIGURED: bi-directional arm moved no history (kvmesh_engine_pd_remote_read_tokens_total{leg=history} = 0; conversation id sent? --bidirectional-kv-xfer on?)".into());
    }
    if moves_history && ev.pd_history_tokens > 0.0 && prefill_external_hit_tokens <= 0.0 {
        f.push("UNVERIFIED: history read but no external hits on prefill engines".into());
    }
    if !moves_history && ev.pd_history_tokens > 0.0 {
        f.push(format!(
            "UNEXPECTED: P/D arm without bi-directional transfer read {:.0} history tokens",
            ev.pd_history_tokens
        ));
    }
    f
}

fn secs(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.1} s")
    } else if v >= 1.0 {
        format!("{v:.2} s")
    } else {
        format!("{:.0} ms", v * 1000.0)
    }
}

fn bytes(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.2} GB", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.1} MB", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} kB", v / 1e3)
    } else {
        format!("{v:.0} B")
    }
}

/// Wire bytes (the sim's scaled-down payload) and the bytes the modelled link carried (the real
/// model's KV), labelled so neither is read as the other.
fn wire_and_modelled(ev: &Evidence) -> String {
    if ev.p2p_modelled_bytes > 0.0 {
        format!(
            "{} wire / {} modelled",
            bytes(ev.p2p_bytes),
            bytes(ev.p2p_modelled_bytes)
        )
    } else {
        format!("{} wire", bytes(ev.p2p_bytes))
    }
}

fn percent(v: f64) -> String {
    format!("{:.1} %", v * 100.0)
}

/// Under the routers table: what its last column means and why it matters under a time scale.
const OUTSIDE_NOTE: &str = "\n*TTFT outside the engines*: the client's mean TTFT minus the engines' mean \
    `vllm:time_to_first_token_seconds`, both wall time: router, HTTP and client. The model-time TTFT \
    columns multiply it by the time scale (a real fleet would not).\n";

/// Mean client TTFT minus the engines' mean TTFT, wall seconds: the time a request spends
/// outside the engines before its first chunk reaches the client (router, HTTP, client).
fn outside_engines_s(r: &ArmResult) -> Option<f64> {
    let (n, sum) = r
        .records
        .iter()
        .filter_map(|x| x.ttft_s)
        .fold((0usize, 0.0), |(n, s), t| (n + 1, s + t));
    let engine = r.evidence.engine_ttft_mean_s()?;
    (n > 0).then(|| sum / n as f64 - engine)
}

/// `min–max` requests served per engine, from the engines' own counters, and the prefill
/// balance (busiest engine's computed prompt tokens over the mean; 1.0 = even).
fn per_engine(r: &ArmResult) -> String {
    let requests = match r.evidence.requests_per_engine() {
        Some((lo, hi)) => format!("{lo:.0}–{hi:.0}"),
        None => "—".into(),
    };
    match r.evidence.prefill_balance() {
        Some(b) => format!("{requests} (prefill max/mean {b:.2})"),
        None => requests,
    }
}

/// How the routers-side-by-side table names an arm: peers by router and policy (with the
/// installed version), kvmesh profiles as `kvmesh <profile>`, and how many replicas ran.
fn router_label(r: &ArmResult) -> String {
    let name = match r.arm.split_once(':') {
        Some((router, policy)) => format!(
            "{} `{policy}`",
            r.router_version.as_deref().unwrap_or(router)
        ),
        None => format!("kvmesh `{}`", r.arm),
    };
    match r.fleet.router.as_ref().map_or(1, |s| s.replicas) {
        n if n > 1 => format!("{name} × {n} replicas"),
        _ => name,
    }
}

fn pct(base: f64, new: f64) -> String {
    if base > 0.0 {
        format!("{:+.0}%", (new - base) / base * 100.0)
    } else {
        "n/a".into()
    }
}

impl BenchReport {
    /// Adds one arm's result and brings the paired comparisons up to date (the runner writes
    /// the report after every arm).
    pub fn add_result(&mut self, r: ArmResult) {
        self.results.push(r);
        self.paired = crate::repeat::paired_comparisons(&self.results, self.seed);
    }

    /// ` (run k)` when some arm ran more than once (`--repeat`), so that tables with one row
    /// per result tell the runs apart; empty otherwise, which keeps single runs' tables as
    /// they were.
    fn run_suffix(&self, r: &ArmResult) -> String {
        if self.results.iter().any(|x| x.run > 0) {
            format!(" (run {})", r.run + 1)
        } else {
            String::new()
        }
    }

    /// An arm's name in the tables, with its run when there are several.
    fn label(&self, r: &ArmResult) -> String {
        format!("{}{}", r.arm, self.run_suffix(r))
    }

    /// [`Self::label`] of every result, in order.
    fn labels(&self) -> Vec<String> {
        self.results.iter().map(|r| self.label(r)).collect()
    }

    /// The main table plus, per workload, the comparison of every arm with the first.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "Command: `{}`  (scale {}, seed {})\n",
            self.command, self.scale, self.seed
        );
        let _ = writeln!(
            s,
            "Times are model seconds (wall × time scale). Prompts sent as {}.\n",
            match self.prompt_format {
                PromptFormat::Text => "text",
                PromptFormat::Tokens => "token ids",
            }
        );
        s.push_str("| workload | arm | ok / total | timeouts | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | offered req/s | achieved req/s | external-hit tokens | P2P bytes wire / modelled | flags |\n");
        s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for r in &self.results {
            let st = &r.stats;
            let _ = writeln!(
                s,
                "| {} | {} | {} / {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.0} | {} | {} |",
                r.workload,
                self.label(r),
                st.succeeded,
                st.requests,
                st.timeouts,
                secs(st.ttft.p50),
                secs(st.ttft.p90),
                secs(st.ttft.p99),
                secs(st.e2e.p50),
                st.offered_rate,
                st.achieved_rate,
                r.evidence.external_hit_tokens,
                wire_and_modelled(&r.evidence),
                if r.flags.is_empty() {
                    "ok".into()
                } else {
                    r.flags.join("; ")
                },
            );
        }
        for r in &self.results {
            if let Some(outcomes) = &r.replication {
                let list: Vec<String> = outcomes
                    .iter()
                    .map(|(k, v)| format!("{k} {v:.0}"))
                    .collect();
                let _ = writeln!(
                    s,
                    "\n**{}** on {}: hot-prefix copies (router): {}",
                    self.label(r),
                    r.workload,
                    if list.is_empty() {
                        "none".into()
                    } else {
                        list.join(", ")
                    }
                );
            }
        }
        s.push_str(&self.routers_table());
        s.push_str(&self.audit_table());
        let labels = self.labels();
        let scale_outs: Vec<(&str, &crate::scale_out::ScaleOutResult)> = self
            .results
            .iter()
            .zip(&labels)
            .filter_map(|(r, l)| r.scale_out.as_ref().map(|x| (l.as_str(), x)))
            .collect();
        s.push_str(&crate::scale_out::markdown(&scale_outs));
        let agentic: Vec<crate::agentic::Row<'_>> = self
            .results
            .iter()
            .zip(&labels)
            .filter(|(r, _)| crate::agentic::is_agentic(&r.workload))
            .map(|(r, label)| crate::agentic::Row {
                workload: &r.workload,
                arm: label,
                returning: crate::agentic::returning_turns(&r.records, r.time_scale),
                pulled_tokens: r.evidence.external_hit_tokens,
                prefetch: r.prefetch.as_ref(),
                tiers: crate::agentic::TierStats::from_evidence(&r.evidence),
            })
            .collect();
        s.push_str(&crate::agentic::markdown(&agentic));
        let restarts: Vec<(&str, &crate::restart::RestartResult)> = self
            .results
            .iter()
            .zip(&labels)
            .filter_map(|(r, l)| r.restart.as_ref().map(|x| (l.as_str(), x)))
            .collect();
        s.push_str(&crate::restart::markdown(&restarts));
        for (workload, arms) in self.by_workload() {
            let Some(base) = arms.first() else { continue };
            let _ = writeln!(s, "\n**{workload}** — {}", base.workload_description);
            for r in &arms {
                let st = &r.stats;
                let mut line = format!(
                    "- `{}`: TTFT p50 {} / p90 {}",
                    self.label(r),
                    secs(st.ttft.p50),
                    secs(st.ttft.p90)
                );
                if let Some(b) = st.ttft_by_kind.get("child") {
                    let _ = write!(
                        line,
                        "; branch-start TTFT p50 {} / p90 {}; slow branches (TTFT ≥ ½ parent's) {}",
                        secs(b.p50),
                        secs(b.p90),
                        st.slow_branches.unwrap_or(0)
                    );
                }
                if let Some(w) = &r.evidence.child_wave {
                    let _ = write!(
                        line,
                        "; children that recomputed the context (engine counters over the children's wave) {}",
                        w.explain()
                    );
                }
                if r.prefill_external_hit_tokens > 0.0 {
                    let _ = write!(
                        line,
                        "; history tokens pulled into prefill {:.0}",
                        r.prefill_external_hit_tokens
                    );
                }
                let ev = &r.evidence;
                if ev.pd_decode_tokens > 0.0 || ev.pd_history_tokens > 0.0 {
                    let _ = write!(
                        line,
                        "; P/D reads: prompt→decoder {:.0} tokens, history→prefill {:.0} tokens",
                        ev.pd_decode_tokens, ev.pd_history_tokens
                    );
                }
                let _ = write!(line, "; achieved {:.2} req/s", st.achieved_rate);
                if !std::ptr::eq(*r, *base) {
                    let (b, n) = match (
                        base.stats.ttft_by_kind.get("child"),
                        st.ttft_by_kind.get("child"),
                    ) {
                        (Some(b), Some(n)) => (b.p90, n.p90),
                        _ => (base.stats.ttft.p90, st.ttft.p90),
                    };
                    let _ = write!(
                        line,
                        " — vs `{}`: TTFT p90 {}, p50 {}, throughput {}",
                        self.label(base),
                        pct(b, n),
                        pct(base.stats.ttft.p50, st.ttft.p50),
                        pct(base.stats.achieved_rate, st.achieved_rate)
                    );
                }
                s.push_str(&line);
                s.push('\n');
            }
        }
        s.push_str(&crate::repeat::repeated_markdown(&self.results));
        s.push_str(&crate::repeat::paired_markdown(&self.paired));
        s
    }

    /// Per workload, one row per router (kvmesh profiles and peer routers alike): TTFT, the
    /// engines' local prefix-cache hit rate, tokens pulled over P2P and requests per engine.
    fn routers_table(&self) -> String {
        let mut s = String::new();
        for (workload, arms) in self.by_workload() {
            let _ = writeln!(s, "\n**{workload}: routers side by side**\n");
            s.push_str("| router (policy) | ok / failed | TTFT p50 | TTFT p90 | TTFT p99 | p50 / p99 ÷ bound | local prefix hit rate | pulled tokens | requests per engine | TTFT outside the engines (wall, mean) |\n");
            s.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
            // The same prompts for every arm: the first arm's bound stands for the workload.
            let bound = arms.iter().find_map(|r| r.bound_ttft);
            if let Some(b) = &bound {
                let _ = writeln!(
                    s,
                    "| *physical bound: novel tokens computed alone* | — | {} | {} | {} | 1.00 / 1.00 | — | — | — | — |",
                    secs(b.p50),
                    secs(b.p90),
                    secs(b.p99)
                );
            }
            let ratio = |v: f64, b: f64| {
                if b > 0.0 {
                    format!("{:.2}", v / b)
                } else {
                    "—".into()
                }
            };
            for r in &arms {
                let st = &r.stats;
                let gap = bound.map_or_else(
                    || "—".to_owned(),
                    |b| {
                        format!(
                            "{} / {}",
                            ratio(st.ttft.p50, b.p50),
                            ratio(st.ttft.p99, b.p99)
                        )
                    },
                );
                let _ = writeln!(
                    s,
                    "| {}{} | {} / {} | {} | {} | {} | {} | {} | {:.0} | {} | {} |",
                    router_label(r),
                    self.run_suffix(r),
                    st.succeeded,
                    st.failed + st.timeouts,
                    secs(st.ttft.p50),
                    secs(st.ttft.p90),
                    secs(st.ttft.p99),
                    gap,
                    r.evidence
                        .local_hit_rate()
                        .map(percent)
                        .unwrap_or_else(|| "—".into()),
                    r.evidence.external_hit_tokens,
                    per_engine(r),
                    outside_engines_s(r)
                        .map(|v| format!("{:.0} ms", v * 1000.0))
                        .unwrap_or_else(|| "—".into()),
                );
            }
            s.push_str(OUTSIDE_NOTE);
        }
        s
    }

    /// Per workload, kvmesh arms' decision audit ([`crate::audit`]): what the router expected
    /// vs what the engines found, distance from the cost function's choice, cold-request TTFT,
    /// and whether pulls landed.
    fn audit_table(&self) -> String {
        let mut s = String::new();
        for (workload, arms) in self.by_workload() {
            let audited: Vec<_> = arms
                .iter()
                .filter_map(|r| r.audit.as_ref().map(|a| (r, a)))
                .collect();
            if audited.is_empty() {
                continue;
            }
            let _ = writeln!(s, "\n**{workload}: decision audit (kvmesh arms)**\n");
            s.push_str("| arm | joined | index exact / over / under (tokens over) | decisions > 10 ms from the cost function's best (mean, p90 regret) | cold requests: TTFT p50 / p99 | measured ÷ predicted TTFT p50 | pulls named / landed (tokens recomputed) | pulls skipped for cost |\n");
            s.push_str("|---|---|---|---|---|---|---|---|\n");
            for (r, a) in audited {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} / {} / {} ({}) | {} ({:.0} ms, {:.0} ms) | {}: {} / {} | {} | {} / {} ({}) | {} |",
                    self.label(r),
                    a.joined,
                    a.index_exact,
                    a.index_over,
                    a.index_under,
                    a.index_over_tokens,
                    a.regret_decisions,
                    a.regret_ms_mean,
                    a.regret_ms_p90,
                    a.cold_requests,
                    secs(a.cold_ttft_p50_s),
                    secs(a.cold_ttft_p99_s),
                    a.ttft_measured_over_predicted_p50
                        .map_or_else(|| "—".into(), |v| format!("{v:.2}")),
                    a.pulls_named,
                    a.pulls_landed,
                    a.pull_tokens_missing,
                    a.pulls_skipped_for_cost,
                );
            }
        }
        s
    }

    /// Per workload, one column per arm and a change column against the first arm (the demo's
    /// P2P-off vs P2P-on view).
    pub fn side_by_side(&self) -> String {
        let mut s = String::new();
        for (workload, arms) in self.by_workload() {
            let Some(base) = arms.first() else { continue };
            let _ = writeln!(s, "\n### {workload} — {}\n", base.workload_description);
            s.push_str("| metric |");
            for r in &arms {
                let _ = write!(s, " {} |", self.label(r));
            }
            if arms.len() > 1 {
                s.push_str(" change |");
            }
            s.push_str("\n|---|");
            for _ in 0..arms.len() + usize::from(arms.len() > 1) {
                s.push_str("---|");
            }
            s.push('\n');
            let mut rows: Vec<Row> = vec![
                (
                    "requests ok",
                    |r| Some(r.stats.succeeded as f64),
                    |v| format!("{v:.0}"),
                ),
                (
                    "failed + timeouts",
                    |r| Some((r.stats.failed + r.stats.timeouts) as f64),
                    |v| format!("{v:.0}"),
                ),
                ("TTFT p50", |r| Some(r.stats.ttft.p50), secs),
                ("TTFT p90", |r| Some(r.stats.ttft.p90), secs),
                ("TTFT p99", |r| Some(r.stats.ttft.p99), secs),
                ("E2E p50", |r| Some(r.stats.e2e.p50), secs),
            ];
            if base.stats.ttft_by_kind.contains_key("child") {
                rows.push((
                    "branch-start TTFT p50",
                    |r| r.stats.ttft_by_kind.get("child").map(|l| l.p50),
                    secs,
                ));
                rows.push((
                    "branch-start TTFT p90",
                    |r| r.stats.ttft_by_kind.get("child").map(|l| l.p90),
                    secs,
                ));
                rows.push((
                    "children that recomputed (engine counters)",
                    |r| {
                        r.evidence
                            .child_wave
                            .as_ref()
                            .map(|w| w.recomputed_children)
                    },
                    crate::metrics::fmt_children,
                ));
                rows.push((
                    "slow branches (TTFT ≥ ½ parent's)",
                    |r| r.stats.slow_branches.map(|v| v as f64),
                    |v| format!("{v:.0}"),
                ));
            }
            rows.extend::<[Row; 9]>([
                (
                    "local prefix-cache hit rate (engines)",
                    |r| r.evidence.local_hit_rate(),
                    percent,
                ),
                (
                    "TTFT outside the engines, mean (wall ms)",
                    outside_engines_s,
                    |v| format!("{:.1}", v * 1000.0),
                ),
                (
                    "requests served (engines)",
                    |r| Some(r.evidence.engines.iter().fold(0.0, |a, e| a + e.requests)),
                    |v| format!("{v:.0}"),
                ),
                (
                    "offered req/s",
                    |r| Some(r.stats.offered_rate),
                    |v| format!("{v:.2}"),
                ),
                (
                    "achieved req/s",
                    |r| Some(r.stats.achieved_rate),
                    |v| format!("{v:.2}"),
                ),
                (
                    "external-hit tokens (verified)",
                    |r| Some(r.evidence.external_hit_tokens),
                    |v| format!("{v:.0}"),
                ),
                (
                    "P2P bytes moved (wire)",
                    |r| Some(r.evidence.p2p_bytes),
                    bytes,
                ),
                (
                    "P2P bytes moved (modelled link)",
                    |r| Some(r.evidence.p2p_modelled_bytes),
                    bytes,
                ),
                (
                    "P2P blocks moved",
                    |r| Some(r.evidence.p2p_blocks),
                    |v| format!("{v:.0}"),
                ),
            ]);
            for (name, get, fmt) in rows {
                let _ = write!(s, "| {name} |");
                for r in &arms {
                    let _ = write!(s, " {} |", get(r).map(fmt).unwrap_or_else(|| "—".into()));
                }
                if arms.len() > 1 {
                    let last = arms.last().and_then(|r| get(r));
                    let _ = write!(
                        s,
                        " {} |",
                        match (get(base), last) {
                            (Some(b), Some(n)) if b > 0.0 => pct(b, n),
                            _ => String::new(),
                        }
                    );
                }
                s.push('\n');
            }
            let _ = write!(s, "| requests per engine (min–max) |");
            for r in &arms {
                let _ = write!(s, " {} |", per_engine(r));
            }
            if arms.len() > 1 {
                s.push_str("  |");
            }
            s.push('\n');
            for r in &arms {
                if !r.flags.is_empty() {
                    let _ = writeln!(s, "\n**{}**: {}", self.label(r), r.flags.join("; "));
                }
            }
        }
        let labels = self.labels();
        let scale_outs: Vec<(&str, &crate::scale_out::ScaleOutResult)> = self
            .results
            .iter()
            .zip(&labels)
            .filter_map(|(r, l)| r.scale_out.as_ref().map(|x| (l.as_str(), x)))
            .collect();
        s.push_str(&crate::scale_out::markdown(&scale_outs));
        s
    }

    fn by_workload(&self) -> Vec<(String, Vec<&ArmResult>)> {
        let mut order: Vec<String> = Vec::new();
        let mut map: BTreeMap<String, Vec<&ArmResult>> = BTreeMap::new();
        for r in &self.results {
            if !map.contains_key(&r.workload) {
                order.push(r.workload.clone());
            }
            map.entry(r.workload.clone()).or_default().push(r);
        }
        order
            .into_iter()
            .map(|w| (w.clone(), map.remove(&w).unwrap_or_default()))
            .collect()
    }

    /// Writes `report.json`, `report.md` and the plots into `dir`; returns the files written.
    pub fn write(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)?;
        let mut files = Vec::new();
        let json = dir.join("report.json");
        std::fs::write(
            &json,
            serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?,
        )?;
        files.push(json);
        let md = dir.join("report.md");
        std::fs::write(&md, format!("{}\n{}", self.markdown(), self.side_by_side()))?;
        files.push(md);
        for (workload, arms) in self.by_workload() {
            let safe: String = workload
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            let labelled: Vec<(String, &ArmResult)> =
                arms.iter().map(|r| (self.label(r), *r)).collect();
            let cdf = dir.join(format!("{safe}-ttft-cdf.svg"));
            keep_plot(
                &mut files,
                cdf.clone(),
                plot_ttft_cdf(&cdf, &workload, &labelled),
            );
            if arms
                .iter()
                .any(|r| r.records.iter().any(|x| x.kind == StepKind::Child))
            {
                let p = dir.join(format!("{safe}-branch-starts.svg"));
                keep_plot(
                    &mut files,
                    p.clone(),
                    plot_branches(&p, &workload, &labelled),
                );
            }
            if arms
                .iter()
                .any(|r| r.records.iter().any(|x| x.kind == StepKind::Turn))
            {
                let p = dir.join(format!("{safe}-ttft-vs-prompt.svg"));
                keep_plot(
                    &mut files,
                    p.clone(),
                    plot_ttft_vs_prompt(&p, &workload, &labelled),
                );
            }
        }
        Ok(files)
    }
}

type Get = fn(&ArmResult) -> Option<f64>;
/// (label, value of an arm, formatter) of one side-by-side row.
type Row = (&'static str, Get, fn(f64) -> String);

type PlotResult = Result<(), Box<dyn std::error::Error>>;

fn ttfts(r: &ArmResult, kind: Option<StepKind>) -> Vec<(usize, f64)> {
    r.records
        .iter()
        .filter(|x| kind.is_none_or(|k| x.kind == k))
        .filter_map(|x| x.ttft_s.map(|t| (x.prompt_tokens, t * r.time_scale)))
        .collect()
}

fn plot_ttft_cdf(path: &Path, workload: &str, arms: &[(String, &ArmResult)]) -> PlotResult {
    let series: Vec<(String, Vec<f64>)> = arms
        .iter()
        .map(|(label, r)| {
            let mut v: Vec<f64> = ttfts(r, None).into_iter().map(|x| x.1).collect();
            v.sort_by(f64::total_cmp);
            (label.clone(), v)
        })
        .collect();
    let xmax = series
        .iter()
        .flat_map(|s| s.1.last().copied())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{workload}: TTFT CDF"), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax, 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (model s)")
        .y_desc("fraction of requests")
        .draw()?;
    for (i, (arm, v)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let n = v.len().max(1) as f64;
        chart
            .draw_series(LineSeries::new(
                v.iter().enumerate().map(|(k, t)| (*t, (k + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(arm.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn plot_branches(path: &Path, workload: &str, arms: &[(String, &ArmResult)]) -> PlotResult {
    let series: Vec<(String, Vec<(f64, f64)>)> = arms
        .iter()
        .map(|(label, r)| {
            let mut kids: Vec<&RequestRecord> = r
                .records
                .iter()
                .filter(|x| x.kind == StepKind::Child)
                .collect();
            kids.sort_by_key(|k| k.session);
            let pts = kids
                .iter()
                .enumerate()
                .filter_map(|(i, x)| x.ttft_s.map(|t| (i as f64, t * r.time_scale)))
                .collect();
            (label.clone(), pts)
        })
        .collect();
    let n = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(1) as f64;
    scatter(
        path,
        &format!("{workload}: branch-start TTFT per child (arrival order)"),
        ("child (arrival order)", "TTFT (model s)"),
        -0.5..n,
        &series,
        Marks {
            radius: 4,
            joined: true,
        },
    )
}

fn plot_ttft_vs_prompt(path: &Path, workload: &str, arms: &[(String, &ArmResult)]) -> PlotResult {
    let series: Vec<(String, Vec<(f64, f64)>)> = arms
        .iter()
        .map(|(label, r)| {
            (
                label.clone(),
                ttfts(r, None)
                    .into_iter()
                    .map(|(p, t)| (p as f64, t))
                    .collect(),
            )
        })
        .collect();
    let xmax = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.05;
    scatter(
        path,
        &format!("{workload}: TTFT vs prompt length"),
        ("prompt tokens", "TTFT (model s)"),
        0.0..xmax,
        &series,
        Marks {
            radius: 3,
            joined: false,
        },
    )
}

/// Lists a plot that was drawn; a plot that failed is reported, not silently missing (the
/// report's numbers stand without it).
fn keep_plot(files: &mut Vec<PathBuf>, path: PathBuf, drawn: PlotResult) {
    match drawn {
        Ok(()) => files.push(path),
        Err(e) => tracing::warn!(plot = %path.display(), error = %e, "could not draw plot"),
    }
}

/// How a scatter plot draws each arm's points.
struct Marks {
    radius: i32,
    /// Join each arm's points with a faint line (for points in a meaningful order).
    joined: bool,
}

/// One colour per arm; the y axis runs from 0 to just above the highest point.
fn scatter(
    path: &Path,
    caption: &str,
    (x_desc, y_desc): (&str, &str),
    x_range: std::ops::Range<f64>,
    series: &[(String, Vec<(f64, f64)>)],
    marks: Marks,
) -> PlotResult {
    let ymax = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(x_range, 0.0..ymax)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    let r = marks.radius;
    for (i, (arm, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, r, color.filled())))?
            .label(arm.clone())
            .legend(move |(x, y)| Circle::new((x + 10, y), r, color.filled()));
        if marks.joined {
            chart.draw_series(LineSeries::new(pts.iter().copied(), color.mix(0.4)))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::client::Outcome;
    use crate::fleet::FleetSpec;
    use crate::metrics::EngineEvidence;
    use crate::stats::summarize;

    fn result(arm: &str, pulls: bool, child_ttft: f64, moved: bool) -> ArmResult {
        let mut records = vec![RequestRecord {
            session: 0,
            step: 0,
            kind: StepKind::Parent,
            prompt_tokens: 8192,
            novel_tokens: None,
            sent_s: 0.0,
            ttft_s: Some(1.0),
            e2e_s: 1.1,
            output_tokens: 4,
            cached_tokens: None,
            outcome: Outcome::Ok,
        }];
        for i in 0..8 {
            records.push(RequestRecord {
                session: i + 1,
                kind: StepKind::Child,
                sent_s: 1.2 + i as f64 * 0.01,
                ttft_s: Some(child_ttft * (1.0 + i as f64 / 10.0)),
                ..records[0].clone()
            });
        }
        let ev = Evidence::from_engines(
            vec![EngineEvidence::from_exposition(
                "e",
                if moved {
                    "kvmesh_p2p_bytes_total 1000\nvllm:external_prefix_cache_hits_total 64\n"
                } else {
                    ""
                },
            )],
            vec![],
        );
        let stats = summarize(&records, 1.0, None);
        ArmResult {
            workload: "fork".into(),
            workload_description: "test fork".into(),
            arm: arm.into(),
            run: 0,
            pulls,
            time_scale: 1.0,
            fleet: FleetSpec::from_yaml("engines:\n  - count: 4\n").unwrap(),
            flags: flags_for(pulls, false, &stats, &ev),
            bound_ttft: None,
            stats,
            evidence: ev,
            prefill_external_hit_tokens: 0.0,
            records,
            router_version: None,
            audit: None,
            prefetch: None,
            restart: None,
            scale_out: None,
            replication: None,
        }
    }

    #[test]
    fn flags_catch_a_p2p_arm_that_moved_nothing() {
        let bad = result("load-p2p", true, 0.2, false);
        assert!(bad.flags.iter().any(|f| f.starts_with("MISCONFIGURED")));
        let good = result("load-p2p", true, 0.2, true);
        assert!(good.flags.is_empty(), "{:?}", good.flags);
        let control = result("load", false, 1.0, true);
        assert!(control.flags.iter().any(|f| f.starts_with("UNEXPECTED")));
    }

    #[test]
    fn pd_flags_catch_a_bidirectional_arm_that_moved_no_history() {
        let mut ev = Evidence {
            pd_decode_tokens: 4096.0,
            ..Default::default()
        };
        let none = pd_flags(true, 0.0, &ev);
        assert!(
            none.iter().any(|f| f.contains("moved no history")),
            "{none:?}"
        );
        assert!(pd_flags(false, 0.0, &ev).is_empty());
        ev.pd_history_tokens = 2048.0;
        assert!(pd_flags(true, 2048.0, &ev).is_empty());
        assert!(pd_flags(true, 0.0, &ev)[0].starts_with("UNVERIFIED"));
        assert!(pd_flags(false, 0.0, &ev)[0].starts_with("UNEXPECTED"));
        ev.pd_decode_tokens = 0.0;
        assert!(pd_flags(true, 2048.0, &ev)[0].contains("no prompt KV"));
    }

    /// Peers and kvmesh profiles share one table, with the engines' hit rates and request counts.
    #[test]
    fn routers_table_shows_engine_evidence_for_every_arm() {
        let engine = |hits: u32, queries: u32, reqs: u32| {
            EngineEvidence::from_exposition(
                "e",
                &format!(
                    "vllm:prefix_cache_hits_total{{engine=\"0\"}} {hits}\n\
                     vllm:prefix_cache_queries_total{{engine=\"0\"}} {queries}\n\
                     vllm:request_success_total{{finished_reason=\"length\"}} {reqs}\n\
                     vllm:time_to_first_token_seconds_sum 0.05\n\
                     vllm:time_to_first_token_seconds_count 1\n"
                ),
            )
        };
        let mut peer = result("vllm-router:cache_aware", false, 0.1, false);
        peer.router_version = Some("vllm-router 0.1.17".into());
        peer.evidence =
            Evidence::from_engines(vec![engine(10, 100, 3), engine(30, 100, 6)], vec![]);
        let mine = result("affinity", false, 0.1, false);
        let rep = BenchReport {
            command: "c".into(),
            scale: "full".into(),
            seed: 1,
            prompt_format: PromptFormat::Text,
            results: vec![peer, mine],
            paired: Vec::new(),
        };
        let t = rep.routers_table();
        assert!(
            t.contains("| vllm-router 0.1.17 `cache_aware` | 9 / 0 |"),
            "{t}"
        );
        // Client TTFTs average 0.231 s (1.0 s parent, 0.10–0.17 s children); the engines say 0.05 s.
        assert!(t.contains("| 20.0 % | 0 | 3–6 | 181 ms |"), "{t}");
        assert!(t.contains("| kvmesh `affinity` |"), "{t}");
        let sbs = rep.side_by_side();
        assert!(
            sbs.contains("| local prefix-cache hit rate (engines) | 20.0 % |"),
            "{sbs}"
        );
        assert!(
            sbs.contains("| requests per engine (min–max) | 3–6 | 0–0 |"),
            "{sbs}"
        );
        assert!(rep.markdown().contains("Prompts sent as text"));
    }

    /// One run: no "Repeated runs" section and no run labels; the paired section only with
    /// two arms. Two runs: both sections, and each result's row says which run it is.
    #[test]
    fn repeat_sections_appear_only_when_they_say_something() {
        let empty = || BenchReport {
            command: "c".into(),
            scale: "quick".into(),
            seed: 1,
            prompt_format: PromptFormat::Text,
            results: Vec::new(),
            paired: Vec::new(),
        };
        let mut one = empty();
        one.add_result(result("load", false, 1.0, false));
        let md = one.markdown();
        assert!(one.paired.is_empty());
        assert!(
            !md.contains("### Repeated runs") && !md.contains("### Paired against"),
            "{md}"
        );
        assert!(md.contains("| fork | load | 9 / 9 |"), "{md}");
        one.add_result(result("load-p2p", true, 0.2, true));
        let md = one.markdown();
        assert_eq!(one.paired.len(), 1);
        assert!(
            !md.contains("### Repeated runs") && !md.contains("(run "),
            "{md}"
        );
        // Children 0.2–0.34 s against 1.0–1.7 s: every child faster; the parent is the same.
        assert!(
            md.contains("| `load-p2p` | all | 9 (9) | 8 / 1 / 0 |"),
            "{md}"
        );
        let mut two = one.clone();
        for arm in [("load", false, 1.0), ("load-p2p", true, 0.25)] {
            let mut r = result(arm.0, arm.1, arm.2, arm.1);
            r.run = 1;
            two.add_result(r);
        }
        let md = two.markdown();
        assert!(md.contains("### Repeated runs"), "{md}");
        assert!(md.contains("| fork | load-p2p (run 2) |"), "{md}");
        assert!(
            md.contains("| `load-p2p` | all | 18 (18) | 16 / 2 / 0 |"),
            "{md}"
        );
    }

    #[test]
    fn markdown_and_files() {
        let rep = BenchReport {
            command: "kvmesh bench --workload fork".into(),
            scale: "quick".into(),
            seed: 1,
            prompt_format: PromptFormat::Text,
            results: vec![
                result("load", false, 1.0, false),
                result("load-p2p", true, 0.2, true),
            ],
            paired: Vec::new(),
        };
        let sbs = rep.side_by_side();
        assert!(
            sbs.contains("| metric | load | load-p2p | change |"),
            "{sbs}"
        );
        assert!(sbs.contains("| branch-start TTFT p90 |"), "{sbs}");
        let md = rep.markdown();
        assert!(md.contains("| fork | load-p2p | 9 / 9 |"), "{md}");
        assert!(md.contains("branch-start TTFT"), "{md}");
        assert!(md.contains("vs `load`: TTFT p90 -80%"), "{md}");
        let dir = tempfile::tempdir().unwrap();
        let files = rep.write(dir.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(names.contains(&"fork-ttft-cdf.svg".to_owned()), "{names:?}");
        assert!(
            names.contains(&"fork-branch-starts.svg".to_owned()),
            "{names:?}"
        );
        for plot in ["fork-ttft-cdf.svg", "fork-branch-starts.svg"] {
            let svg = std::fs::read_to_string(dir.path().join(plot)).unwrap();
            assert!(svg.contains("<svg") && svg.contains("load-p2p"), "{plot}");
        }
        let back: BenchReport =
            serde_json::from_slice(&std::fs::read(dir.path().join("report.json")).unwrap())
                .unwrap();
        assert_eq!(back.results.len(), 2);
    }
}
