//! The engine's load report and the router's request mark: how several router replicas share one
//! view of each engine's queued prefill work without talking to each other.
//!
//! Every router replica stamps each request it forwards with a [`RouterMark`] (header
//! [`ROUTER_MARK_HEADER`]: its replica id, a per-engine sequence number, and the uncached prompt
//! tokens it expects the engine to compute). The engine keeps the sum of what it holds and, per
//! replica, the highest sequence number below which it has received every request, and publishes
//! a [`LoadReport`] on its KV-event socket under [`LOAD_TOPIC`]. A replica's view of an engine is
//! then the report plus its own requests the report does not cover yet — the same number on every
//! replica, whichever of them sent the work. The engine is the authority: no broker, and a dead
//! replica's work leaves the report when the engine finishes it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The topic of load reports on the KV-event PUB socket (a ZMQ prefix subscription to the KV
/// events' own topic does not match it unless that topic is empty).
pub const LOAD_TOPIC: &str = "kvmesh.load";

/// Request header carrying a [`RouterMark`].
pub const ROUTER_MARK_HEADER: &str = "x-kvmesh-router-mark";

/// Reports larger than this are refused unread (a full report of [`MAX_REPORTED_ROUTERS`] ids is
/// about 4 KiB).
pub const MAX_LOAD_REPORT_BYTES: usize = 16 * 1024;

/// How many router replicas one report lists (the most recently active); an engine forgets the
/// rest, whose requests their replicas then count themselves.
pub const MAX_REPORTED_ROUTERS: usize = 32;

/// The longest replica id accepted in a mark.
pub const MAX_ROUTER_ID_LEN: usize = 64;

/// An engine's own account of the work it holds, published at most every few milliseconds while
/// it changes and as a heartbeat while it does not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Format version (1).
    pub v: u32,
    /// Requests received and not finished (waiting, pulling, prefilling or decoding).
    pub requests: u64,
    /// Prompt tokens still to compute for requests whose first token is not out yet.
    pub prefill_tokens: u64,
    /// Output tokens requested by the requests in flight.
    pub decode_tokens: u64,
    /// Per router replica: every request it marked with a lower sequence number has been received
    /// (and is counted above).
    #[serde(default)]
    pub routers: BTreeMap<String, u64>,
}

/// Why a load report or a router mark was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LoadReportError {
    #[error("load report of {0} bytes exceeds the {MAX_LOAD_REPORT_BYTES}-byte bound")]
    TooLarge(usize),
    #[error("load report is not valid: {0}")]
    Malformed(String),
    #[error("load report version {0} is not supported (1 is)")]
    Version(u32),
    #[error("router mark is not `<replica-id> <seq> <uncached-tokens>`")]
    BadMark,
}

impl LoadReport {
    pub fn encode(&self) -> Vec<u8> {
        // Plain data of integers and short strings: serialisation cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a report, bounded in size and in the number of replicas it lists.
    pub fn decode(payload: &[u8]) -> Result<Self, LoadReportError> {
        if payload.len() > MAX_LOAD_REPORT_BYTES {
            return Err(LoadReportError::TooLarge(payload.len()));
        }
        let report: LoadReport = serde_json::from_slice(payload)
            .map_err(|e| LoadReportError::Malformed(e.to_string()))?;
        if report.v != 1 {
            return Err(LoadReportError::Version(report.v));
        }
        if report.routers.len() > MAX_REPORTED_ROUTERS {
            return Err(LoadReportError::Malformed(format!(
                "{} router ids (at most {MAX_REPORTED_ROUTERS})",
                report.routers.len()
            )));
        }
        Ok(report)
    }
}

/// What a router replica says about a request it forwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterMark {
    /// The replica's id: `[A-Za-z0-9._-]`, at most [`MAX_ROUTER_ID_LEN`] bytes.
    pub router: String,
    /// The replica's sequence number for this engine, from 0.
    pub seq: u64,
    /// Prompt tokens the replica expects the engine to compute (its index's view).
    pub uncached_tokens: u64,
}

impl RouterMark {
    pub fn to_header(&self) -> String {
        format!("{} {} {}", self.router, self.seq, self.uncached_tokens)
    }

    pub fn parse(value: &str) -> Result<Self, LoadReportError> {
        let mut parts = value.split(' ');
        let (Some(router), Some(seq), Some(uncached), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(LoadReportError::BadMark);
        };
        if !valid_router_id(router) {
            return Err(LoadReportError::BadMark);
        }
        Ok(Self {
            router: router.to_owned(),
            seq: seq.parse().map_err(|_| LoadReportError::BadMark)?,
            uncached_tokens: uncached.parse().map_err(|_| LoadReportError::BadMark)?,
        })
    }
}

/// Whether `id` may name a router replica in marks and reports.
pub fn valid_router_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ROUTER_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_round_trips_and_garbage_is_refused_with_a_reason() {
        let mut report = LoadReport {
            v: 1,
            requests: 3,
            prefill_tokens: 12_000,
            decode_tokens: 600,
            routers: BTreeMap::new(),
        };
        report.routers.insert("router-a".into(), 17);
        assert_eq!(LoadReport::decode(&report.encode()), Ok(report));
        assert!(matches!(
            LoadReport::decode(b"\x93\x01garbage"),
            Err(LoadReportError::Malformed(_))
        ));
        assert_eq!(
            LoadReport::decode(br#"{"v":2,"requests":0,"prefill_tokens":0,"decode_tokens":0}"#),
            Err(LoadReportError::Version(2))
        );
        assert!(matches!(
            LoadReport::decode(br#"{"v":1,"requests":-1,"prefill_tokens":0,"decode_tokens":0}"#),
            Err(LoadReportError::Malformed(_))
        ));
        let huge = vec![b' '; MAX_LOAD_REPORT_BYTES + 1];
        assert_eq!(
            LoadReport::decode(&huge),
            Err(LoadReportError::TooLarge(huge.len()))
        );
        let many: BTreeMap<String, u64> = (0..=MAX_REPORTED_ROUTERS)
            .map(|i| (format!("r{i}"), 0))
            .collect();
        let crowded = LoadReport {
            v: 1,
            routers: many,
            ..LoadReport::default()
        };
        assert!(matches!(
            LoadReport::decode(&crowded.encode()),
            Err(LoadReportError::Malformed(_))
        ));
    }

    #[test]
    fn a_mark_round_trips_and_a_bad_one_is_refused() {
        let mark = RouterMark {
            router: "kvmesh-router-7f9c.b_1".into(),
            seq: 42,
            uncached_tokens: 9000,
        };
        assert_eq!(RouterMark::parse(&mark.to_header()), Ok(mark));
        for bad in [
            "",
            "a 1",
            "a 1 2 3",
            "a -1 2",
            "a 1 x",
            "sp ace 1 2",
            "bad/id 1 2",
            &format!("{} 1 2", "x".repeat(MAX_ROUTER_ID_LEN + 1)),
        ] {
            assert_eq!(
                RouterMark::parse(bad),
                Err(LoadReportError::BadMark),
                "{bad:?}"
            );
        }
    }
}
