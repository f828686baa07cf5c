//! `round-robin-picker` (baseline): ignores scores, cycles through the candidates in endpoint-id
//! order. The counter is the picker's only state (atomic; no lock on the request path).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::Picker;

pub const TYPE: &str = "round-robin-picker";

#[derive(Default)]
pub struct RoundRobinPicker {
    next: AtomicUsize,
}

impl Picker for RoundRobinPicker {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn pick(
        &self,
        _ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        _scores: &[f64],
        _rng: &mut dyn rand::RngCore,
    ) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.sort_by_key(|&i| candidates[i].endpoint);
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Some(order[turn % order.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::{ctx, rng};

    #[test]
    fn cycles_in_endpoint_order() {
        let c = [
            Candidate::idle(5, "b"),
            Candidate::idle(2, "a"),
            Candidate::idle(9, "c"),
        ];
        let refs: Vec<&Candidate> = c.iter().collect();
        let p = RoundRobinPicker::default();
        let picks: Vec<u32> = (0..6)
            .map(|_| {
                c[p.pick(&ctx(32, 16), &refs, &[0.0; 3], &mut rng(1))
                    .expect("pick")]
                .endpoint
                .0
            })
            .collect();
        assert_eq!(picks, vec![2, 5, 9, 2, 5, 9]);
    }
}
