//! `token-load-scorer`: `1 − min(1, in_flight_uncached_tokens / max_tokens)` with max 4,194,304
//! (llm-d). In-flight uncached tokens are the prompt tokens the router has sent to the endpoint
//! that it still has to compute — the prefill work queued there.

use serde::{Deserialize, Serialize};

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::Scorer;

pub const TYPE: &str = "token-load-scorer";

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokenLoadParams {
    pub max_tokens: f64,
}

impl Default for TokenLoadParams {
    fn default() -> Self {
        TokenLoadParams {
            max_tokens: 4_194_304.0,
        }
    }
}

pub struct TokenLoadScorer {
    params: TokenLoadParams,
}

impl TokenLoadScorer {
    pub fn new(params: TokenLoadParams) -> Self {
        TokenLoadScorer { params }
    }
}

impl Scorer for TokenLoadScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(&self, _ctx: &SchedulingContext<'_>, candidates: &[&Candidate]) -> Vec<f64> {
        let max = self.params.max_tokens.max(1.0);
        candidates
            .iter()
            .map(|c| 1.0 - (c.in_flight_uncached_tokens as f64 / max).min(1.0))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::ctx;

    #[test]
    fn linear_in_uncached_tokens_then_floor() {
        let mk = |t: u64| Candidate {
            in_flight_uncached_tokens: t,
            ..Candidate::idle(0, "e")
        };
        let (a, b, c) = (mk(0), mk(1_048_576), mk(9_000_000));
        let s = TokenLoadScorer::new(TokenLoadParams::default()).score(&ctx(32, 16), &[&a, &b, &c]);
        assert_eq!(s, vec![1.0, 0.75, 0.0]);
    }
}
