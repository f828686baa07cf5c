//! `prefetch:` — its config: where session ids come from, the budgets, and when to decide.

use serde::{Deserialize, Serialize};

use crate::config::error::ConfigError;

/// Where a request's session id is read from (`prefetch.session_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionIdSource {
    /// `header:<name>`: a request header (the bench and vLLM's multi-turn benchmark send
    /// `x-session-id`).
    Header(String),
    /// `body:<field>`: a top-level string (or number) field, e.g. OpenAI's `user`.
    Body(String),
    /// `metadata:<key>`: a key of the request's `metadata` object.
    Metadata(String),
}

impl std::str::FromStr for SessionIdSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, name) = s.split_once(':').ok_or_else(|| {
            format!("session_id {s:?}: expected header:<name>, body:<field> or metadata:<key>")
        })?;
        let name = name.trim();
        if name.is_empty() {
            return Err(format!("session_id {s:?}: empty name"));
        }
        match kind.trim() {
            "header" => Ok(Self::Header(name.to_ascii_lowercase())),
            "body" => Ok(Self::Body(name.to_owned())),
            "metadata" => Ok(Self::Metadata(name.to_owned())),
            other => Err(format!(
                "session_id {s:?}: unknown source {other:?} (header, body, metadata)"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for SessionIdSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for SessionIdSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text = match self {
            Self::Header(n) => format!("header:{n}"),
            Self::Body(n) => format!("body:{n}"),
            Self::Metadata(n) => format!("metadata:{n}"),
        };
        s.serialize_str(&text)
    }
}

/// `prefetch:` — sessions and prefetch ahead of arrival.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefetchConfig {
    /// Where the session id comes from (default `header:x-session-id`).
    #[serde(default = "default_session_id")]
    pub session_id: SessionIdSource,
    /// KV bytes one token takes on these engines (prices the budget and the reports; default
    /// 73,728: gpt-oss-120b, bf16).
    #[serde(default = "default_kv_bytes_per_token")]
    pub kv_bytes_per_token: u64,
    /// Most modelled bytes of prefetches in flight towards one endpoint (default 8 GiB); a
    /// prefetch that does not fit is skipped, never queued.
    #[serde(default = "default_prefetch_budget")]
    pub max_inflight_bytes_per_endpoint: u64,
    /// Most modelled bytes of prefetches towards one endpoint whose turn has not come yet
    /// (running or landed, default 16 GiB): landed copies take CPU-tier room from other blocks,
    /// so speculation is bounded by what the tier can spare, not only by what is in flight.
    #[serde(default = "default_prefetch_unused")]
    pub max_unused_bytes_per_endpoint: u64,
    /// Histories shorter than this are not prefetched (a pull's setup would cost more than it
    /// saves).
    #[serde(default = "default_prefetch_min_tokens")]
    pub min_tokens: usize,
    /// A session idle this long is forgotten (its unused prefetch counted as expired).
    #[serde(default = "default_session_ttl")]
    pub session_ttl_s: f64,
    /// Most sessions followed at once (the least recently active is dropped beyond it).
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
    /// Scheduling profile that picks the prefetch target (default: the default profile).
    #[serde(default)]
    pub profile: Option<String>,
    /// How long after a turn ends the router decides (ms): a next turn that arrives sooner had
    /// no gap to hide a transfer in, and the owner's load has settled after its answer.
    #[serde(default = "default_prefetch_delay_ms")]
    pub delay_ms: f64,
    /// Longest a prefetch may run before the router stops waiting for its report.
    #[serde(default = "default_prefetch_timeout")]
    pub timeout_s: f64,
    /// When the next turn is predicted back on its owner: restore the history from the owner's
    /// CPU tier into its GPU tier once the index shows it left the GPU tier (default on). With
    /// `gap_timing` only sessions with a regular pace are restored ahead; on those it lowered
    /// returning turns' TTFT at p50, p90 and p99 where the restore is on the critical path, and
    /// at p50 with the tail unchanged on a saturated fleet, in repeated paired runs
    /// (docs/benchmarks.md, "Repeated and paired"). It costs GPU evictions (about a fifth more).
    #[serde(default = "default_true")]
    pub restore: bool,
    /// How often (ms) the router re-reads the index during a gap whose next turn goes back to
    /// the owner, to catch the history leaving the owner's GPU tier (default: `delay_ms`).
    #[serde(default)]
    pub restore_recheck_ms: Option<f64>,
    /// Time decisions by the session's own gaps (default on): once a session has left two gaps
    /// that agree within `gap_tolerance`, the router decides `lead_ms` before the earliest
    /// expected arrival instead of `delay_ms` after the turn, and a restore ahead is made only
    /// for such predictable sessions (restored early, a history is evicted again before its
    /// turn). Sessions without an estimate get pull prefetches at `delay_ms` as before.
    #[serde(default = "default_true")]
    pub gap_timing: bool,
    /// How far ahead of the earliest expected arrival the router decides (ms, default 1000):
    /// room for the transfer and for the arrival coming early.
    #[serde(default = "default_prefetch_lead_ms")]
    pub lead_ms: f64,
    /// Most relative distance of a session's recent gaps from their mean for the session to
    /// count as predictable (default 0.25).
    #[serde(default = "default_gap_tolerance")]
    pub gap_tolerance: f64,
}

fn default_session_id() -> SessionIdSource {
    SessionIdSource::Header("x-session-id".to_owned())
}
fn default_kv_bytes_per_token() -> u64 {
    73_728
}
fn default_prefetch_budget() -> u64 {
    8 << 30
}
fn default_prefetch_unused() -> u64 {
    16 << 30
}
fn default_prefetch_min_tokens() -> usize {
    1024
}
fn default_session_ttl() -> f64 {
    120.0
}
fn default_max_sessions() -> usize {
    65_536
}
fn default_prefetch_delay_ms() -> f64 {
    500.0
}
fn default_prefetch_timeout() -> f64 {
    30.0
}
fn default_true() -> bool {
    true
}
fn default_prefetch_lead_ms() -> f64 {
    1000.0
}
fn default_gap_tolerance() -> f64 {
    0.25
}

impl PrefetchConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(format!("prefetch: {m}")));
        if self.kv_bytes_per_token == 0 {
            return bad("kv_bytes_per_token must be > 0");
        }
        if self.max_sessions == 0 {
            return bad("max_sessions must be > 0");
        }
        if !(self.session_ttl_s.is_finite() && self.session_ttl_s > 0.0) {
            return bad("session_ttl_s must be a positive number of seconds");
        }
        if !(self.delay_ms.is_finite() && self.delay_ms >= 0.0) {
            return bad("delay_ms must be a number of milliseconds >= 0");
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return bad("timeout_s must be a positive number of seconds");
        }
        if self
            .restore_recheck_ms
            .is_some_and(|ms| !(ms.is_finite() && ms > 0.0))
        {
            return bad("restore_recheck_ms must be a positive number of milliseconds");
        }
        if !(self.lead_ms.is_finite() && self.lead_ms >= 0.0) {
            return bad("lead_ms must be a number of milliseconds >= 0");
        }
        if !(self.gap_tolerance.is_finite() && (0.0..1.0).contains(&self.gap_tolerance)) {
            return bad("gap_tolerance must be in [0, 1)");
        }
        Ok(())
    }

    /// On a fleet sped up by `ts` (see `RouterConfig::scale_time`): decisions come `ts` times
    /// sooner after a turn and before the next.
    pub fn scale_time(&mut self, ts: f64) {
        self.delay_ms /= ts;
        self.lead_ms /= ts;
    }

    /// The index re-read interval of restore-ahead: `restore_recheck_ms`, else `delay_ms`; at
    /// least 1 ms so a zero delay cannot spin.
    pub fn restore_recheck(&self) -> std::time::Duration {
        let ms = self.restore_recheck_ms.unwrap_or(self.delay_ms).max(1.0);
        std::time::Duration::from_secs_f64(ms / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_restores_ahead_timed_by_pace_unless_told_not_to() {
        let parse = |extra: &str| -> PrefetchConfig {
            serde_norway::from_str(&format!("session_id: header:x-session-id\n{extra}"))
                .expect("parse")
        };
        let p = parse("");
        assert!(p.restore && p.gap_timing, "restore ahead, timed by pace");
        assert!(!parse("restore: false").restore);
    }
}
