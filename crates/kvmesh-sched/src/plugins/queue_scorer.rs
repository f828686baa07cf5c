//! `queue-scorer`: prefer endpoints with shorter queues.
//!
//! llm-d semantics: `(max_q − q)/(max_q − min_q)`, 1.0 for everyone when all queues are equal.
//! What `q` is: llm-d uses the scraped waiting queue. Scrapes are periodic, so during a burst they
//! are stale and every endpoint looks equal; kvmesh's default (`queue_source: combined`) therefore
//! takes `max(scraped waiting + running, router in-flight requests)` — the better estimate of the
//! requests the engine holds right now. `waiting` and `in_flight` select one source only.

use serde::{Deserialize, Serialize};

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::Scorer;

pub const TYPE: &str = "queue-scorer";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum QueueSource {
    /// Scraped `vllm:num_requests_waiting` only (llm-d); 0 until scraped.
    Waiting,
    /// The router's own in-flight request count only.
    InFlight,
    /// `max(waiting + running, in_flight)`.
    #[default]
    Combined,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueParams {
    pub queue_source: QueueSource,
}

pub struct QueueScorer {
    params: QueueParams,
}

impl QueueScorer {
    pub fn new(params: QueueParams) -> Self {
        QueueScorer { params }
    }

    /// The queue length this scorer sees for `c`.
    pub fn queue(&self, c: &Candidate) -> f64 {
        let waiting = c.waiting.unwrap_or(0.0).max(0.0);
        let in_flight = c.in_flight_requests as f64;
        match self.params.queue_source {
            QueueSource::Waiting => waiting,
            QueueSource::InFlight => in_flight,
            QueueSource::Combined => (waiting + c.running.unwrap_or(0.0).max(0.0)).max(in_flight),
        }
    }
}

impl Scorer for QueueScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(&self, _ctx: &SchedulingContext<'_>, candidates: &[&Candidate]) -> Vec<f64> {
        let q: Vec<f64> = candidates.iter().map(|c| self.queue(c)).collect();
        let max = q.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let min = q.iter().copied().fold(f64::INFINITY, f64::min);
        if max - min <= f64::EPSILON {
            return vec![1.0; q.len()];
        }
        q.iter().map(|x| (max - x) / (max - min)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::ctx;

    fn cand(waiting: f64, running: f64, in_flight: u64) -> Candidate {
        Candidate {
            waiting: Some(waiting),
            running: Some(running),
            in_flight_requests: in_flight,
            ..Candidate::idle(0, "e")
        }
    }

    #[test]
    fn min_max_normalised_waiting_queue() {
        let s = QueueScorer::new(QueueParams {
            queue_source: QueueSource::Waiting,
        });
        let (a, b, c) = (cand(0.0, 9.0, 0), cand(2.0, 0.0, 0), cand(8.0, 0.0, 0));
        let scores = s.score(&ctx(32, 16), &[&a, &b, &c]);
        assert_eq!(scores, vec![1.0, 0.75, 0.0]);
    }

    #[test]
    fn all_equal_scores_one() {
        let s = QueueScorer::new(QueueParams::default());
        let (a, b) = (cand(3.0, 0.0, 0), cand(3.0, 0.0, 0));
        assert_eq!(s.score(&ctx(32, 16), &[&a, &b]), vec![1.0, 1.0]);
    }

    #[test]
    fn combined_sees_in_flight_before_the_scrape_does() {
        // Scrape says both idle, but the router has 4 requests in flight to B.
        let s = QueueScorer::new(QueueParams::default());
        let (a, b, c) = (cand(0.0, 0.0, 0), cand(0.0, 0.0, 4), cand(1.0, 1.0, 1));
        assert_eq!(s.score(&ctx(32, 16), &[&a, &b, &c]), vec![1.0, 0.0, 0.5]);
    }
}
