//! The HTTP server's own metrics (`kvmesh_http_*`), registered by the server that owns them: the
//! router into its registry, the engine appended to its `/metrics` text.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: &'static str,
}

/// Counters and gauges of one HTTP server (cheap to clone: the metrics are shared).
#[derive(Clone, Debug, Default)]
pub struct HttpStats {
    /// Connections open now.
    pub(crate) open_connections: Gauge,
    /// Connections closed at accept, by reason (`max_connections`, `max_connections_per_ip`).
    pub(crate) refused_connections: Family<ReasonLabel, Counter>,
    /// Requests answered before their body was read, by reason (`too_large`, `memory_budget`,
    /// `deadline`, `stalled`, `read_error`).
    pub(crate) refused_bodies: Family<ReasonLabel, Counter>,
    /// Bytes of request bodies held now (reserved from the budget); the budget's own counter.
    pub(crate) body_bytes_in_flight: Gauge,
}

impl HttpStats {
    /// Registers every series into `registry` (the router's).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvmesh_http_open_connections",
            "Client connections open now",
            self.open_connections.clone(),
        );
        registry.register(
            "kvmesh_http_refused_connections",
            "Client connections closed at accept, by reason (max_connections, max_connections_per_ip)",
            self.refused_connections.clone(),
        );
        registry.register(
            "kvmesh_http_refused_bodies",
            "Requests answered without reading their whole body, by reason (too_large, memory_budget, deadline, stalled, read_error)",
            self.refused_bodies.clone(),
        );
        registry.register(
            "kvmesh_http_body_bytes_in_flight",
            "Bytes of request bodies held now (the body memory budget's use)",
            self.body_bytes_in_flight.clone(),
        );
    }

    /// Appends these series to a Prometheus/OpenMetrics text another registry produced (the
    /// engine's), keeping a single `# EOF` at the end.
    pub fn append_to(&self, text: &mut String) {
        let mut registry = Registry::default();
        self.register(&mut registry);
        let mut ours = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut ours, &registry);
        if let Some(body) = text.strip_suffix("# EOF\n") {
            text.truncate(body.len());
        }
        text.push_str(&ours);
    }

    /// Connections refused so far for `reason` (tests, debugging).
    pub fn refused_connections(&self, reason: &'static str) -> u64 {
        self.refused_connections
            .get_or_create(&ReasonLabel { reason })
            .get()
    }

    /// Bodies refused so far for `reason`.
    pub fn refused_bodies(&self, reason: &'static str) -> u64 {
        self.refused_bodies
            .get_or_create(&ReasonLabel { reason })
            .get()
    }

    pub(crate) fn refuse_connection(&self, reason: &'static str) {
        self.refused_connections
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub(crate) fn refuse_body(&self, reason: &'static str) {
        self.refused_bodies
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_text_ends_with_one_eof() {
        let stats = HttpStats::default();
        stats.refuse_connection("max_connections");
        let mut text = "# HELP a x\n# TYPE a gauge\na 1\n# EOF\n".to_owned();
        stats.append_to(&mut text);
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"));
        assert!(text.starts_with("# HELP a x"));
        assert!(
            text.contains("kvmesh_http_refused_connections_total{reason=\"max_connections\"} 1"),
            "{text}"
        );
    }
}
