//! What an engine tells the router about the pull a request was told to make (`x-kvmesh-pull`),
//! so the router can tell a source that serves what it advertised from one that misses, stalls or
//! sends blocks that fail verification (issue 37, finding 6).
//!
//! A response header, not a body field: the engine pulls before it submits the request, so the
//! outcome is known before its response headers are written, streamed or not, and the router
//! reads it without parsing bodies. The value is `key=value` pairs separated by `;`; unknown keys
//! are ignored so either side can add one. A value the router cannot read is no feedback at all
//! (never a penalty): the header crosses a network.

use std::fmt;

/// The response header carrying a [`PullFeedback`].
pub const PULL_FEEDBACK_HEADER: &str = "x-kvmesh-pull";

/// Longest header value [`PullFeedback::parse`] reads (a well-formed one is about 120 bytes).
const MAX_VALUE_LEN: usize = 512;

/// Longest `reason` kept (the engine's reasons are short snake_case labels).
const MAX_REASON_LEN: usize = 32;

/// How the read ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullFeedbackOutcome {
    /// A pull ran and delivered every block asked for.
    Complete,
    /// A pull ran, delivered some leading blocks, then stopped (`reason`).
    Partial,
    /// A pull ran and delivered nothing (`reason`).
    Failed,
    /// The request waited for another request's pull of the same blocks until its deadline.
    WaitedOut,
    /// Nothing was pulled: every block the source could serve was local already (or too few
    /// were missing, or the source's blocks had expired). Says nothing about the source.
    NotNeeded,
}

impl PullFeedbackOutcome {
    pub fn label(self) -> &'static str {
        match self {
            PullFeedbackOutcome::Complete => "complete",
            PullFeedbackOutcome::Partial => "partial",
            PullFeedbackOutcome::Failed => "failed",
            PullFeedbackOutcome::WaitedOut => "waited_out",
            PullFeedbackOutcome::NotNeeded => "not_needed",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "complete" => PullFeedbackOutcome::Complete,
            "partial" => PullFeedbackOutcome::Partial,
            "failed" => PullFeedbackOutcome::Failed,
            "waited_out" => PullFeedbackOutcome::WaitedOut,
            "not_needed" => PullFeedbackOutcome::NotNeeded,
            _ => return None,
        })
    }
}

/// One request's pull, as its engine reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct PullFeedback {
    pub outcome: PullFeedbackOutcome,
    /// Why a pull stopped early (the engine's `kvmesh_p2p_pulls_total` reason label).
    pub reason: Option<String>,
    /// Leading prompt tokens the engine held after the read (its own prefix plus what arrived).
    pub reached_tokens: u64,
    /// Leading prompt tokens a read could have brought at most (the cacheable prefix: every full
    /// block but the one holding the last prompt token).
    pub readable_tokens: u64,
    /// The engine's block size: what it reads is counted in whole blocks of it.
    pub block_size: u64,
    /// Wall time of the read, waiting on another request's pull included (ms).
    pub elapsed_ms: f64,
    /// The deadline the read had (ms from its start).
    pub deadline_ms: f64,
}

impl fmt::Display for PullFeedback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "outcome={}", self.outcome.label())?;
        if let Some(r) = &self.reason {
            write!(f, "; reason={r}")?;
        }
        write!(
            f,
            "; reached_tokens={}; readable_tokens={}; block_size={}; elapsed_ms={:.1}; deadline_ms={:.1}",
            self.reached_tokens,
            self.readable_tokens,
            self.block_size,
            self.elapsed_ms,
            self.deadline_ms
        )
    }
}

impl PullFeedback {
    /// Reads a header value; `None` for anything malformed (too long, no known outcome, a number
    /// that does not parse or is not finite and ≥ 0).
    pub fn parse(value: &str) -> Option<PullFeedback> {
        if value.len() > MAX_VALUE_LEN {
            return None;
        }
        let mut outcome = None;
        let mut fb = PullFeedback {
            outcome: PullFeedbackOutcome::NotNeeded,
            reason: None,
            reached_tokens: 0,
            readable_tokens: 0,
            block_size: 1,
            elapsed_ms: 0.0,
            deadline_ms: 0.0,
        };
        let ms = |v: &str| v.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0);
        for pair in value.split(';') {
            let Some((k, v)) = pair.split_once('=') else {
                continue;
            };
            let v = v.trim();
            match k.trim() {
                "outcome" => outcome = Some(PullFeedbackOutcome::parse(v)?),
                "reason" => {
                    let ok = v.len() <= MAX_REASON_LEN
                        && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                    fb.reason = Some(v.to_owned()).filter(|_| ok);
                }
                "reached_tokens" => fb.reached_tokens = v.parse().ok()?,
                "readable_tokens" => fb.readable_tokens = v.parse().ok()?,
                "block_size" => fb.block_size = v.parse::<u64>().ok()?.max(1),
                "elapsed_ms" => fb.elapsed_ms = ms(v)?,
                "deadline_ms" => fb.deadline_ms = ms(v)?,
                _ => {}
            }
        }
        fb.outcome = outcome?;
        Some(fb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PullFeedback {
        PullFeedback {
            outcome: PullFeedbackOutcome::Partial,
            reason: Some("timeout".to_owned()),
            reached_tokens: 512,
            readable_tokens: 4080,
            block_size: 16,
            elapsed_ms: 171.25,
            deadline_ms: 172.0,
        }
    }

    #[test]
    fn round_trips_through_its_header_value() {
        let fb = sample();
        let text = fb.to_string();
        assert_eq!(
            text,
            "outcome=partial; reason=timeout; reached_tokens=512; readable_tokens=4080; \
             block_size=16; elapsed_ms=171.2; deadline_ms=172.0"
        );
        let back = PullFeedback::parse(&text).expect("parses");
        assert_eq!(back.outcome, fb.outcome);
        assert_eq!(back.reason, fb.reason);
        assert_eq!(
            (back.reached_tokens, back.readable_tokens, back.block_size),
            (512, 4080, 16)
        );
        let complete = PullFeedback {
            outcome: PullFeedbackOutcome::Complete,
            reason: None,
            ..sample()
        };
        let back = PullFeedback::parse(&complete.to_string()).expect("parses");
        assert_eq!(
            (back.outcome, back.reason),
            (PullFeedbackOutcome::Complete, None)
        );
    }

    #[test]
    fn malformed_values_are_no_feedback() {
        for bad in [
            "",
            "reason=miss",
            "outcome=exploded",
            "outcome=failed; reached_tokens=-1",
            "outcome=failed; elapsed_ms=NaN",
            "outcome=failed; deadline_ms=inf",
        ] {
            assert_eq!(PullFeedback::parse(bad), None, "{bad}");
        }
        assert_eq!(PullFeedback::parse(&"a".repeat(600)), None);
        // Unknown keys are skipped; an odd reason is dropped, not trusted.
        let fb = PullFeedback::parse("outcome=failed; future=1; reason=<script>").expect("parses");
        assert_eq!((fb.outcome, fb.reason), (PullFeedbackOutcome::Failed, None));
    }
}
