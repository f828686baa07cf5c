//! Transfer counters, shared by the producer server and the pull client of one engine.
//!
//! Every metric is described once here and registered with [`TransferMetrics::register`] under
//! `kvmesh_p2p_*` names. Label values come from closed enums (never from peer input), so label
//! cardinality is bounded.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::report::{PullOutcome, PullReason};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Direction of moved blocks/bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Pulled from a peer (consumer).
    In,
    /// Served to a peer (producer).
    Out,
}

impl Direction {
    fn label(self) -> &'static str {
        match self {
            Direction::In => "in",
            Direction::Out => "out",
        }
    }
}

/// All P2P counters. Cheap to clone (every metric is an `Arc` inside).
#[derive(Debug, Clone)]
pub struct TransferMetrics {
    /// Pulls by outcome (complete/partial/failed) and reason (`none` when complete).
    pulls: Family<OutcomeLabels, Counter>,
    blocks: Family<DirectionLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    /// Bytes the modelled link carried (time-modelled engines only; see `pacing`).
    modelled_bytes: Family<DirectionLabels, Counter>,
    pull_duration: Histogram,
    /// Producer: connections refused, by reason (fingerprint, auth, not allowed, version).
    refused: Family<ReasonLabels, Counter>,
    /// Either side: connections closed because the peer violated the protocol.
    protocol_errors: Family<DirectionLabels, Counter>,
    /// Consumer: connections dialled vs taken from the pool.
    connections_opened: Counter,
    connections_reused: Counter,
    /// Producer: fetch streams served.
    fetches_served: Counter,
}

impl Default for TransferMetrics {
    fn default() -> Self {
        Self {
            pulls: Family::default(),
            blocks: Family::default(),
            bytes: Family::default(),
            modelled_bytes: Family::default(),
            // 1 ms … ~33 s.
            pull_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            refused: Family::default(),
            protocol_errors: Family::default(),
            connections_opened: Counter::default(),
            connections_reused: Counter::default(),
            fetches_served: Counter::default(),
        }
    }
}

/// Why a producer refuses a peer (`kvmesh_p2p_refused_connections_total{reason}`): at accept
/// (`not_allowed`, `max_connections`: the producer's total, `connection_cap`: the peer address's
/// share), in the handshake (`version`, `fingerprint_mismatch`,
/// `auth_failed`, `encryption_mismatch`, `oversized_frame`: a pre-authentication frame above its
/// bound), after it (`mac_failed`: the connection closes) or per lookup (`pin_quota`: pins beyond
/// the peer's quota refused, the connection stays open) or per fetch (`bad_layout`: a layer-major
/// fetch's segment layout refused, the connection closes).
pub const REFUSE_REASONS: [&str; 11] = [
    "not_allowed",
    "max_connections",
    "version",
    "fingerprint_mismatch",
    "auth_failed",
    "encryption_mismatch",
    "connection_cap",
    "oversized_frame",
    "mac_failed",
    "pin_quota",
    "bad_layout",
];

impl TransferMetrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Register everything under `kvmesh_p2p_*`. The main series start at 0, so a dashboard
    /// (or `rate()`) sees an engine that has not pulled yet rather than no data.
    pub fn register(&self, registry: &mut Registry) {
        let _ = self.pulls.get_or_create(&OutcomeLabels {
            outcome: "complete",
            reason: "none",
        });
        for reason in &PullReason::ALL {
            let _ = self.pulls.get_or_create(&OutcomeLabels {
                outcome: "failed",
                reason: reason.label(),
            });
        }
        for dir in [Direction::In, Direction::Out] {
            let d = DirectionLabels {
                direction: dir.label(),
            };
            let _ = self.blocks.get_or_create(&d);
            let _ = self.bytes.get_or_create(&d);
            let _ = self.modelled_bytes.get_or_create(&d);
        }
        for reason in REFUSE_REASONS {
            let _ = self.refused.get_or_create(&ReasonLabels { reason });
        }
        registry.register(
            "kvmesh_p2p_pulls",
            "P2P pulls by outcome and reason",
            self.pulls.clone(),
        );
        registry.register(
            "kvmesh_p2p_blocks",
            "KV blocks moved over P2P, by direction (in = pulled, out = served)",
            self.blocks.clone(),
        );
        registry.register_with_unit(
            "kvmesh_p2p_payload",
            "KV payload bytes moved over P2P, by direction: wire bytes (a sim engine's payload is \
             scaled down; see kvmesh_p2p_modelled_bytes_total)",
            Unit::Bytes,
            self.bytes.clone(),
        );
        registry.register_with_unit(
            "kvmesh_p2p_modelled",
            "Modelled KV bytes moved over P2P, by direction: what the sim engine's modelled link \
             carried (blocks x block size x the profile's real KV bytes per token), not wire bytes; \
             0 on real engines",
            Unit::Bytes,
            self.modelled_bytes.clone(),
        );
        registry.register_with_unit(
            "kvmesh_p2p_pull_duration",
            "Wall time of one pull, connect to last block",
            Unit::Seconds,
            self.pull_duration.clone(),
        );
        registry.register(
            "kvmesh_p2p_refused_connections",
            "Producer: peers refused (connections, handshakes, unauthenticated frames, pins over quota), by reason",
            self.refused.clone(),
        );
        registry.register(
            "kvmesh_p2p_protocol_errors",
            "Connections closed because the peer broke the protocol (in = consumer saw it, out = producer)",
            self.protocol_errors.clone(),
        );
        registry.register(
            "kvmesh_p2p_connections_opened",
            "Consumer: new connections to producers",
            self.connections_opened.clone(),
        );
        registry.register(
            "kvmesh_p2p_connections_reused",
            "Consumer: pulls served on a pooled connection",
            self.connections_reused.clone(),
        );
        registry.register(
            "kvmesh_p2p_fetches_served",
            "Producer: fetch streams served",
            self.fetches_served.clone(),
        );
    }

    pub(crate) fn record_pull(&self, outcome: &PullOutcome, seconds: f64) {
        let reason = outcome.reason().map_or("none", PullReason::label);
        self.pulls
            .get_or_create(&OutcomeLabels {
                outcome: outcome.label(),
                reason,
            })
            .inc();
        self.pull_duration.observe(seconds);
    }

    pub(crate) fn record_block(&self, dir: Direction, bytes: usize) {
        self.blocks
            .get_or_create(&DirectionLabels {
                direction: dir.label(),
            })
            .inc();
        self.bytes
            .get_or_create(&DirectionLabels {
                direction: dir.label(),
            })
            .inc_by(bytes as u64);
    }

    pub(crate) fn record_modelled(&self, dir: Direction, bytes: u64) {
        self.modelled_bytes
            .get_or_create(&DirectionLabels {
                direction: dir.label(),
            })
            .inc_by(bytes);
    }

    /// `reason` is one of [`REFUSE_REASONS`].
    pub fn record_refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub(crate) fn record_protocol_error(&self, dir: Direction) {
        self.protocol_errors
            .get_or_create(&DirectionLabels {
                direction: dir.label(),
            })
            .inc();
    }

    pub(crate) fn record_connection(&self, reused: bool) {
        if reused {
            &self.connections_reused
        } else {
            &self.connections_opened
        }
        .inc();
    }

    pub(crate) fn record_fetch_served(&self) {
        self.fetches_served.inc();
    }

    /// Pulls recorded with this outcome kind (`"complete"`, `"partial"`, `"failed"`) and reason
    /// label (`"none"`, `"miss"`, …).
    pub fn pulls(&self, outcome: &'static str, reason: &'static str) -> u64 {
        self.pulls
            .get(&OutcomeLabels { outcome, reason })
            .map_or(0, |c| c.get())
    }

    /// Pulls with this reason, partial or failed.
    pub fn pulls_by_reason(&self, reason: &'static str) -> u64 {
        self.pulls("partial", reason) + self.pulls("failed", reason)
    }

    pub fn blocks(&self, dir: Direction) -> u64 {
        self.blocks
            .get(&DirectionLabels {
                direction: dir.label(),
            })
            .map_or(0, |c| c.get())
    }

    pub fn bytes(&self, dir: Direction) -> u64 {
        self.bytes
            .get(&DirectionLabels {
                direction: dir.label(),
            })
            .map_or(0, |c| c.get())
    }

    /// Modelled bytes (see `kvmesh_p2p_modelled_bytes_total`).
    pub fn modelled_bytes(&self, dir: Direction) -> u64 {
        self.modelled_bytes
            .get(&DirectionLabels {
                direction: dir.label(),
            })
            .map_or(0, |c| c.get())
    }

    pub fn refused(&self, reason: &'static str) -> u64 {
        self.refused
            .get(&ReasonLabels { reason })
            .map_or(0, |c| c.get())
    }

    pub fn protocol_errors(&self, dir: Direction) -> u64 {
        self.protocol_errors
            .get(&DirectionLabels {
                direction: dir.label(),
            })
            .map_or(0, |c| c.get())
    }

    pub fn connections_opened(&self) -> u64 {
        self.connections_opened.get()
    }

    pub fn connections_reused(&self) -> u64 {
        self.connections_reused.get()
    }

    pub fn fetches_served(&self) -> u64 {
        self.fetches_served.get()
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    #[test]
    fn an_engine_that_never_pulled_exports_zeros_not_nothing() {
        let m = TransferMetrics::new();
        let mut reg = Registry::default();
        m.register(&mut reg);
        let mut text = String::new();
        encode(&mut text, &reg).unwrap();
        for line in [
            "kvmesh_p2p_pulls_total{outcome=\"complete\",reason=\"none\"} 0",
            "kvmesh_p2p_pulls_total{outcome=\"failed\",reason=\"fingerprint_mismatch\"} 0",
            "kvmesh_p2p_blocks_total{direction=\"in\"} 0",
            "kvmesh_p2p_payload_bytes_total{direction=\"out\"} 0",
            "kvmesh_p2p_modelled_bytes_total{direction=\"in\"} 0",
            "kvmesh_p2p_refused_connections_total{reason=\"auth_failed\"} 0",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn exports_kvmesh_p2p_names() {
        let m = TransferMetrics::new();
        m.record_pull(
            &PullOutcome::Partial {
                reason: PullReason::Miss,
            },
            0.01,
        );
        m.record_pull(&PullOutcome::Complete, 0.02);
        m.record_block(Direction::In, 100);
        m.record_refused("fingerprint_mismatch");
        let mut reg = Registry::default();
        m.register(&mut reg);
        let mut out = String::new();
        encode(&mut out, &reg).unwrap();
        assert!(
            out.contains(r#"kvmesh_p2p_pulls_total{outcome="partial",reason="miss"} 1"#),
            "{out}"
        );
        assert!(
            out.contains(r#"kvmesh_p2p_pulls_total{outcome="complete",reason="none"} 1"#),
            "{out}"
        );
        assert!(
            out.contains(r#"kvmesh_p2p_payload_bytes_total{direction="in"} 100"#),
            "{out}"
        );
        assert!(
            out.contains("kvmesh_p2p_pull_duration_seconds_count 2"),
            "{out}"
        );
        assert!(
            out.contains(
                r#"kvmesh_p2p_refused_connections_total{reason="fingerprint_mismatch"} 1"#
            )
        );
        assert_eq!(m.pulls_by_reason("miss"), 1);
        assert_eq!(m.blocks(Direction::In), 1);
    }
}
