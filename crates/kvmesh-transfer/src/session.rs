//! One connection's conversation on the consumer side: `Lookup` → `LookupReply`, then `Fetch` →
//! blocks → `Done`, every step bounded in time and every failure mapped to a [`Stop`] (why, and
//! whether the connection may be pooled again). The pull client ([`crate::client`]) runs one
//! session per connection: one for a plain pull, one per stripe for a striped pull.
//!
//! Where a block lands is the [`Landing`]: on a plain pull the sink itself (straight into its
//! memory when it offers a [`BlockSink::destination`]); on a striped pull the stripe reads into a
//! buffer of its own and hands the block to the pull's [`StripeWindow`], which delivers in order.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::BlockHash;
use tokio::sync::watch;
use tokio::time::{Instant, timeout, timeout_at};

use crate::connection::{Connection, ConnectionError, Incoming};
use crate::layers::{SegmentCursor, SegmentLayout, SegmentSink};
use crate::message::{BlockHead, Fetch, FetchEnd, Lookup, LookupReply, Message, Promote};
use crate::metrics::{Direction, TransferMetrics};
use crate::pacing::LinkPacer;
use crate::reorder::StripeWindow;
use crate::report::{Progress, PullReason};
use crate::source::BlockSink;

/// Why one session ended early, and what that means for the connection.
#[derive(Debug)]
pub(crate) struct Stop {
    pub reason: PullReason,
    /// The stream ended cleanly (`Done`), so the connection can go back to the pool.
    pub reusable: bool,
    /// Failed before any reply on a pooled connection: try once more on a fresh one.
    pub stale: bool,
}

impl Stop {
    pub fn broken(reason: PullReason) -> Self {
        Self {
            reason,
            reusable: false,
            stale: false,
        }
    }

    pub fn clean(reason: PullReason) -> Self {
        Self {
            reason,
            reusable: true,
            stale: false,
        }
    }
}

pub(crate) fn conn_reason(e: &ConnectionError) -> PullReason {
    match e {
        ConnectionError::Checksum { .. } => PullReason::Checksum,
        ConnectionError::Mac { .. } => PullReason::MacFailed,
        ConnectionError::Message(_) | ConnectionError::Desynchronized => PullReason::Protocol,
        ConnectionError::Destination { .. } => PullReason::SinkRejected,
        e if e.is_closed() => PullReason::PeerClosed,
        ConnectionError::Io(_) | ConnectionError::ClosedMidFrame => PullReason::PeerClosed,
    }
}

/// What a session needs from the client's configuration.
#[derive(Clone, Copy)]
pub(crate) struct Steps<'a> {
    /// Bound on each step: each reply and each block frame.
    pub timeout: Duration,
    /// Extra time for blocks the producer reported `Pending`.
    pub pending_deadline: Duration,
    pub metrics: &'a TransferMetrics,
    pub ingress: Option<&'a Arc<dyn LinkPacer>>,
}

impl Steps<'_> {
    fn count_block(&self, len: usize) {
        self.metrics.record_block(Direction::In, len);
        if let Some(p) = self.ingress {
            self.metrics
                .record_modelled(Direction::In, p.modelled_bytes_per_block());
        }
    }
}

fn read_stop(e: ConnectionError, stale_ok: bool) -> Stop {
    let reason = conn_reason(&e);
    let stale = stale_ok && reason == PullReason::PeerClosed;
    Stop {
        reason,
        reusable: false,
        stale,
    }
}

/// The next frame (a whole message, or a block's head) before `deadline`.
async fn read_frame(
    conn: &mut Connection,
    deadline: Instant,
    stale_ok: bool,
) -> Result<Incoming, Stop> {
    match timeout_at(deadline, conn.read_frame()).await {
        Err(_) => Err(Stop::broken(PullReason::Timeout)),
        Ok(Ok(Some(f))) => Ok(f),
        Ok(Ok(None)) => Err(Stop {
            reason: PullReason::PeerClosed,
            reusable: false,
            stale: stale_ok,
        }),
        Ok(Err(e)) => Err(read_stop(e, stale_ok)),
    }
}

/// Read one control message within `limit` (a block here is out of place).
pub(crate) async fn read(
    conn: &mut Connection,
    limit: Duration,
    stale_ok: bool,
) -> Result<Message, Stop> {
    match read_frame(conn, Instant::now() + limit, stale_ok).await? {
        Incoming::Message(m) => Ok(m),
        Incoming::Block(_) => Err(Stop::broken(PullReason::Protocol)),
    }
}

pub(crate) async fn write(
    conn: &mut Connection,
    limit: Duration,
    msg: &Message,
    stale_ok: bool,
) -> Result<(), Stop> {
    match timeout(limit, conn.write_message(msg)).await {
        Err(_) => Err(Stop::broken(PullReason::Timeout)),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Stop {
            reason: conn_reason(&e),
            reusable: false,
            stale: stale_ok,
        }),
    }
}

/// Sends `Lookup` for `hashes` and reads its reply (one status per hash). `stale_ok`: a failure
/// before the reply may be a pooled connection the producer closed meanwhile.
pub(crate) async fn lookup(
    conn: &mut Connection,
    limit: Duration,
    kv_request_id: &str,
    hashes: &[BlockHash],
    stale_ok: bool,
) -> Result<LookupReply, Stop> {
    let lookup = Lookup {
        kv_request_id: kv_request_id.to_string(),
        hashes: hashes.to_vec(),
    };
    write(conn, limit, &Message::Lookup(lookup), stale_ok).await?;
    match read(conn, limit, stale_ok).await? {
        Message::LookupReply(r) if r.statuses.len() == hashes.len() => Ok(r),
        _ => Err(Stop::broken(PullReason::Protocol)),
    }
}

/// Waits until `promote` reads true; `false` if its sender is gone first (never promoted).
pub(crate) async fn promoted(promote: &mut watch::Receiver<bool>) -> bool {
    promote.wait_for(|p| *p).await.is_ok()
}

/// Where the blocks of a fetch go.
pub(crate) enum Landing<'a, 's> {
    /// Straight to the sink, in order (a plain pull), counted in `progress`.
    Sink {
        sink: &'a mut dyn BlockSink,
        progress: &'a mut Progress,
    },
    /// Stripe `stripe` of `of`: its block `j` is the pull's block `stripe + j * of`, delivered
    /// through the pull's window; `received` counts the stripe's blocks so far.
    Stripe {
        window: &'a StripeWindow<'s>,
        stripe: usize,
        of: usize,
        received: usize,
    },
}

impl<'a, 's> Landing<'a, 's> {
    /// The pull's index of this fetch's block `j`.
    pub fn global(&self, j: usize) -> usize {
        match self {
            Landing::Sink { .. } => j,
            Landing::Stripe { stripe, of, .. } => stripe + j * of,
        }
    }

    /// Payload of block `j` (head read), into the sink or the window, before `deadline`.
    async fn land(
        &mut self,
        conn: &mut Connection,
        head: &BlockHead,
        j: usize,
        deadline: Instant,
        steps: &Steps<'_>,
    ) -> Result<(), Stop> {
        let (index, hash, len) = (self.global(j), head.hash, head.payload_len);
        let broken = |e: Result<ConnectionError, tokio::time::error::Elapsed>| match e {
            Err(_) => Stop::broken(PullReason::Timeout),
            Ok(e) => Stop::broken(conn_reason(&e)),
        };
        let rejected = |_| Stop::broken(PullReason::SinkRejected);
        match self {
            Landing::Sink { sink, progress } => {
                if let Some(dest) = sink.destination(index, hash, len) {
                    match timeout_at(deadline, conn.read_payload_into(head, dest)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(broken(Ok(e))),
                        Err(e) => return Err(broken(Err(e))),
                    }
                    sink.accept_written(index, hash).map_err(rejected)?;
                } else {
                    let payload = match timeout_at(deadline, conn.read_payload(head)).await {
                        Ok(Ok(p)) => p,
                        Ok(Err(e)) => return Err(broken(Ok(e))),
                        Err(e) => return Err(broken(Err(e))),
                    };
                    sink.accept(index, hash, payload).map_err(rejected)?;
                }
                progress.blocks += 1;
                progress.bytes += len as u64;
                steps.count_block(len);
            }
            Landing::Stripe {
                window, received, ..
            } => {
                let payload: Bytes = match timeout_at(deadline, conn.read_payload(head)).await {
                    Ok(Ok(p)) => p,
                    Ok(Err(e)) => return Err(broken(Ok(e))),
                    Err(e) => return Err(broken(Err(e))),
                };
                *received += 1;
                for delivered in window.arrive(index, hash, payload) {
                    steps.count_block(delivered);
                }
            }
        }
        Ok(())
    }

    /// The window a stripe must be admitted by before reading its block `j`, and that block's
    /// index in the pull. (Returned rather than awaited here: a `&Landing` held across an await
    /// would need the sink to be `Sync`.)
    fn window(&self, j: usize) -> Option<(&'a StripeWindow<'s>, usize)> {
        match self {
            Landing::Sink { .. } => None,
            Landing::Stripe { window, .. } => Some((*window, self.global(j))),
        }
    }
}

/// What to fetch on one connection.
pub(crate) struct FetchPlan<'h> {
    pub hashes: &'h [BlockHash],
    /// Index in `hashes` of the first block the lookup reported pending (`hashes.len()` if none):
    /// from it on a block may take the pending deadline longer.
    pub first_pending: usize,
    /// A prefetch nobody waits for yet.
    pub background: bool,
}

/// Sends `Fetch` for the plan's hashes and receives the stream until `Done`. `Ok` when every
/// block arrived; a clean [`Stop`] when the producer ended the stream early with `Done`.
/// `promote`: a background fetch listens for its promotion between frames and tells the
/// producer (only one that announced `Promote` support).
pub(crate) async fn fetch(
    conn: &mut Connection,
    steps: &Steps<'_>,
    plan: FetchPlan<'_>,
    promote: Option<watch::Receiver<bool>>,
    landing: &mut Landing<'_, '_>,
) -> Result<(), Stop> {
    let hashes = plan.hashes;
    let pending_wait_ms = u32::try_from(steps.pending_deadline.as_millis()).unwrap_or(u32::MAX);
    let fetch = Fetch {
        hashes: hashes.to_vec(),
        pending_wait_ms,
        background: plan.background,
        segments: Vec::new(),
    };
    write(conn, steps.timeout, &Message::Fetch(fetch), false).await?;
    // Listen for a promotion during the stream only where a `Promote` can be sent: an older
    // producer would close the connection on the unknown frame.
    let mut promote = promote.filter(|_| plan.background && conn.peer_promotes());
    let (mut received, mut bytes) = (0usize, 0u64);
    loop {
        // A stripe waits while it is too far ahead of the blocks the sink still needs, and stops
        // when the pull's prefix already ends before its next block: nothing left to add. (After
        // its last block only `Done` is due, which it reads to keep the connection.)
        if received < hashes.len()
            && let Some((window, g)) = landing.window(received)
            && !window.admit(g).await
        {
            return Err(Stop::broken(PullReason::Protocol));
        }
        // Blocks from the first pending one on may take until the producer's wait deadline.
        let limit = if received >= plan.first_pending {
            steps.timeout + steps.pending_deadline
        } else {
            steps.timeout
        };
        let deadline = Instant::now() + limit;
        let frame = if let Some(rx) = promote.as_mut() {
            // Reading a frame (not a payload) is cancel safe: a frame cut short resumes.
            let event = tokio::select! {
                biased;
                d = promoted(rx) => Err(d),
                f = read_frame(conn, deadline, false) => Ok(f),
            };
            match event {
                Ok(f) => f?,
                Err(now_demand) => {
                    promote = None;
                    if now_demand {
                        // A request waits for the rest of this fetch: the producer paces it as
                        // demand from now on.
                        write(conn, steps.timeout, &Message::Promote(Promote {}), false).await?;
                    }
                    continue;
                }
            }
        } else {
            read_frame(conn, deadline, false).await?
        };
        match frame {
            Incoming::Block(head) => {
                let Some(&want) = hashes.get(received) else {
                    return Err(Stop::broken(PullReason::Protocol));
                };
                if head.index as usize != received || head.hash != want {
                    return Err(Stop::broken(PullReason::Protocol));
                }
                // The connection checks the checksum (and the tags) while the bytes arrive.
                landing.land(conn, &head, received, deadline, steps).await?;
                received += 1;
                bytes += head.payload_len as u64;
            }
            Incoming::Message(Message::Done(d)) => {
                if d.blocks as usize != received || d.bytes != bytes {
                    return Err(Stop::broken(PullReason::Protocol));
                }
                return match d.end {
                    FetchEnd::Complete if received == hashes.len() => Ok(()),
                    FetchEnd::Complete => Err(Stop::broken(PullReason::Protocol)),
                    FetchEnd::Miss { .. } => Err(Stop::clean(PullReason::Miss)),
                    FetchEnd::PendingDeadline { .. } => {
                        Err(Stop::clean(PullReason::PendingDeadline))
                    }
                };
            }
            Incoming::Message(_) => return Err(Stop::broken(PullReason::Protocol)),
        }
    }
}

/// A layer-major pull's progress so far (survives the pull being dropped at its deadline).
#[derive(Debug, Default)]
pub(crate) struct LayerProgress {
    /// Leading blocks with every segment in.
    pub blocks: usize,
    /// Segments complete, and for how many blocks each.
    pub segments: usize,
    pub segment_blocks: usize,
    pub bytes: u64,
    /// Any reply arrived on this connection during this pull.
    pub replied: bool,
}

/// Sends a layer-major `Fetch` ([`crate::layers`]) for the plan's hashes and receives the stream
/// until `Done`, each segment straight into the sink's memory, telling the sink as each segment
/// completes. `Ok` when every block arrived whole; a clean [`Stop`] when the producer served a
/// shorter prefix (all its segments arrived).
pub(crate) async fn fetch_layers(
    conn: &mut Connection,
    steps: &Steps<'_>,
    plan: FetchPlan<'_>,
    layout: &SegmentLayout,
    sink: &mut dyn SegmentSink,
    progress: &mut LayerProgress,
) -> Result<(), Stop> {
    let hashes = plan.hashes;
    let fetch = Fetch {
        hashes: hashes.to_vec(),
        pending_wait_ms: u32::try_from(steps.pending_deadline.as_millis()).unwrap_or(u32::MAX),
        background: false,
        segments: layout.lens().to_vec(),
    };
    write(conn, steps.timeout, &Message::Fetch(fetch), false).await?;
    let mut cursor = SegmentCursor::new(hashes.len(), layout.segments());
    let mut first = true;
    loop {
        // The producer resolves every block (waiting for pending ones) before its first frame.
        let limit = if first && plan.first_pending < hashes.len() {
            steps.timeout + steps.pending_deadline
        } else {
            steps.timeout
        };
        first = false;
        let deadline = Instant::now() + limit;
        match read_frame(conn, deadline, false).await? {
            Incoming::Block(head) => {
                let placed = cursor
                    .accept(head.index)
                    .map_err(|_| Stop::broken(PullReason::Protocol))?;
                if let Some((segment, blocks)) = placed.completed_before {
                    segment_done(sink, (segment, blocks), progress, layout, steps);
                }
                let want_len = layout.lens()[placed.segment] as usize;
                if hashes.get(placed.block) != Some(&head.hash) || head.payload_len != want_len {
                    return Err(Stop::broken(PullReason::Protocol));
                }
                let Some(dest) = sink.destination(placed.block, placed.segment, want_len) else {
                    return Err(Stop::broken(PullReason::SinkRejected));
                };
                match timeout_at(deadline, conn.read_payload_into(&head, dest)).await {
                    Err(_) => return Err(Stop::broken(PullReason::Timeout)),
                    Ok(Err(e)) => return Err(Stop::broken(conn_reason(&e))),
                    Ok(Ok(())) => {}
                }
                progress.bytes += want_len as u64;
                if let Some((segment, blocks)) = cursor.landed() {
                    segment_done(sink, (segment, blocks), progress, layout, steps);
                }
            }
            Incoming::Message(Message::Done(d)) => {
                let completed = cursor
                    .done(d.blocks as usize, &d.end)
                    .map_err(|_| Stop::broken(PullReason::Protocol))?;
                if d.bytes != progress.bytes {
                    return Err(Stop::broken(PullReason::Protocol));
                }
                if let Some((segment, blocks)) = completed {
                    segment_done(sink, (segment, blocks), progress, layout, steps);
                }
                return match d.end {
                    FetchEnd::Complete => Ok(()),
                    FetchEnd::Miss { .. } => Err(Stop::clean(PullReason::Miss)),
                    FetchEnd::PendingDeadline { .. } => {
                        Err(Stop::clean(PullReason::PendingDeadline))
                    }
                };
            }
            Incoming::Message(Message::Error(e)) if e.message.starts_with(BAD_LAYOUT) => {
                tracing::warn!(error = %e.message, "p2p layer-major pull refused by the producer");
                return Err(Stop::broken(PullReason::BadLayout));
            }
            Incoming::Message(_) => return Err(Stop::broken(PullReason::Protocol)),
        }
    }
}

/// How a producer's `Error` refusing a segment layout starts.
pub(crate) const BAD_LAYOUT: &str = "bad segment layout";

/// Segment `segment` is in for `blocks` blocks: the sink is told, and once the last segment is
/// in, the blocks count as received.
fn segment_done(
    sink: &mut dyn SegmentSink,
    (segment, blocks): (usize, usize),
    progress: &mut LayerProgress,
    layout: &SegmentLayout,
    steps: &Steps<'_>,
) {
    sink.segment_complete(segment, blocks);
    progress.segments = segment + 1;
    progress.segment_blocks = blocks;
    if segment + 1 == layout.segments() {
        progress.blocks = blocks;
        for _ in 0..blocks {
            steps.count_block(layout.block_len() as usize);
        }
    }
}
