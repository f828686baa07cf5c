//! Endpoint rules shared by publisher and subscriber: which side binds, and on what.
//!
//! vLLM 0.32 (`ZmqEventPublisher._is_bind_endpoint`) binds an endpoint containing `*` or `::`, or
//! using `ipc://`, and connects to anything else; kvmesh's publisher follows it exactly, plus port
//! `0` (an ephemeral port can only be bound). `tcp://*:PORT` therefore means **all interfaces**, as
//! it does for vLLM; listening on loopback only takes a concrete host and an explicit bind
//! (`PublisherConfig::bind`, the engine's `"bind": true`, the router's `kv_events: {bind: true}`).

use crate::EventsError;

/// Whether a socket binds or connects to an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointMode {
    Bind,
    Connect,
}

impl EndpointMode {
    /// `"binds"` / `"connects to"`, for startup lines and logs.
    pub fn verb(self) -> &'static str {
        match self {
            EndpointMode::Bind => "binds",
            EndpointMode::Connect => "connects to",
        }
    }
}

/// Translates a vLLM-style endpoint into a concrete address, and says whether vLLM's publisher
/// would bind it or connect to it.
///
/// `tcp://*:5557` → (`tcp://0.0.0.0:5557`, Bind); `tcp://127.0.0.1:5557` → (same, Connect);
/// `tcp://127.0.0.1:0` → (same, Bind); `tcp://[::]:5557` and `ipc:///tmp/kv` → (same, Bind).
/// Only `tcp://` and `ipc://` are accepted; `inproc://` has no meaning across processes.
pub fn resolve_endpoint(endpoint: &str) -> Result<(String, EndpointMode), EventsError> {
    let invalid = |reason: &str| EventsError::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        reason: reason.to_owned(),
    };
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| invalid("missing `:port`"))?;
        if port != "*" && port.parse::<u16>().is_err() {
            return Err(invalid("port is not a number"));
        }
        if host.is_empty() {
            return Err(invalid("missing host"));
        }
        if host == "*" {
            let port = if port == "*" { "0" } else { port };
            return Ok((format!("tcp://0.0.0.0:{port}"), EndpointMode::Bind));
        }
        if port == "*" {
            return Err(invalid(
                "a wildcard port only makes sense with a wildcard host",
            ));
        }
        if host.starts_with('[') != host.ends_with(']') {
            return Err(invalid("unbalanced brackets around an IPv6 host"));
        }
        // vLLM binds whatever contains `::`; nobody can be connected to on port 0.
        if host.contains("::") || port == "0" {
            return Ok((endpoint.to_owned(), EndpointMode::Bind));
        }
        Ok((endpoint.to_owned(), EndpointMode::Connect))
    } else if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(invalid("missing socket path"));
        }
        Ok((endpoint.to_owned(), EndpointMode::Bind))
    } else {
        Err(invalid("expected tcp://host:port or ipc://path"))
    }
}

/// What a subscriber does with an endpoint when not told to bind: it binds only what cannot be
/// connected to (a wildcard host, port 0) and connects to everything else, `ipc://` included
/// (vLLM's publisher binds `ipc://`).
pub fn subscriber_mode(endpoint: &str) -> Result<(String, EndpointMode), EventsError> {
    let (resolved, _) = resolve_endpoint(endpoint)?;
    let wildcard = resolved.starts_with("tcp://0.0.0.0:")
        || resolved.starts_with("tcp://[::]:")
        || resolved.ends_with(":0");
    let mode = if wildcard && resolved.starts_with("tcp://") {
        EndpointMode::Bind
    } else {
        EndpointMode::Connect
    };
    Ok((resolved, mode))
}

/// Makes a bound endpoint usable by a local peer: a wildcard address is replaced by loopback.
pub(crate) fn connectable(bound: &str) -> String {
    bound
        .replacen("tcp://0.0.0.0:", "tcp://127.0.0.1:", 1)
        .replacen("tcp://[::]:", "tcp://[::1]:", 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_host_binds_on_all_interfaces() {
        let (ep, mode) = resolve_endpoint("tcp://*:5557").expect("valid");
        assert_eq!(ep, "tcp://0.0.0.0:5557");
        assert_eq!(mode, EndpointMode::Bind);
    }

    #[test]
    fn concrete_host_connects() {
        let (ep, mode) = resolve_endpoint("tcp://127.0.0.1:5557").expect("valid");
        assert_eq!(ep, "tcp://127.0.0.1:5557");
        assert_eq!(mode, EndpointMode::Connect);
    }

    #[test]
    fn port_zero_binds_an_ephemeral_port() {
        let (ep, mode) = resolve_endpoint("tcp://127.0.0.1:0").expect("valid");
        assert_eq!(ep, "tcp://127.0.0.1:0");
        assert_eq!(mode, EndpointMode::Bind);
    }

    #[test]
    fn vllm_032_binds_ipc_and_ipv6_wildcards() {
        assert_eq!(
            resolve_endpoint("ipc:///tmp/kv").expect("valid").1,
            EndpointMode::Bind
        );
        assert_eq!(
            resolve_endpoint("tcp://[::]:5557").expect("valid").1,
            EndpointMode::Bind
        );
        // ...but a subscriber connects to an ipc path and binds only wildcards.
        assert_eq!(
            subscriber_mode("ipc:///tmp/kv").expect("valid").1,
            EndpointMode::Connect
        );
        assert_eq!(
            subscriber_mode("tcp://*:5557").expect("valid").1,
            EndpointMode::Bind
        );
        assert_eq!(
            subscriber_mode("tcp://127.0.0.1:5557").expect("valid").1,
            EndpointMode::Connect
        );
        assert_eq!(connectable("tcp://0.0.0.0:9"), "tcp://127.0.0.1:9");
    }

    #[test]
    fn nonsense_is_refused_with_a_reason() {
        for bad in [
            "",
            "tcp://",
            "tcp://host",
            "tcp://h:x",
            "udp://h:1",
            "inproc://a",
            "ipc://",
            "tcp://[::1:5",
        ] {
            assert!(resolve_endpoint(bad).is_err(), "{bad}");
        }
    }
}
