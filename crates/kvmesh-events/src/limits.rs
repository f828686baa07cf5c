//! The resource bounds every socket of this crate enforces against its peers.
//!
//! Stated once here (and in `docs/protocols.md#kv-events`) so the numbers a reviewer checks are
//! the numbers the code uses. A peer that exceeds a per-frame, per-message or handshake bound is
//! disconnected before the excess is read; bytes are buffered only as they actually arrive, never
//! on the strength of a declared length.

use std::time::Duration;

/// Largest frame a SUB socket or the replay client accepts (an event payload). vLLM sends one
/// batch per engine step; kvmesh coalesces at most `MAX_COALESCED_EVENTS` events per message.
pub const MAX_EVENT_FRAME: usize = 64 << 20;
/// Largest whole message (all parts) a SUB socket or the replay client accepts.
pub const MAX_EVENT_MESSAGE: usize = 64 << 20;
/// Most parts per event message (`[topic, seq, payload]`, plus room for a replay envelope).
pub const MAX_EVENT_PARTS: usize = 8;
/// Received-but-unprocessed bytes one SUB socket holds across all its peers; a reader waits
/// for room before reading a frame body.
pub const MAX_SUBSCRIBER_BUFFERED: usize = 128 << 20;

/// Largest frame a PUB socket reads from a subscriber (subscriptions are topic prefixes).
pub const MAX_SUBSCRIPTION_FRAME: usize = 1024;
/// Subscriptions one subscriber may hold on a PUB socket.
pub const MAX_SUBSCRIPTIONS_PER_PEER: usize = 64;
/// Encoded messages queued for one subscriber before further ones are dropped (ZMQ's SNDHWM).
pub const PUB_PEER_QUEUE: usize = 10_000;
/// Batches a connect-mode publisher keeps while it has no subscriber, so events published before
/// the subscriber is reachable are delivered once it is (bounded in count and bytes).
pub const CONNECT_BUFFER_MESSAGES: usize = 10_000;
pub const CONNECT_BUFFER_BYTES: usize = 64 << 20;

/// Bytes of payload the replay ring keeps (besides its batch count, vLLM's `buffer_steps`): the
/// oldest batches go first. Half the largest answer a replay client accepts, so that asking for
/// everything (a router catching up) always fits. Why: a ring bounded only in count held
/// 10,000 coalesced batches of ~35 KiB (~360 MB) under load, and up to 10,000 × 64 MiB in
/// principle; a catch-up from a ring above 256 MiB failed every time.
pub const MAX_REPLAY_BUFFER_BYTES: usize = MAX_REPLAY_ANSWER / 2;

/// Largest frame the replay ROUTER reads (a request is `["", start_seq]`).
pub const MAX_REPLAY_REQUEST_FRAME: usize = 256;
/// Most parts of one replay request.
pub const MAX_REPLAY_REQUEST_PARTS: usize = 4;
/// Bytes one replay answer may total on the client side, and how long it may take.
pub const MAX_REPLAY_ANSWER: usize = 256 << 20;
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest READY (or other) command accepted during the handshake.
pub const MAX_HANDSHAKE_FRAME: usize = 1024;
/// Greeting + READY must complete within this, or the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// A started frame must finish arriving within this (a slow drip holds buffer space).
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// A write to one peer that makes no progress for this long drops the peer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Simultaneous connections a bound PUB or SUB socket accepts; more are closed at once.
pub const MAX_PEERS: usize = 64;
/// Simultaneous connections the replay ROUTER accepts.
pub const MAX_REPLAY_PEERS: usize = 16;
/// Of those, the most one source address may hold (IPv6: one /64; `ipc://` peers are one source),
/// so a single host cannot take every slot (a router needs one PUB connection per engine, and one
/// replay connection at a time).
pub const MAX_PEERS_PER_SOURCE: usize = 8;
pub const MAX_REPLAY_PEERS_PER_SOURCE: usize = 4;
/// A PUB peer must hold a subscription that matches the publisher's topic within this of its
/// handshake (and of dropping its last one), or it is dropped: a peer that never subscribes is
/// never written to, so no write timeout would ever free its slot (issue 37: 64 such peers filled
/// an engine's PUB port).
pub const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);
/// A replay peer must send a request within this of its handshake and of each answer (the
/// router's replay client asks at once and closes after the answer).
pub const REPLAY_IDLE_TIMEOUT: Duration = Duration::from_secs(5);
