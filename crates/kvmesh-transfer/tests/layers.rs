//! Layer-major pulls against a real producer on loopback: bytes land exactly where the sink
//! says, segment by segment in layer-major order with a completion per segment; a producer killed
//! mid-layer, a miss in the middle and bad layouts each end with a clear, counted report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kvmesh_core::BlockHash;
use kvmesh_transfer::message::{Fetch, FetchEnd, Message};
use kvmesh_transfer::{
    LayerPullReport, LayoutError, LinkPacer, PacedTransfer, ProducerServer, PullOutcome,
    PullReason, Secret, SegmentLayout, SegmentSink, ServerConfig, TrafficClass,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use common::*;

/// What a sink saw, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// Memory asked for (block, segment).
    Dest(usize, usize),
    /// Segment complete for that many blocks.
    Complete(usize, usize),
}

/// Whole blocks in memory, written segment by segment where the layout puts them.
struct BlocksSink {
    layout: SegmentLayout,
    blocks: Vec<Vec<u8>>,
    events: Vec<Event>,
    /// Called on each completed segment (e.g. to kill the producer).
    on_complete: Box<dyn FnMut(usize) + Send>,
}

impl BlocksSink {
    fn new(layout: SegmentLayout, n: usize) -> Self {
        let len = layout.block_len() as usize;
        Self {
            layout,
            blocks: vec![vec![0; len]; n],
            events: Vec::new(),
            on_complete: Box::new(|_| {}),
        }
    }
}

impl SegmentSink for BlocksSink {
    fn destination(&mut self, index: usize, segment: usize, len: usize) -> Option<&mut [u8]> {
        self.events.push(Event::Dest(index, segment));
        let (offset, want) = self.layout.ranges().nth(segment)?;
        assert_eq!(len, want);
        Some(&mut self.blocks.get_mut(index)?[offset..offset + len])
    }

    fn segment_complete(&mut self, segment: usize, blocks: usize) {
        self.events.push(Event::Complete(segment, blocks));
        (self.on_complete)(segment);
    }
}

/// The events of a layer-major stream of `blocks` blocks × `segments` segments.
fn layer_major(blocks: usize, segments: usize) -> Vec<Event> {
    let mut out = Vec::new();
    for s in 0..segments {
        out.extend((0..blocks).map(|b| Event::Dest(b, s)));
        out.push(Event::Complete(s, blocks));
    }
    out
}

fn layout() -> SegmentLayout {
    // Uneven on purpose: a segment boundary in the middle of a record.
    SegmentLayout::new(vec![1000, 1048, 2048]).unwrap()
}

async fn pull_layers(
    client: &kvmesh_transfer::PullClient,
    addr: std::net::SocketAddr,
    hs: &[BlockHash],
    sink: &mut BlocksSink,
) -> LayerPullReport {
    let layout = sink.layout.clone();
    bounded(client.pull_layers(addr, "req-l", hs, &layout, sink, None)).await
}

#[tokio::test]
async fn layer_major_pull_is_byte_exact_and_completes_layer_by_layer() {
    let hs = hashes(8);
    for (secret, encrypt) in [(None, false), (Some("s"), false), (Some("s"), true)] {
        let p = start_producer(
            &hs,
            ServerConfig {
                secret: secret.map(Secret::from),
                encrypt,
                ..ServerConfig::default()
            },
        )
        .await;
        let client = client_for(p.addr, |c| {
            c.secret = secret.map(Secret::from);
            c.encrypt = encrypt;
        });
        let mut sink = BlocksSink::new(layout(), hs.len());
        let report = pull_layers(&client, p.addr, &hs, &mut sink).await;
        assert_eq!(
            report.outcome,
            PullOutcome::Complete,
            "{secret:?} {encrypt}"
        );
        assert_eq!(
            (report.blocks, report.segments, report.segment_blocks),
            (8, 3, 8)
        );
        assert_eq!(report.bytes, 8 * BLOCK_BYTES as u64);
        for (got, h) in sink.blocks.iter().zip(&hs) {
            assert_eq!(&got[..], &payload_for(*h)[..], "block {h:?}");
        }
        // Layer 0 of every block, its completion, then layer 1…
        assert_eq!(sink.events, layer_major(8, 3));
        // A pulled block counts once, whole, on both ends.
        assert_eq!(
            client.metrics().bytes(kvmesh_transfer::Direction::In),
            8 * BLOCK_BYTES as u64
        );
        assert_eq!(client.metrics().pulls("complete", "none"), 1);
        eventually("pins released", || p.source.pinned_blocks() == 0).await;
        // The connection is pooled and serves a plain pull next.
        assert_eq!(client.idle_connections(p.addr), 1);
        let (report, _) = pull(&client, p.addr, &hs).await;
        assert_eq!(report.outcome, PullOutcome::Complete);
    }
}

#[tokio::test]
async fn miss_in_the_middle_gives_every_layer_of_the_leading_run() {
    let hs = hashes(8);
    let mut held = hs.clone();
    held.remove(5);
    let p = start_producer(&held, ServerConfig::default()).await;
    let client = client_for(p.addr, |_| {});
    let mut sink = BlocksSink::new(layout(), hs.len());
    let report = pull_layers(&client, p.addr, &hs, &mut sink).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::Miss
        }
    );
    assert_eq!((report.blocks, report.segments), (5, 3));
    assert_eq!(sink.events, layer_major(5, 3));
    for (got, h) in sink.blocks.iter().zip(&hs).take(5) {
        assert_eq!(&got[..], &payload_for(*h)[..]);
    }
    assert_eq!(client.metrics().pulls("partial", "miss"), 1);
}

/// A fetch the lookup did not pin, of a prefix with a hole: the producer finds the miss while
/// resolving, streams every segment of the blocks before it, numbered by stream position
/// (`segment × requested + block`), and ends with `Done{Miss}` at the hole.
#[tokio::test]
async fn producer_streams_the_run_before_a_miss_in_stream_positions() {
    let hs = hashes(8);
    let mut held = hs.clone();
    held.remove(3);
    let p = start_producer(&held, ServerConfig::default()).await;
    let mut conn = handshake_raw(p.addr).await;
    conn.write_message(&Message::Fetch(Fetch {
        hashes: hs.clone(),
        pending_wait_ms: 0,
        background: false,
        segments: vec![1024, 3072],
    }))
    .await
    .unwrap();
    let mut positions = Vec::new();
    loop {
        match bounded(conn.read_message()).await.unwrap().unwrap() {
            Message::Block(b) => {
                assert!(b.checksum_ok());
                let (segment, block) = (b.index as usize / 8, b.index as usize % 8);
                let range = if segment == 0 { 0..1024 } else { 1024..4096 };
                assert_eq!(b.payload, payload_for(hs[block]).slice(range));
                positions.push(b.index);
            }
            Message::Done(d) => {
                assert_eq!(d.blocks, 3);
                assert_eq!(d.bytes, 3 * 4096);
                assert_eq!(d.end, FetchEnd::Miss { index: 3 });
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(positions, [0, 1, 2, 8, 9, 10]);
    eventually("pins released", || p.source.pinned_blocks() == 0).await;
}

#[tokio::test]
async fn bad_layouts_are_refused_and_counted() {
    assert_eq!(SegmentLayout::new(vec![]), Err(LayoutError::Empty));
    assert!(matches!(
        SegmentLayout::new(vec![2048, 0, 2048]),
        Err(LayoutError::ZeroLength { segment: 1 })
    ));
    let hs = hashes(4);
    let p = start_producer(&hs, ServerConfig::default()).await;
    // A layout that does not sum to the producer's block size.
    let client = client_for(p.addr, |_| {});
    let mut sink = BlocksSink::new(SegmentLayout::new(vec![1024, 1024]).unwrap(), hs.len());
    let report = pull_layers(&client, p.addr, &hs, &mut sink).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::BadLayout
        }
    );
    assert_eq!(report.bytes, 0, "nothing was sent");
    assert!(sink.events.is_empty());
    assert_eq!(client.metrics().pulls("failed", "bad_layout"), 1);
    assert_eq!(p.metrics.refused("bad_layout"), 1);
    // Malformed on the wire (a consumer that does not check): zero-length and too many
    // segments, each refused with a named error.
    for segments in [vec![0, 4096], vec![1; 5000]] {
        let mut conn = handshake_raw(p.addr).await;
        conn.write_message(&Message::Fetch(Fetch {
            hashes: hs.clone(),
            pending_wait_ms: 0,
            background: false,
            segments,
        }))
        .await
        .unwrap();
        match bounded(conn.read_message()).await.unwrap() {
            Some(Message::Error(e)) => {
                assert!(e.message.starts_with("bad segment layout"), "{}", e.message)
            }
            other => panic!("expected an error, got {other:?}"),
        }
    }
    assert_eq!(p.metrics.refused("bad_layout"), 3);
    eventually("pins released", || p.source.pinned_blocks() == 0).await;
}

/// A link that lets one block's worth of bytes out every `per_block`.
#[derive(Debug)]
struct SlowLink(Duration);

struct SlowFetch {
    start: Instant,
    per_block: Duration,
}

impl LinkPacer for SlowLink {
    fn begin(&self, _: usize, _: TrafficClass) -> Box<dyn PacedTransfer> {
        Box::new(SlowFetch {
            start: Instant::now(),
            per_block: self.0,
        })
    }
    fn modelled_bytes_per_block(&self) -> u64 {
        0
    }
}

impl PacedTransfer for SlowFetch {
    fn reached(&mut self, blocks: usize) -> BoxFuture<'_, ()> {
        let until = self.start + self.per_block * blocks as u32;
        Box::pin(tokio::time::sleep_until(until))
    }
    fn truncate(&mut self, _: usize) {}
}

#[tokio::test]
async fn producer_killed_mid_layer_reports_the_layers_that_completed() {
    let hs = hashes(8);
    let source = memory_source(&hs);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (kill_tx, kill_rx) = tokio::sync::oneshot::channel::<()>();
    // The producer lives in its own runtime; shutting that runtime down kills every task
    // abruptly, like a crashed process. Its link lets a block's worth out every 60 ms (a layer
    // of 8 blocks of this layout: 2 to 4 block-worths), so the kill lands inside layer 2.
    let producer = std::thread::spawn(move || {
        runtime.block_on(async move {
            let config = ServerConfig {
                egress: Some(Arc::new(SlowLink(Duration::from_millis(60)))),
                ..ServerConfig::default()
            };
            let (addr, _h) = ProducerServer::bind(
                "127.0.0.1:0",
                Arc::new(source),
                config,
                CancellationToken::new(),
            )
            .await
            .unwrap();
            tx.send(addr).unwrap();
            let _ = kill_rx.await;
        });
        runtime.shutdown_timeout(Duration::from_millis(10));
    });
    let addr = rx.await.unwrap();
    let client = client_for(addr, |_| {});
    let mut sink = BlocksSink::new(layout(), hs.len());
    let mut kill = Some(kill_tx);
    sink.on_complete = Box::new(move |segment| {
        if segment == 1
            && let Some(k) = kill.take()
        {
            let _ = k.send(());
        }
    });
    let report = pull_layers(&client, addr, &hs, &mut sink).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::PeerClosed
        },
        "no block has every layer"
    );
    assert_eq!(
        (report.blocks, report.segments, report.segment_blocks),
        (0, 2, 8)
    );
    assert_eq!(&sink.events[..18], &layer_major(8, 2)[..]);
    assert!(!sink.events.contains(&Event::Complete(2, 8)));
    for (got, h) in sink.blocks.iter().zip(&hs) {
        assert_eq!(
            &got[..2048],
            &payload_for(*h)[..2048],
            "layers 0 and 1 landed"
        );
    }
    assert_eq!(client.metrics().pulls("failed", "peer_closed"), 1);
    producer.join().unwrap();
}
