//! Connection admission for every listening socket of kvmesh (HTTP, KV-event PUB and replay,
//! bound SUB): at most `max_total` open connections, and at most `max_per_source` from one source
//! address, decided at accept time before a byte is read. No I/O: the servers call it.
//!
//! Why per source and not only in total: 20,000 connections trickling request bodies from one
//! host exhausted the router's file descriptors (issue 37). A total cap alone keeps the process
//! alive but hands every slot to whoever opens connections fastest; a per-source cap leaves room
//! for everyone else. IPv6 sources are grouped by /64, the block one host is usually given, so one
//! host cannot take a slot per address; IPv4-mapped IPv6 addresses count as their IPv4 address.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Why a connection was refused (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Every connection slot is taken.
    MaxConnections,
    /// The source already holds its share of slots.
    PerSource,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::MaxConnections => "max_connections",
            Refusal::PerSource => "max_connections_per_ip",
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

/// Counts open connections in total and per source.
#[derive(Debug, Clone)]
pub struct ConnectionGate {
    max_total: usize,
    /// 0 = no per-source limit.
    max_per_source: usize,
    counts: Arc<Mutex<Counts>>,
}

/// An admitted connection's slot; released when dropped.
#[derive(Debug)]
pub struct ConnectionSlot {
    source: IpAddr,
    counts: Arc<Mutex<Counts>>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut c = lock(&self.counts);
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                c.by_source.remove(&self.source);
            }
        }
    }
}

/// The address a source is counted under: IPv4 as is (IPv4-mapped IPv6 included), IPv6 by /64.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// The lock only guards counter updates that cannot panic, so a poisoned one is still consistent.
fn lock(m: &Mutex<Counts>) -> MutexGuard<'_, Counts> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ConnectionGate {
    pub fn new(max_total: usize, max_per_source: usize) -> ConnectionGate {
        ConnectionGate {
            max_total,
            max_per_source,
            counts: Arc::default(),
        }
    }

    /// A slot for a connection from `peer`, or why not.
    pub fn admit(&self, peer: IpAddr) -> Result<ConnectionSlot, Refusal> {
        let source = source_key(peer);
        let mut c = lock(&self.counts);
        if c.total >= self.max_total {
            return Err(Refusal::MaxConnections);
        }
        let from_source = c.by_source.get(&source).copied().unwrap_or(0);
        if self.max_per_source > 0 && from_source >= self.max_per_source {
            return Err(Refusal::PerSource);
        }
        c.total += 1;
        c.by_source.insert(source, from_source + 1);
        Ok(ConnectionSlot {
            source,
            counts: Arc::clone(&self.counts),
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        lock(&self.counts).total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_source_at_its_share_is_refused_while_others_get_in() {
        let gate = ConnectionGate::new(4, 2);
        let a1 = gate.admit(ip("10.0.0.1")).unwrap();
        let _a2 = gate.admit(ip("10.0.0.1")).unwrap();
        assert_eq!(gate.admit(ip("10.0.0.1")).unwrap_err(), Refusal::PerSource);
        let _b1 = gate.admit(ip("10.0.0.2")).unwrap();
        let _b2 = gate.admit(ip("10.0.0.2")).unwrap();
        assert_eq!(
            gate.admit(ip("10.0.0.3")).unwrap_err(),
            Refusal::MaxConnections
        );
        drop(a1);
        assert_eq!(gate.open(), 3);
        assert!(
            gate.admit(ip("10.0.0.3")).is_ok(),
            "a released slot is free"
        );
    }

    #[test]
    fn ipv6_sources_share_their_64_and_mapped_v4_counts_as_v4() {
        let gate = ConnectionGate::new(100, 1);
        let _a = gate.admit(ip("2001:db8:1:2::1")).unwrap();
        assert_eq!(
            gate.admit(ip("2001:db8:1:2:ffff::9")).unwrap_err(),
            Refusal::PerSource
        );
        assert!(gate.admit(ip("2001:db8:1:3::1")).is_ok());
        let _v4 = gate.admit(ip("192.0.2.7")).unwrap();
        assert_eq!(
            gate.admit(ip("::ffff:192.0.2.7")).unwrap_err(),
            Refusal::PerSource
        );
    }

    #[test]
    fn zero_means_no_per_source_limit() {
        let gate = ConnectionGate::new(3, 0);
        let _held: Vec<_> = (0..3).map(|_| gate.admit(ip("::1")).unwrap()).collect();
        assert_eq!(gate.admit(ip("::1")).unwrap_err(), Refusal::MaxConnections);
    }
}
