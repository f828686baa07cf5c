//! The producer's defences against one peer taking everything: which addresses may connect
//! ([`IpNet`]), how many connections and pinned blocks each address may hold ([`PeerTable`]),
//! and a log that names each refused peer once rather than once per packet ([`RefusalLog`]).
//!
//! Peers are told apart by IP address: with a shared secret every engine proves the same
//! secret, so the address is the only identity a quota can hang on. IPv4-mapped IPv6 addresses
//! count as their IPv4 address, so a dual-stack listener cannot be used to double a quota.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::metrics::TransferMetrics;

/// An address or network consumers may connect from: `10.0.0.7`, `10.0.0.0/8`, `fd00::/8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid consumer address {0:?} (expected an IP address or a network like 10.0.0.0/8)")]
pub struct IpNetError(pub String);

impl IpNet {
    /// Whether `ip` is in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            _ => false,
        }
    }
}

/// Whether the first `bits` bits of `a` and `b` agree.
fn prefix_eq(a: &[u8], b: &[u8], bits: u8) -> bool {
    let bits = usize::from(bits);
    let (whole, rest) = (bits / 8, bits % 8);
    if a.get(..whole) != b.get(..whole) {
        return false;
    }
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    match (a.get(whole), b.get(whole)) {
        (Some(x), Some(y)) => x & mask == y & mask,
        _ => false,
    }
}

impl From<IpAddr> for IpNet {
    fn from(ip: IpAddr) -> Self {
        let ip = ip.to_canonical();
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        Self { addr: ip, prefix }
    }
}

impl FromStr for IpNet {
    type Err = IpNetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let bad = || IpNetError(s.to_owned());
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p.parse::<u8>().map_err(|_| bad())?)),
            None => (s, None),
        };
        let addr = addr
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .map_err(|_| bad())?
            .to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        if prefix > max {
            return Err(bad());
        }
        Ok(Self { addr, prefix })
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// What one address holds right now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct PeerUse {
    connections: usize,
    pinned: usize,
}

/// Connections and pinned blocks per peer address, each under its cap. An entry lives while
/// the address holds anything, so the table is bounded by the live connections.
#[derive(Debug)]
pub(crate) struct PeerTable {
    peers: Mutex<HashMap<IpAddr, PeerUse>>,
    max_connections: usize,
    max_pinned: usize,
}

/// One admitted connection; dropping it frees its slot.
#[derive(Debug)]
pub(crate) struct PeerSlot {
    table: Arc<PeerTable>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        self.table.update(self.ip, |u| {
            u.connections = u.connections.saturating_sub(1);
        });
    }
}

impl PeerSlot {
    pub(crate) fn ip(&self) -> IpAddr {
        self.ip
    }
}

impl PeerTable {
    pub(crate) fn new(max_connections: usize, max_pinned: usize) -> Arc<Self> {
        Arc::new(Self {
            peers: Mutex::default(),
            max_connections: max_connections.max(1),
            max_pinned,
        })
    }

    fn update(&self, ip: IpAddr, f: impl FnOnce(&mut PeerUse)) {
        let mut peers = self.peers.lock();
        let u = peers.entry(ip).or_default();
        f(u);
        if *u == PeerUse::default() {
            peers.remove(&ip);
        }
    }

    /// A connection slot for `ip`, or `None` when it already holds `max_connections`.
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<PeerSlot> {
        let ip = ip.to_canonical();
        let mut peers = self.peers.lock();
        let u = peers.entry(ip).or_default();
        if u.connections >= self.max_connections {
            if *u == PeerUse::default() {
                peers.remove(&ip);
            }
            return None;
        }
        u.connections += 1;
        Some(PeerSlot {
            table: Arc::clone(self),
            ip,
        })
    }

    /// Reserves up to `want` pins for `ip` within its quota; returns how many were granted.
    pub(crate) fn reserve_pins(&self, ip: IpAddr, want: usize) -> usize {
        let mut granted = 0;
        self.update(ip, |u| {
            granted = want.min(self.max_pinned.saturating_sub(u.pinned));
            u.pinned += granted;
        });
        granted
    }

    /// Returns `n` pins (released, expired or reserved but not taken).
    pub(crate) fn release_pins(&self, ip: IpAddr, n: usize) {
        if n > 0 {
            self.update(ip, |u| u.pinned = u.pinned.saturating_sub(n));
        }
    }

    #[cfg(test)]
    fn usage(&self, ip: IpAddr) -> (usize, usize) {
        self.peers
            .lock()
            .get(&ip)
            .map_or((0, 0), |u| (u.connections, u.pinned))
    }
}

/// How long a refused peer stays quiet in the log for the same reason.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// Entries kept before the log forgets whom it already named (it then names them again).
const LOG_MAX_ENTRIES: usize = 4096;

/// Counts every refusal and logs it once per peer address and reason per minute, so a flood
/// of hostile connections cannot flood the log too.
#[derive(Debug, Default)]
pub(crate) struct RefusalLog {
    seen: Mutex<HashMap<(IpAddr, &'static str), Instant>>,
}

impl RefusalLog {
    /// Count a refusal (`reason` from [`crate::metrics::REFUSE_REASONS`]) and log it unless
    /// this peer was named for it recently.
    pub(crate) fn refuse(
        &self,
        metrics: &TransferMetrics,
        peer: SocketAddr,
        reason: &'static str,
        detail: &dyn fmt::Display,
    ) {
        metrics.record_refused(reason);
        if self.first_in_a_while(peer.ip().to_canonical(), reason, Instant::now()) {
            tracing::warn!(%peer, reason, %detail, "p2p producer: refused a peer (logged once a minute per peer and reason)");
        }
    }

    fn first_in_a_while(&self, ip: IpAddr, reason: &'static str, now: Instant) -> bool {
        let mut seen = self.seen.lock();
        if seen.len() >= LOG_MAX_ENTRIES {
            seen.retain(|_, at| now.duration_since(*at) < LOG_EVERY);
            if seen.len() >= LOG_MAX_ENTRIES {
                seen.clear();
            }
        }
        match seen.get(&(ip, reason)) {
            Some(at) if now.duration_since(*at) < LOG_EVERY => false,
            _ => {
                seen.insert((ip, reason), now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_match_by_prefix_and_mapped_v4_counts_as_v4() {
        let net: IpNet = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains(ip("10.1.200.3")));
        assert!(!net.contains(ip("10.2.0.1")));
        assert!(net.contains(ip("::ffff:10.1.0.9")), "v4-mapped v6");
        let one: IpNet = "192.168.1.7".parse().unwrap();
        assert!(one.contains(ip("192.168.1.7")) && !one.contains(ip("192.168.1.8")));
        let odd: IpNet = "10.0.0.0/9".parse().unwrap();
        assert!(odd.contains(ip("10.127.0.1")) && !odd.contains(ip("10.128.0.1")));
        let v6: IpNet = "[fd00::]/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        assert!(
            "0.0.0.0/0"
                .parse::<IpNet>()
                .unwrap()
                .contains(ip("8.8.8.8"))
        );
        for bad in ["10.0.0.0/33", "host.example", "10.0.0.1/x", ""] {
            assert!(bad.parse::<IpNet>().is_err(), "{bad}");
        }
    }

    #[test]
    fn connection_slots_are_capped_per_address_and_freed_on_drop() {
        let t = PeerTable::new(2, 100);
        let a = ip("10.0.0.1");
        let s1 = t.admit(a).unwrap();
        let s2 = t.admit(a).unwrap();
        assert!(t.admit(a).is_none(), "third connection from one address");
        assert!(
            t.admit(ip("10.0.0.2")).is_some(),
            "another address is not affected"
        );
        assert!(
            t.admit(ip("::ffff:10.0.0.1")).is_none(),
            "mapped v6 is the same peer"
        );
        drop(s1);
        let _s3 = t.admit(a).unwrap();
        drop(s2);
        assert_eq!(t.usage(a), (1, 0));
    }

    #[test]
    fn pin_quota_grants_up_to_the_cap_and_accounts_releases() {
        let t = PeerTable::new(4, 10);
        let a = ip("10.0.0.1");
        let _slot = t.admit(a).unwrap();
        assert_eq!(t.reserve_pins(a, 6), 6);
        assert_eq!(t.reserve_pins(a, 6), 4, "only what is left of the quota");
        assert_eq!(t.reserve_pins(a, 1), 0);
        assert_eq!(
            t.reserve_pins(ip("10.0.0.2"), 3),
            3,
            "quotas are per address"
        );
        t.release_pins(a, 5);
        assert_eq!(t.usage(a), (1, 5));
        assert_eq!(t.reserve_pins(a, 100), 5);
        t.release_pins(a, 1000);
        assert_eq!(t.usage(a), (1, 0), "over-release saturates");
        drop(_slot);
        t.release_pins(ip("10.0.0.2"), 3);
        assert!(t.peers.lock().is_empty(), "no entry outlives what it holds");
    }

    #[test]
    fn a_refused_peer_is_logged_once_a_minute_per_reason() {
        let log = RefusalLog::default();
        let now = Instant::now();
        let a = ip("10.0.0.1");
        assert!(log.first_in_a_while(a, "connection_cap", now));
        assert!(!log.first_in_a_while(a, "connection_cap", now + Duration::from_secs(1)));
        assert!(log.first_in_a_while(a, "mac_failed", now));
        assert!(log.first_in_a_while(a, "connection_cap", now + LOG_EVERY));
    }
}
