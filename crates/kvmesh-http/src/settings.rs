//! The `http:` section of the router's YAML: connection caps and body bounds, each defaulting to
//! [`HttpLimits::default`]. The engine takes the same settings as `--http-*` flags.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::HttpLimits;

/// Connection caps and request-body bounds of an HTTP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// Open client connections at most; more are answered 503 and closed at accept.
    pub max_connections: usize,
    /// Open connections from one source address (IPv6: one /64) at most; 0 = no per-source cap.
    pub max_connections_per_ip: usize,
    /// A request body must be complete this long after its headers, plus the time its bytes earn
    /// at `body_min_bytes_per_second`.
    #[serde(deserialize_with = "duration", serialize_with = "duration_text")]
    pub body_timeout: Duration,
    /// Each byte received extends a body's deadline by `1 / body_min_bytes_per_second` seconds.
    pub body_min_bytes_per_second: u64,
    /// Bytes of request bodies all connections together may hold; past it, 503 with
    /// `Retry-After`.
    pub body_memory_bytes: usize,
}

impl Default for HttpSettings {
    fn default() -> Self {
        let d = HttpLimits::default();
        HttpSettings {
            max_connections: d.max_connections,
            max_connections_per_ip: d.max_connections_per_ip,
            body_timeout: d.body_timeout,
            body_min_bytes_per_second: d.body_min_rate,
            body_memory_bytes: d.body_memory,
        }
    }
}

impl HttpSettings {
    /// `base` with these settings applied.
    pub fn apply(&self, base: HttpLimits) -> HttpLimits {
        HttpLimits {
            max_connections: self.max_connections,
            max_connections_per_ip: self.max_connections_per_ip,
            body_timeout: self.body_timeout,
            body_min_rate: self.body_min_bytes_per_second,
            body_memory: self.body_memory_bytes,
            ..base
        }
    }
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(serde::de::Error::custom)
}

fn duration_text<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_overrides_what_it_names_and_keeps_the_rest() {
        let s: HttpSettings =
            serde_norway::from_str("max_connections: 64\nbody_timeout: 2s\n").unwrap();
        assert_eq!(s.max_connections, 64);
        assert_eq!(s.body_timeout, Duration::from_secs(2));
        assert_eq!(
            s.max_connections_per_ip,
            HttpSettings::default().max_connections_per_ip
        );
        let limits = s.apply(HttpLimits::default());
        assert_eq!(limits.max_connections, 64);
        assert_eq!(limits.body_timeout, Duration::from_secs(2));
        assert!(serde_norway::from_str::<HttpSettings>("max_conections: 1\n").is_err());
        let round: HttpSettings =
            serde_norway::from_str(&serde_norway::to_string(&s).unwrap()).unwrap();
        assert_eq!(round, s);
    }
}
