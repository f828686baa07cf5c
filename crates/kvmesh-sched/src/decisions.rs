//! A bounded ring of recent decisions for `GET /debug/decisions?last=N`.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::Serialize;

use crate::scheduler::Decision;

/// One request's decision as explained to operators.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    pub request_id: String,
    /// Unix time (s) of the decision.
    pub at: f64,
    pub path: String,
    pub prompt_tokens: usize,
    pub blocks: usize,
    /// Tokenize + keys + lookup + pipeline.
    pub scheduling_us: u64,
    /// Time held by the admission queue before placement (ms; 0 when placed on arrival).
    pub held_ms: f64,
    /// `local_hit`, `pull_named` or `cold`.
    pub outcome: &'static str,
    #[serde(flatten)]
    pub decision: Decision,
}

pub struct DecisionLog {
    ring: Mutex<VecDeque<Arc<DecisionRecord>>>,
    capacity: usize,
}

impl DecisionLog {
    pub fn new(capacity: usize) -> Self {
        DecisionLog {
            ring: Mutex::new(VecDeque::with_capacity(capacity.min(4096))),
            capacity: capacity.max(1),
        }
    }

    pub fn push(&self, r: Arc<DecisionRecord>) {
        let mut ring = self.ring.lock();
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(r);
    }

    /// The newest `n`, oldest first.
    pub fn last(&self, n: usize) -> Vec<Arc<DecisionRecord>> {
        let ring = self.ring.lock();
        ring.iter()
            .skip(ring.len().saturating_sub(n))
            .cloned()
            .collect()
    }
}
