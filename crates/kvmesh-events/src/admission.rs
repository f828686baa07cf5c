//! Who may hold a connection to a bound socket (PUB, replay ROUTER, bound SUB): an optional
//! allow-list of source networks, then a cap in total and per source address.
//!
//! Why an allow-list and not slots reserved for known subscribers: ZMTP's NULL mechanism (all
//! vLLM's publisher speaks; see `docs/protocols.md#who-may-connect`) carries no identity, so the
//! only thing that tells a router from anyone else is its address — and once addresses are
//! checked, refusing the others outright is simpler and stronger than reserving room for the
//! known ones. Without an allow-list every address is accepted (vLLM's behaviour), within the
//! caps.

use std::net::IpAddr;

use ipnet::IpNet;
use kvmesh_core::conn_gate::{ConnectionGate, ConnectionSlot, Refusal};

use crate::EventsError;

/// Source networks allowed to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedPeers {
    nets: Vec<IpNet>,
}

impl AllowedPeers {
    /// From `10.0.0.0/8`, `192.168.1.7`, `fd00::/8`, `::1` and the like (addresses, not names).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<AllowedPeers, EventsError> {
        let nets = entries
            .iter()
            .map(|e| {
                let e = e.as_ref().trim();
                e.parse::<IpNet>()
                    .or_else(|_| e.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| EventsError::InvalidAllowedPeer {
                        entry: e.to_owned(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AllowedPeers { nets })
    }

    /// Exactly these addresses.
    pub fn addresses(addrs: impl IntoIterator<Item = IpAddr>) -> AllowedPeers {
        AllowedPeers {
            nets: addrs.into_iter().map(IpNet::from).collect(),
        }
    }

    /// Whether `ip` (an IPv4-mapped IPv6 address counts as its IPv4 address) is in a listed
    /// network.
    pub fn allows(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.nets.iter().any(|n| n.contains(&ip))
    }

    /// The listed networks, for log lines.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self.nets.iter().map(IpNet::to_string).collect();
        parts.join(", ")
    }
}

/// Why a connection was closed at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    NotAllowed,
    Full(Refusal),
}

/// The accept-time decision of one bound socket.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    gate: ConnectionGate,
    allowed: Option<AllowedPeers>,
}

/// What `ipc://` peers (no address) are counted under: all of them are one local source.
const LOCAL_SOURCE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

impl Admission {
    pub(crate) fn new(max: usize, per_source: usize, allowed: Option<AllowedPeers>) -> Admission {
        Admission {
            gate: ConnectionGate::new(max, per_source),
            allowed,
        }
    }

    /// A slot for a peer from `source` (`None`: a Unix-domain peer, which the socket file's
    /// permissions guard, so the allow-list does not apply).
    pub(crate) fn admit(&self, source: Option<IpAddr>) -> Result<ConnectionSlot, Refused> {
        if let (Some(allowed), Some(ip)) = (&self.allowed, source)
            && !allowed.allows(ip)
        {
            return Err(Refused::NotAllowed);
        }
        self.gate
            .admit(source.unwrap_or(LOCAL_SOURCE))
            .map_err(Refused::Full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_and_addresses_are_matched_and_names_refused() {
        let a = AllowedPeers::parse(&["10.1.0.0/16", "127.0.0.1", "fd00::/8"]).unwrap();
        assert!(a.allows(ip("10.1.200.3")));
        assert!(!a.allows(ip("10.2.0.1")));
        assert!(a.allows(ip("127.0.0.1")));
        assert!(a.allows(ip("::ffff:127.0.0.1")), "mapped IPv4");
        assert!(!a.allows(ip("127.0.0.2")));
        assert!(a.allows(ip("fd12::1")));
        assert!(AllowedPeers::parse(&["engine-0.local"]).is_err());
        assert!(AllowedPeers::parse(&["10.0.0.0/33"]).is_err());
    }

    #[test]
    fn the_allow_list_comes_before_the_caps() {
        let adm = Admission::new(2, 1, Some(AllowedPeers::parse(&["127.0.0.0/8"]).unwrap()));
        assert_eq!(
            adm.admit(Some(ip("192.0.2.1"))).unwrap_err(),
            Refused::NotAllowed
        );
        let _a = adm.admit(Some(ip("127.0.0.1"))).unwrap();
        assert_eq!(
            adm.admit(Some(ip("127.0.0.1"))).unwrap_err(),
            Refused::Full(Refusal::PerSource)
        );
        let _ipc = adm.admit(None).unwrap();
        assert_eq!(
            adm.admit(Some(ip("127.0.0.2"))).unwrap_err(),
            Refused::Full(Refusal::MaxConnections)
        );
    }
}
