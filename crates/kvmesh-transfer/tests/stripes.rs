//! Pulls striped over several connections to one real producer on loopback: the sink still sees
//! the prefix in order, a stripe that dies keeps the blocks before its gap, the producer's caps
//! (fetch streams and connections per peer) bound the stripes, pins are released per connection,
//! and one stripe per peer at a time keeps concurrent pulls from stalling each other.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    BLOCK_BYTES, VerifySink, bounded, client_for, eventually, hashes, payload_for, proxy_stalling,
    pull, start_producer,
};
use kvmesh_core::BlockHash;
use kvmesh_transfer::{
    BlockSink, Direction, PullOutcome, PullReason, Secret, ServerConfig, SinkError,
};

#[tokio::test]
async fn striped_pulls_over_2_and_4_connections_deliver_the_prefix_in_order() {
    let hs = hashes(37);
    for stripes in [2usize, 4] {
        let p = start_producer(&hs, ServerConfig::default()).await;
        let client = client_for(p.addr, |c| c.stripes = stripes);
        // `pull` checks that the sink saw exactly the leading blocks, in order.
        let (report, sink) = pull(&client, p.addr, &hs).await;
        assert_eq!(report.outcome, PullOutcome::Complete, "{stripes} stripes");
        assert_eq!(sink.got, hs);
        assert_eq!(report.bytes, 37 * BLOCK_BYTES as u64);
        assert_eq!(client.metrics().connections_opened(), stripes as u64);
        assert_eq!(client.metrics().blocks(Direction::In), 37);
        eventually("pins released by every stripe", || {
            p.source.pinned_blocks() == 0
        })
        .await;
        eventually("every stripe served its share", || {
            p.metrics.fetches_served() == stripes as u64
        })
        .await;
        // The next pull rides the pooled connections, all of them.
        let (report, _) = pull(&client, p.addr, &hs[..9]).await;
        assert_eq!(report.outcome, PullOutcome::Complete);
        assert_eq!(client.metrics().connections_reused(), stripes as u64);
        assert_eq!(client.idle_connections(p.addr), stripes);
    }
}

#[tokio::test]
async fn a_striped_pull_is_authenticated_or_encrypted_like_a_plain_one() {
    let hs = hashes(12);
    for encrypt in [false, true] {
        let p = start_producer(
            &hs,
            ServerConfig {
                secret: Some(Secret::from("s")),
                encrypt,
                ..ServerConfig::default()
            },
        )
        .await;
        let client = client_for(p.addr, |c| {
            c.stripes = 3;
            c.secret = Some(Secret::from("s"));
            c.encrypt = encrypt;
        });
        let (report, sink) = pull(&client, p.addr, &hs).await;
        assert_eq!(report.outcome, PullOutcome::Complete, "encrypt {encrypt}");
        assert_eq!(sink.got, hs);
    }
}

/// A sink that cuts one of the proxy's connections once it holds `after` blocks.
struct CutAfter {
    inner: VerifySink,
    after: usize,
    cut: Option<Box<dyn FnOnce() + Send>>,
}

impl BlockSink for CutAfter {
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        self.inner.accept(index, hash, payload)?;
        if self.inner.got.len() == self.after
            && let Some(cut) = self.cut.take()
        {
            cut();
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_stripe_that_dies_mid_pull_keeps_the_blocks_before_its_gap() {
    let hs = hashes(48);
    for stripes in [2usize, 4] {
        let p = start_producer(&hs, ServerConfig::default()).await;
        // The second connection (one of stripes 1..k: stripe 0's connection opens first) stalls
        // after its handshake, lookup reply and one and a half blocks, so it cannot have sent
        // all its blocks ahead into socket buffers when it is cut.
        let stall = 100 + (BLOCK_BYTES + 25) * 3 / 2;
        let px = Arc::new(proxy_stalling(p.addr, Some((1, stall))).await);
        let client = client_for(px.addr, |c| c.stripes = stripes);
        let cutter = Arc::clone(&px);
        let mut sink = CutAfter {
            inner: VerifySink::default(),
            after: 1,
            cut: Some(Box::new(move || cutter.cut(1))),
        };
        let report = bounded(client.pull(px.addr, "r", &hs, &mut sink)).await;
        let got = &sink.inner.got;
        assert_eq!(
            report.outcome,
            PullOutcome::Partial {
                reason: PullReason::PeerClosed
            },
            "{stripes} stripes"
        );
        assert_eq!(
            report.blocks,
            got.len(),
            "the report counts what the sink took"
        );
        assert_eq!(got[..], hs[..got.len()], "a prefix, in order");
        assert!((1..hs.len()).contains(&got.len()), "{}", got.len());
        // The gap is one of the dead stripe's blocks (not stripe 0's: its connection lived).
        assert_ne!(
            got.len() % stripes,
            0,
            "the prefix ends at the dead stripe's first loss"
        );
        assert_eq!(client.metrics().pulls("partial", "peer_closed"), 1);
        eventually("the producer releases every stripe's pins", || {
            p.source.pinned_blocks() == 0
        })
        .await;
        assert!(
            client.idle_connections(px.addr) < stripes,
            "the dead connection is not pooled"
        );
    }
}

#[tokio::test]
async fn a_miss_in_the_middle_ends_a_striped_pull_there() {
    let hs = hashes(20);
    let mut held = hs.clone();
    held.remove(7);
    let p = start_producer(&held, ServerConfig::default()).await;
    let client = client_for(p.addr, |c| c.stripes = 3);
    let (report, sink) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::Miss
        }
    );
    assert_eq!(sink.got, hs[..7]);
    eventually("pins released", || p.source.pinned_blocks() == 0).await;
    // The stripes ended cleanly with `Done`: all of them are pooled for the next pull.
    assert_eq!(client.idle_connections(p.addr), 3);
    // A miss at block 1: stripes 2 and 3 pinned blocks they will not fetch; their empty lookups
    // release them now (not at the 10 s lease), and every connection stays pooled.
    let mut held = hs.clone();
    held.remove(1);
    let p4 = start_producer(&held, ServerConfig::default()).await;
    let client4 = client_for(p4.addr, |c| c.stripes = 4);
    let (report, sink) = pull(&client4, p4.addr, &hs).await;
    assert_eq!(
        (report.outcome, sink.got.len()),
        (
            PullOutcome::Partial {
                reason: PullReason::Miss
            },
            1
        )
    );
    eventually("pins of the stripes that fetched nothing released", || {
        p4.source.pinned_blocks() == 0
    })
    .await;
    assert_eq!(client4.idle_connections(p4.addr), 4);
    let missing_first: Vec<BlockHash> = hs.iter().map(|h| BlockHash(h.0 + 999)).collect();
    let (report, _) = pull(&client, p.addr, &missing_first).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::Miss
        }
    );
}

#[tokio::test]
async fn stripes_never_exceed_the_producers_fetch_streams_per_peer() {
    let hs = hashes(16);
    let p = start_producer(
        &hs,
        ServerConfig {
            max_transfers_per_peer: 2,
            ..ServerConfig::default()
        },
    )
    .await;
    let client = client_for(p.addr, |c| c.stripes = 4);
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(
        client.metrics().connections_opened(),
        2,
        "the producer announced 2 fetch streams per peer"
    );
}

#[tokio::test]
async fn a_refused_connection_leaves_a_striped_pull_fewer_stripes_not_a_failure() {
    let hs = hashes(16);
    let p = start_producer(
        &hs,
        ServerConfig {
            max_connections_per_ip: 2,
            ..ServerConfig::default()
        },
    )
    .await;
    let client = client_for(p.addr, |c| c.stripes = 4);
    let (report, sink) = pull(&client, p.addr, &hs).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(sink.got, hs);
    assert_eq!(client.metrics().connections_opened(), 2);
    eventually("the extra connections counted as refused", || {
        p.metrics.refused("connection_cap") == 2
    })
    .await;
}

#[tokio::test]
async fn concurrent_striped_pulls_to_one_peer_never_stall_each_other() {
    let hs = hashes(64);
    let p = start_producer(
        &hs,
        ServerConfig {
            max_transfers_per_peer: 2,
            ..ServerConfig::default()
        },
    )
    .await;
    let client = Arc::new(client_for(p.addr, |c| {
        c.stripes = 2;
        c.timeout = Duration::from_secs(10);
    }));
    let pulls = (0..4).map(|i| {
        let (client, hs, addr) = (Arc::clone(&client), hs.clone(), p.addr);
        tokio::spawn(async move {
            let mut sink = VerifySink::default();
            let report = client.pull(addr, &format!("r{i}"), &hs, &mut sink).await;
            (report, sink.got.len())
        })
    });
    // Two gangs of two stripes each could each hold one of the two fetch slots and wait for the
    // other forever; one striped pull per peer at a time (the others go plain) cannot.
    let results = bounded(futures::future::join_all(pulls)).await;
    for r in results {
        let (report, got) = r.unwrap();
        assert_eq!(report.outcome, PullOutcome::Complete);
        assert_eq!(got, 64);
    }
}

/// A sink that offers its own memory for every payload.
#[derive(Default)]
struct SlotSink {
    slot: Vec<u8>,
    written: Vec<BlockHash>,
    accepted: usize,
}

impl BlockSink for SlotSink {
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        assert_eq!(payload, payload_for(hash));
        assert_eq!(index, self.accepted + self.written.len());
        self.accepted += 1;
        Ok(())
    }

    fn destination(&mut self, _: usize, _: BlockHash, len: usize) -> Option<&mut [u8]> {
        self.slot = vec![0xee; len];
        Some(&mut self.slot)
    }

    fn accept_written(&mut self, index: usize, hash: BlockHash) -> Result<(), SinkError> {
        assert_eq!(index, self.accepted + self.written.len());
        if self.slot != payload_for(hash) {
            return Err(SinkError {
                index,
                reason: "not the payload".into(),
            });
        }
        self.written.push(hash);
        Ok(())
    }
}

#[tokio::test]
async fn a_plain_pull_writes_payloads_into_the_sinks_memory_and_a_striped_one_hands_them_over() {
    let hs = hashes(10);
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
        for stripes in [1usize, 2] {
            let client = client_for(p.addr, |c| {
                c.secret = secret.map(Secret::from);
                c.encrypt = encrypt;
                c.stripes = stripes;
            });
            let mut sink = SlotSink::default();
            let report = bounded(client.pull(p.addr, "r", &hs, &mut sink)).await;
            assert_eq!(report.outcome, PullOutcome::Complete);
            if stripes == 1 {
                assert_eq!((sink.written.len(), sink.accepted), (10, 0));
            } else {
                assert_eq!((sink.written.len(), sink.accepted), (0, 10));
            }
        }
    }
}
