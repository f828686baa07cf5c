//! Endpoint rules shared by publisher and subscriber: `*` means bind on all interfaces.

use crate::EventsError;

/// Whether a socket binds or connects to an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointMode {
    Bind,
    Connect,
}

/// Translates a vLLM-style endpoint into what the `zeromq` crate accepts, and says whether vLLM
/// would bind it (`*` host) or connect to it.
///
/// `tcp://*:5557` → (`tcp://0.0.0.0:5557`, Bind); `tcp://127.0.0.1:5557` → (same, Connect);
/// `tcp://127.0.0.1:0` → (same, Bind) — an ephemeral port can only be bound.
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
        if port == "0" {
            // Nobody can be connected to on port 0: it asks for an ephemeral bind (tests and
            // local fleets use `tcp://127.0.0.1:0`).
            return Ok((endpoint.to_owned(), EndpointMode::Bind));
        }
        Ok((endpoint.to_owned(), EndpointMode::Connect))
    } else if endpoint.starts_with("ipc://") {
        Ok((endpoint.to_owned(), EndpointMode::Connect))
    } else {
        Err(invalid("expected tcp://host:port or ipc://path"))
    }
}

/// Makes a bound endpoint reported by the `zeromq` crate usable by a local peer: a wildcard
/// address is replaced by loopback.
pub(crate) fn connectable(bound: &str) -> String {
    bound.replacen("tcp://0.0.0.0:", "tcp://127.0.0.1:", 1)
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
    fn nonsense_is_refused_with_a_reason() {
        for bad in [
            "",
            "tcp://",
            "tcp://host",
            "tcp://h:x",
            "udp://h:1",
            "inproc://a",
        ] {
            assert!(resolve_endpoint(bad).is_err(), "{bad}");
        }
    }
}
