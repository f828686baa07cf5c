//! From a scheduling decision to the `remote_kv_source` an engine is told to pull from — the one
//! translation, used by the aggregated route and by the P/D route's prefill leg alike.
//!
//! The decision names its source by endpoint id ([`P2pDecision::source`]); here it becomes that
//! endpoint's P2P address plus the request id the producer logs (`docs/protocols.md`, keys as in
//! vLLM's P2P tier and llm-d); and, once the engine answered, what its `x-kvmesh-pull` report says
//! about the source ([`judge_pull`], the verdict itself in `route::reputation`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use kvmesh_core::{PULL_FEEDBACK_HEADER, PullFeedback, RemoteKvSource};
use kvmesh_index::EndpointId;
use kvmesh_sched::cost_model::CostModel;
use kvmesh_sched::plugins::p2p_source_producer::P2pDecision;
use kvmesh_sched::predict::contended_pull_ms;

use crate::fleet::endpoints::Endpoint;
use crate::fleet::load::LoadGuard;
use crate::metrics::{SourceLabel, SourceReason};
use crate::route::candidates::by_id;
use crate::route::reputation::{Verdict, verdict};
use crate::state::RouterState;

/// A pull the router names: the source endpoint and what the computing engine receives.
#[derive(Clone)]
pub(crate) struct NamedSource {
    pub endpoint: Arc<Endpoint>,
    pub params: RemoteKvSource,
    /// Tokens the decision expects the pull to bring (the source's lead over the computing end).
    pub delta_tokens: u64,
    /// The prefix the source advertised in its CPU tier (tokens): what a pull from it should
    /// reach, which its reputation is judged by.
    pub advertised_tokens: u64,
    /// The decision's predicted pull time (ms), when its policy priced the pull.
    pub predicted_pull_ms: Option<f64>,
}

/// How much longer than predicted a pull may take before the router stops counting it as
/// landing. Pulls can be slower than the cost model says (default rates until it has learned the
/// link's, transfers joining the link later). Counting one too long only makes the router a
/// little more careful about what it puts ahead of it; too short lets a long prefill overtake a
/// pull still on the wire.
const LANDING_SLACK: f64 = 1.5;

impl NamedSource {
    /// `host:port`, as llm-d's `x-kv-cache-source-host-port` header carries it.
    pub fn host_port(&self) -> String {
        format!("{}:{}", self.params.remote_host, self.params.remote_port)
    }

    /// Counts this pull on `guard` (the request's load on `dest`): a transfer on both ends' links
    /// until its first byte, and landing until it should have landed. Returns the transfers
    /// already on the busier end ([`LoadGuard::track_pull`]).
    pub fn track(&self, guard: &mut LoadGuard, cost_model: &CostModel, dest: EndpointId) -> u64 {
        let sharing = guard.track_pull(&self.endpoint.load);
        guard.expect_landing_by(self.landing_deadline(cost_model, dest, sharing, Instant::now()));
        sharing
    }

    /// The cost model's time (ms) for this pull into `dest` with `sharing` transfers already on
    /// its links.
    pub fn cost_model_pull_ms(
        &self,
        cost_model: &CostModel,
        dest: EndpointId,
        sharing: u64,
    ) -> f64 {
        let alone = cost_model.predict_pull_ms(self.endpoint.id, dest, self.delta_tokens);
        contended_pull_ms(alone, cost_model.params().pull_floor_ms, sharing)
    }

    /// The pull time the engine is told (`kvmesh_predicted_pull_ms`, from which it derives the
    /// pull's deadline): the decision's own price when its policy made one, else the cost
    /// model's for the transfers (`sharing`) already on the pull's links. None when neither is
    /// a finite positive number: the engine then keeps its flat budget.
    pub fn predicted_ms(
        &self,
        cost_model: &CostModel,
        dest: EndpointId,
        sharing: u64,
    ) -> Option<f64> {
        let ms = self
            .predicted_pull_ms
            .unwrap_or_else(|| self.cost_model_pull_ms(cost_model, dest, sharing));
        (ms.is_finite() && ms > 0.0).then_some(ms)
    }

    /// When the pull into `dest`, named at `now`, should have landed: the cost model's time for
    /// its tokens stretched by the `sharing` transfers already on its links, with slack.
    fn landing_deadline(
        &self,
        cost_model: &CostModel,
        dest: EndpointId,
        sharing: u64,
        now: Instant,
    ) -> Instant {
        let ms = self.cost_model_pull_ms(cost_model, dest, sharing) * LANDING_SLACK;
        // A non-finite or absurd prediction must not pin the pull as landing forever.
        let ms = if ms.is_finite() {
            ms.clamp(0.0, 60_000.0)
        } else {
            0.0
        };
        now + Duration::from_secs_f64(ms / 1000.0)
    }
}

/// The source `p2p` names among `endpoints`, as parameters for the computing engine. A source that
/// is no longer listed or has no P2P address is not named, and the decision is corrected to say
/// so: nothing is sent, so `/debug/decisions` must not claim a pull.
pub(crate) fn name_source(
    p2p: Option<&mut P2pDecision>,
    endpoints: &[Arc<Endpoint>],
    request_id: &str,
) -> Option<NamedSource> {
    let d = p2p?;
    let id = d.source?;
    let named = by_id(endpoints, id).and_then(|ep| {
        let (host, port) = ep.spec.p2p_host_port()?;
        Some(NamedSource {
            endpoint: Arc::clone(ep),
            params: RemoteKvSource {
                kv_request_id: request_id.to_owned(),
                remote_host: host,
                remote_port: port,
            },
            delta_tokens: d.delta_tokens.max(0) as u64,
            advertised_tokens: d.source_tokens,
            predicted_pull_ms: d.predicted_pull_ms,
        })
    });
    if named.is_none() {
        d.why = format!(
            "{} (not named: {} has no p2p address)",
            d.why,
            d.source_endpoint.as_deref().unwrap_or("?")
        );
        d.source = None;
        d.source_endpoint = None;
    }
    named
}

/// Reads the engine's report on the pull `src` was named for (the `x-kvmesh-pull` response
/// header, sent before the first byte, streamed or not) and records the verdict against `src`:
/// reputation, `kvmesh_router_p2p_source_penalties_total` / `_served_total`, and a log line when
/// the source becomes excluded.
pub(crate) fn judge_pull(s: &RouterState, src: &NamedSource, headers: &HeaderMap) {
    let Some(fb) = headers
        .get(PULL_FEEDBACK_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(PullFeedback::parse)
    else {
        return;
    };
    let Some(v) = verdict(&fb, src.advertised_tokens, s.config.block_size as u64) else {
        return;
    };
    let source = src.endpoint.name.to_string();
    match v {
        Verdict::Served => {
            s.metrics
                .p2p_source_served
                .get_or_create(&SourceLabel { source })
                .inc();
        }
        Verdict::Failed(reason) => {
            s.metrics
                .p2p_source_penalties
                .get_or_create(&SourceReason {
                    source,
                    reason: reason.label(),
                })
                .inc();
        }
    }
    let was = s.reputation.standing(src.endpoint.id);
    let now = s.reputation.record(src.endpoint.id, v);
    if now.excluded && !was.excluded {
        tracing::warn!(
            source = %src.endpoint.name,
            failure_probability = now.failure_probability,
            last = %fb,
            "P2P source excluded: its pulls keep falling short of what it advertises"
        );
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_index::EndpointId;

    use super::*;
    use crate::config::EndpointSpec;

    fn endpoint(id: u32, name: &str, p2p: Option<&str>) -> Arc<Endpoint> {
        let spec = EndpointSpec {
            name: name.to_owned(),
            url: format!("http://127.0.0.1:{}", 8100 + id),
            kv_events: None,
            p2p: p2p.map(str::to_owned),
            role: Default::default(),
            kv_group: None,
        };
        Arc::new(Endpoint::new(EndpointId(id), spec))
    }

    fn decision(source: Option<u32>) -> P2pDecision {
        P2pDecision {
            source: source.map(EndpointId),
            source_endpoint: source.map(|i| format!("e{i}")),
            skipped: None,
            source_tokens: 512,
            computing_tokens: 0,
            delta_tokens: 512,
            predicted_recompute_ms: None,
            predicted_pull_ms: None,
            band: Vec::new(),
            penalised_sources: Vec::new(),
            why: "pull".to_owned(),
        }
    }

    #[test]
    fn the_named_endpoint_is_found_by_id_wherever_it_is_listed() {
        // The decision was made over a different list (P/D: prefill + decode candidates); the id
        // still finds the right endpoint.
        let list = vec![
            endpoint(7, "e7", Some("10.0.0.7:7100")),
            endpoint(3, "e3", Some("10.0.0.3:7100")),
        ];
        let mut d = decision(Some(3));
        let named = name_source(Some(&mut d), &list, "req-9").expect("named");
        assert_eq!(named.endpoint.name.as_ref(), "e3");
        assert_eq!(named.params.remote_host, "10.0.0.3");
        assert_eq!(named.params.remote_port, 7100);
        assert_eq!(named.params.kv_request_id, "req-9");
        assert_eq!(named.host_port(), "10.0.0.3:7100");
        assert_eq!(named.delta_tokens, 512);
        assert_eq!(d.source, Some(EndpointId(3)), "the record keeps its source");
    }

    #[test]
    fn a_source_without_p2p_address_is_not_named_and_the_record_says_so() {
        let list = vec![endpoint(1, "e1", None)];
        let mut d = decision(Some(1));
        assert!(name_source(Some(&mut d), &list, "r").is_none());
        assert_eq!(d.source, None);
        assert!(
            d.why.contains("not named: e1 has no p2p address"),
            "{}",
            d.why
        );
        let mut gone = decision(Some(5));
        assert!(name_source(Some(&mut gone), &list, "r").is_none());
        assert_eq!(gone.source_endpoint, None);
        let mut none = decision(None);
        assert!(name_source(Some(&mut none), &list, "r").is_none());
        assert_eq!(none.why, "pull", "no source named: nothing to correct");
    }
}
