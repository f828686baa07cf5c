//! What a pull returns: a typed outcome, never an error. The caller computes whatever the report
//! says did not arrive (`blocks` is the count of leading blocks delivered to the sink).

use std::fmt;
use std::time::Duration;

/// Why a pull stopped before delivering every requested block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullReason {
    /// The peer is not in the allow-list; it was never contacted.
    NotAllowed,
    /// Name resolution or TCP connect failed.
    Connect,
    /// The peer's fingerprint differs; `field` is the first differing field.
    FingerprintMismatch { field: String },
    /// Shared-secret authentication failed (either direction) or only one side has a secret.
    AuthFailed,
    /// The peer does not hold the next block.
    Miss,
    /// The next block was still being computed at the pending deadline.
    PendingDeadline,
    /// A step (connect, handshake, one frame) took longer than the configured timeout.
    Timeout,
    /// A block's payload did not match its checksum.
    Checksum,
    /// The peer closed the connection.
    PeerClosed,
    /// The peer sent something that violates the protocol.
    Protocol,
    /// Our sink refused a block (e.g. content verification failed).
    SinkRejected,
    /// The peer speaks another protocol version (`theirs`; we speak `ours`).
    Version { ours: u16, theirs: u16 },
    /// The producer refused us: our address holds its per-IP connection cap.
    Busy,
    /// A record after the handshake failed its tag: forged, altered, replayed or reordered on
    /// the way.
    MacFailed,
    /// The two ends disagree on encrypting KV in transit (`ours`: whether we asked for it).
    EncryptionMismatch { ours: bool, theirs: bool },
    /// A layer-major pull's segment layout was refused: malformed, or (said the producer) not
    /// the size of its blocks ([`crate::layers::LayoutError`]).
    BadLayout,
}

impl PullReason {
    /// Whether this is a fleet configuration problem (allow-list, fingerprint, secret) rather
    /// than the weather (misses, timeouts, a busy or restarting peer).
    pub fn is_misconfiguration(&self) -> bool {
        matches!(
            self,
            PullReason::NotAllowed
                | PullReason::FingerprintMismatch { .. }
                | PullReason::AuthFailed
                | PullReason::Version { .. }
                | PullReason::EncryptionMismatch { .. }
        )
    }

    /// Every reason, for metric pre-registration and tests.
    pub const ALL: [PullReason; 16] = [
        PullReason::NotAllowed,
        PullReason::Connect,
        PullReason::FingerprintMismatch {
            field: String::new(),
        },
        PullReason::AuthFailed,
        PullReason::Miss,
        PullReason::PendingDeadline,
        PullReason::Timeout,
        PullReason::Checksum,
        PullReason::PeerClosed,
        PullReason::Protocol,
        PullReason::SinkRejected,
        PullReason::Version { ours: 0, theirs: 0 },
        PullReason::Busy,
        PullReason::MacFailed,
        PullReason::EncryptionMismatch {
            ours: false,
            theirs: false,
        },
        PullReason::BadLayout,
    ];

    /// Stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            PullReason::NotAllowed => "not_allowed",
            PullReason::Connect => "connect",
            PullReason::FingerprintMismatch { .. } => "fingerprint_mismatch",
            PullReason::AuthFailed => "auth_failed",
            PullReason::Miss => "miss",
            PullReason::PendingDeadline => "pending_deadline",
            PullReason::Timeout => "timeout",
            PullReason::Checksum => "checksum",
            PullReason::PeerClosed => "peer_closed",
            PullReason::Protocol => "protocol",
            PullReason::SinkRejected => "sink_rejected",
            PullReason::Version { .. } => "version",
            PullReason::Busy => "busy",
            PullReason::MacFailed => "mac_failed",
            PullReason::EncryptionMismatch { .. } => "encryption_mismatch",
            PullReason::BadLayout => "bad_layout",
        }
    }
}

impl fmt::Display for PullReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PullReason::FingerprintMismatch { field } => write!(f, "fingerprint_mismatch({field})"),
            PullReason::Version { ours, theirs } => write!(
                f,
                "version(peer speaks P2P protocol v{theirs}, we speak v{ours}: upgrade the older engine)"
            ),
            PullReason::EncryptionMismatch { ours, theirs } => {
                let said = |e: bool| if e { "encrypted" } else { "unencrypted" };
                write!(
                    f,
                    "encryption_mismatch(we want {} transfers, the peer serves {}: set \
                     --p2p-encrypt on both ends or neither)",
                    said(*ours),
                    said(*theirs)
                )
            }
            other => f.write_str(other.label()),
        }
    }
}

/// Overall result of a pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullOutcome {
    /// Every requested block was delivered.
    Complete,
    /// At least one leading block was delivered, then the pull stopped.
    Partial { reason: PullReason },
    /// No block was delivered.
    Failed { reason: PullReason },
}

impl PullOutcome {
    /// The outcome of a pull that ended with `result` after delivering `blocks` leading blocks.
    pub fn after(result: Result<(), PullReason>, blocks: usize) -> Self {
        match result {
            Ok(()) => PullOutcome::Complete,
            Err(reason) if blocks > 0 => PullOutcome::Partial { reason },
            Err(reason) => PullOutcome::Failed { reason },
        }
    }

    pub fn label(&self) -> &'static str {
        match self {
            PullOutcome::Complete => "complete",
            PullOutcome::Partial { .. } => "partial",
            PullOutcome::Failed { .. } => "failed",
        }
    }

    pub fn reason(&self) -> Option<&PullReason> {
        match self {
            PullOutcome::Complete => None,
            PullOutcome::Partial { reason } | PullOutcome::Failed { reason } => Some(reason),
        }
    }
}

/// What a pull did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullReport {
    pub outcome: PullOutcome,
    /// Leading blocks accepted by the sink (indices `0..blocks` of the requested hashes).
    pub blocks: usize,
    /// Payload bytes accepted by the sink.
    pub bytes: u64,
    pub duration: Duration,
}

/// What a layer-major pull ([`crate::PullClient::pull_layers`]) did. Its outcome counts whole
/// blocks: a block is delivered once every segment of it arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPullReport {
    pub outcome: PullOutcome,
    /// Leading blocks with every segment in the sink.
    pub blocks: usize,
    /// Segments complete, each for the same leading run of blocks (the producer's whole
    /// prefix): `segments` = the layout's count when the pull delivered whole blocks; fewer
    /// when it stopped mid-stream (then `blocks` = 0, and the first `segments` layers arrived).
    pub segments: usize,
    /// Blocks per completed segment (0 if none completed).
    pub segment_blocks: usize,
    /// Segment bytes written into the sink.
    pub bytes: u64,
    pub duration: Duration,
}

/// Blocks and bytes a pull delivered so far (survives the pull being dropped at its deadline).
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub blocks: usize,
    pub bytes: u64,
    /// Any reply arrived on this connection during this pull.
    pub replied: bool,
}
