//! Publisher ↔ subscriber over real loopback sockets: both bind/connect directions, gaps,
//! restarts, malformed frames, replay and the sync handle.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::events::{BlockRemoved, EventBatch, KvEvent, Medium};
use kvmesh_core::hashing::BlockHash;
use kvmesh_events::{
    Publisher, PublisherConfig, SubscriberConfig, SubscriberItem, request_replay, subscribe,
};
use tokio::sync::mpsc::Receiver;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

const LOOPBACK0: &str = "tcp://127.0.0.1:0";

fn batch(tag: u64) -> EventBatch {
    EventBatch {
        ts: tag as f64,
        events: vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash(tag)],
            medium: Medium::Gpu,
            group_idx: None,
        })],
        data_parallel_rank: Some(0),
    }
}

fn empty() -> EventBatch {
    EventBatch {
        ts: 0.0,
        events: vec![],
        data_parallel_rank: None,
    }
}

async fn next(rx: &mut Receiver<SubscriberItem>) -> SubscriberItem {
    timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("item in time")
        .expect("channel open")
}

/// Next item that is not a transient socket error.
async fn next_item(rx: &mut Receiver<SubscriberItem>) -> SubscriberItem {
    loop {
        match next(rx).await {
            SubscriberItem::Error { .. } => continue,
            other => return other,
        }
    }
}

async fn listening(rx: &mut Receiver<SubscriberItem>) -> String {
    match next_item(rx).await {
        SubscriberItem::Listening { endpoint } => endpoint,
        other => panic!("expected Listening, got {other:?}"),
    }
}

/// Beats PUB/SUB's slow-joiner drop: publishes empty batches until one arrives, returns the
/// seq of the first received one.
async fn sync(publisher: &mut Publisher, rx: &mut Receiver<SubscriberItem>) -> u64 {
    timeout(Duration::from_secs(10), async {
        loop {
            publisher.publish(&empty()).await.unwrap();
            if let Ok(Some(item)) = timeout(Duration::from_millis(50), rx.recv()).await {
                match item {
                    SubscriberItem::Batch { seq, .. } => return seq,
                    SubscriberItem::Error { .. } => {}
                    other => panic!("unexpected during sync: {other:?}"),
                }
            }
        }
    })
    .await
    .expect("subscriber in sync")
}

/// Drains batches produced by `sync` overshoot, returns the first non-empty item.
async fn next_meaningful(rx: &mut Receiver<SubscriberItem>) -> SubscriberItem {
    loop {
        match next_item(rx).await {
            SubscriberItem::Batch { batch, .. } if batch.events.is_empty() => continue,
            other => return other,
        }
    }
}

async fn expect_batch(rx: &mut Receiver<SubscriberItem>, want_seq: u64, want: &EventBatch) {
    match next_meaningful(rx).await {
        SubscriberItem::Batch { topic, seq, batch } => {
            assert_eq!(topic, "kv-events");
            assert_eq!(seq, want_seq);
            assert_eq!(&batch, want);
        }
        other => panic!("expected batch {want_seq}, got {other:?}"),
    }
}

#[tokio::test]
async fn publisher_binds_subscriber_connects() {
    let cancel = CancellationToken::new();
    let mut publisher = Publisher::start(PublisherConfig::new(LOOPBACK0, "kv-events"))
        .await
        .unwrap();
    let ep = publisher.local_endpoint().to_owned();
    assert!(
        ep.starts_with("tcp://127.0.0.1:") && !ep.ends_with(":0"),
        "{ep}"
    );
    let mut rx = subscribe(SubscriberConfig::connect(&ep), cancel.clone());
    listening(&mut rx).await;
    sync(&mut publisher, &mut rx).await;
    for tag in 1..=3 {
        let seq = publisher.publish(&batch(tag)).await.unwrap();
        expect_batch(&mut rx, seq, &batch(tag)).await;
    }
    cancel.cancel();
}

#[tokio::test]
async fn subscriber_binds_publisher_connects() {
    let cancel = CancellationToken::new();
    let mut rx = subscribe(SubscriberConfig::bind(LOOPBACK0), cancel.clone());
    let ep = listening(&mut rx).await;
    let mut publisher = Publisher::start(PublisherConfig::new(&ep, "kv-events"))
        .await
        .unwrap();
    assert!(publisher.is_connected());
    sync(&mut publisher, &mut rx).await;
    let seq = publisher.publish(&batch(9)).await.unwrap();
    expect_batch(&mut rx, seq, &batch(9)).await;
    cancel.cancel();
}

#[tokio::test]
async fn connect_mode_publisher_waits_for_a_late_subscriber() {
    // Reserve a port, free it, start the publisher against it before anyone listens.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ep = format!("tcp://127.0.0.1:{port}");
    let mut publisher = Publisher::start(PublisherConfig::new(&ep, "kv-events"))
        .await
        .unwrap();
    assert!(!publisher.is_connected());
    publisher.publish(&batch(1)).await.unwrap(); // dropped: nobody listens yet
    let cancel = CancellationToken::new();
    let mut rx = subscribe(SubscriberConfig::bind(&ep), cancel.clone());
    listening(&mut rx).await;
    sync(&mut publisher, &mut rx).await;
    assert!(publisher.is_connected());
    cancel.cancel();
}

#[tokio::test]
async fn gaps_restarts_and_garbage_are_reported_and_skipped() {
    let cancel = CancellationToken::new();
    let mut publisher = Publisher::start(PublisherConfig::new(LOOPBACK0, "kv-events"))
        .await
        .unwrap();
    let mut rx = subscribe(
        SubscriberConfig::connect(publisher.local_endpoint()),
        cancel.clone(),
    );
    listening(&mut rx).await;
    sync(&mut publisher, &mut rx).await;

    // Gap: skip 5 sequence numbers.
    let before = publisher.next_seq();
    publisher.set_next_seq(before + 5);
    let seq = publisher.publish(&batch(1)).await.unwrap();
    match next_meaningful(&mut rx).await {
        SubscriberItem::Gap { expected, got, .. } => assert_eq!((expected, got), (before, seq)),
        other => panic!("expected gap, got {other:?}"),
    }
    expect_batch(&mut rx, seq, &batch(1)).await;

    // Garbage: wrong part count, short seq, undecodable payload. None stops the stream.
    publisher
        .send_raw_parts(vec![Bytes::from_static(b"only-one-part")])
        .await
        .unwrap();
    let mut bad_seq = vec![
        Bytes::from_static(b"kv-events"),
        Bytes::from_static(b"\x01\x02"),
    ];
    bad_seq.push(Bytes::from_static(b"\x90"));
    publisher.send_raw_parts(bad_seq).await.unwrap();
    let s = publisher.next_seq();
    publisher.set_next_seq(s + 1);
    publisher
        .send_raw_parts(vec![
            Bytes::from_static(b"kv-events"),
            Bytes::copy_from_slice(&s.to_be_bytes()),
            Bytes::from_static(b"\xc1garbage"),
        ])
        .await
        .unwrap();
    for expect_seq in [None, None, Some(s)] {
        match next_meaningful(&mut rx).await {
            SubscriberItem::Malformed { seq, error } => {
                assert_eq!(seq, expect_seq, "{error}");
                assert!(!error.is_empty());
            }
            other => panic!("expected malformed, got {other:?}"),
        }
    }
    let seq = publisher.publish(&batch(2)).await.unwrap();
    assert_eq!(
        seq,
        s + 1,
        "a malformed payload still counts as seen: no false gap"
    );
    expect_batch(&mut rx, seq, &batch(2)).await;

    // Restart: the engine came back and numbers from 0 again.
    publisher.set_next_seq(0);
    publisher.publish(&batch(3)).await.unwrap();
    match next_meaningful(&mut rx).await {
        SubscriberItem::Restart {
            last_seq, new_seq, ..
        } => assert_eq!((last_seq, new_seq), (s + 1, 0)),
        other => panic!("expected restart, got {other:?}"),
    }
    expect_batch(&mut rx, 0, &batch(3)).await;
    cancel.cancel();
}

#[tokio::test]
async fn replay_endpoint_serves_the_ring_and_late_joiners_catch_up() {
    let mut cfg = PublisherConfig::new(LOOPBACK0, "kv-events");
    cfg.replay_endpoint = Some(LOOPBACK0.to_owned());
    cfg.replay_buffer = 4;
    let mut publisher = Publisher::start(cfg).await.unwrap();
    let replay_ep = publisher.replay_endpoint().unwrap().to_owned();
    for tag in 0..6 {
        publisher.publish(&batch(tag)).await.unwrap();
    }
    // The ring keeps the last 4 of 6.
    let got = request_replay(&replay_ep, 0).await.unwrap();
    assert_eq!(
        got.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![2, 3, 4, 5]
    );
    assert_eq!(got[0].1, batch(2));
    let got = request_replay(&replay_ep, 4).await.unwrap();
    assert_eq!(got.len(), 2);
    assert!(request_replay(&replay_ep, 100).await.unwrap().is_empty());

    // A subscriber that joins now receives the still-buffered history first.
    let cancel = CancellationToken::new();
    let mut sub = SubscriberConfig::connect(publisher.local_endpoint());
    sub.replay_endpoint = Some(replay_ep);
    let mut rx = subscribe(sub, cancel.clone());
    listening(&mut rx).await;
    let first = timeout(Duration::from_secs(10), async {
        loop {
            publisher.publish(&empty()).await.unwrap();
            if let Ok(Some(SubscriberItem::Batch { seq, .. })) =
                timeout(Duration::from_millis(50), rx.recv()).await
            {
                return seq;
            }
        }
    })
    .await
    .unwrap();
    assert!(
        first <= 5,
        "history replayed before live batches (first seq {first})"
    );
    let mut last = first;
    // Everything after arrives contiguously, with no Gap items.
    while last < publisher.next_seq() - 1 {
        match next_item(&mut rx).await {
            SubscriberItem::Batch { seq, .. } => {
                assert_eq!(seq, last + 1);
                last = seq;
            }
            other => panic!("expected contiguous batches, got {other:?}"),
        }
    }
    cancel.cancel();
}

#[tokio::test]
async fn unreplayable_gap_is_reported_after_asking_replay() {
    let mut cfg = PublisherConfig::new(LOOPBACK0, "kv-events");
    cfg.replay_endpoint = Some(LOOPBACK0.to_owned());
    let mut publisher = Publisher::start(cfg).await.unwrap();
    let cancel = CancellationToken::new();
    let mut sub = SubscriberConfig::connect(publisher.local_endpoint());
    sub.replay_endpoint = publisher.replay_endpoint().map(str::to_owned);
    let mut rx = subscribe(sub, cancel.clone());
    listening(&mut rx).await;
    sync(&mut publisher, &mut rx).await;
    let before = publisher.next_seq();
    publisher.set_next_seq(before + 3); // never published: not in the ring either
    let seq = publisher.publish(&batch(7)).await.unwrap();
    match next_meaningful(&mut rx).await {
        SubscriberItem::Gap { expected, got, .. } => assert_eq!((expected, got), (before, seq)),
        other => panic!("expected gap, got {other:?}"),
    }
    expect_batch(&mut rx, seq, &batch(7)).await;
    cancel.cancel();
}

#[tokio::test]
async fn handle_sends_from_sync_code_in_order() {
    let cancel = CancellationToken::new();
    let publisher = Publisher::start(PublisherConfig::new(LOOPBACK0, "kv-events"))
        .await
        .unwrap();
    let ep = publisher.local_endpoint().to_owned();
    let mut rx = subscribe(SubscriberConfig::connect(&ep), cancel.clone());
    listening(&mut rx).await;
    let handle = publisher.spawn(cancel.clone());
    // Sync: keep sending empties from a plain thread until the subscriber sees one.
    let h2 = handle.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let pump = std::thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = h2.send(empty());
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    loop {
        if let SubscriberItem::Batch { .. } = next_item(&mut rx).await {
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    pump.join().unwrap();
    for tag in 10..15 {
        handle.send(batch(tag)).unwrap();
    }
    // Batches queued faster than the socket drains may leave merged (one message, events in
    // order, the first batch's timestamp): what matters is every event, once, in order.
    let mut seen = Vec::new();
    let mut last_seq = None;
    while seen.len() < 5 {
        match next_meaningful(&mut rx).await {
            SubscriberItem::Batch { seq, batch, .. } => {
                if let Some(l) = last_seq {
                    assert!(seq > l);
                }
                last_seq = Some(seq);
                assert_eq!(
                    batch.ts as u64,
                    10 + seen.len() as u64,
                    "oldest event's time"
                );
                for ev in &batch.events {
                    match ev {
                        KvEvent::BlockRemoved(r) => seen.push(r.block_hashes[0].0),
                        other => panic!("unexpected event {other:?}"),
                    }
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, vec![10, 11, 12, 13, 14]);
    assert_eq!(handle.dropped(), 0);
    cancel.cancel();
}

/// An engine restart: the publisher's whole runtime goes away (closing its sockets, as a dying
/// process would), a new publisher binds the same port and numbers from 0 again.
#[test]
fn subscriber_reconnects_to_a_restarted_publisher_and_reports_restart() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let engine_a = tokio::runtime::Runtime::new().unwrap();
    let cancel = CancellationToken::new();
    let mut a = engine_a
        .block_on(Publisher::start(PublisherConfig::new(
            LOOPBACK0,
            "kv-events",
        )))
        .unwrap();
    let ep = a.local_endpoint().to_owned();
    a.set_next_seq(1_000_000);
    let mut rx = rt.block_on(async { subscribe(SubscriberConfig::connect(&ep), cancel.clone()) });
    rt.block_on(listening(&mut rx));
    // Sync across runtimes: publish on the engine's, receive on ours.
    let mut synced = false;
    for _ in 0..200 {
        engine_a.block_on(a.publish(&empty())).unwrap();
        if let Ok(Some(SubscriberItem::Batch { .. })) =
            rt.block_on(async { timeout(Duration::from_millis(50), rx.recv()).await })
        {
            synced = true;
            break;
        }
    }
    assert!(synced);
    drop(a);
    engine_a.shutdown_timeout(Duration::from_secs(2));

    let engine_b = tokio::runtime::Runtime::new().unwrap();
    let mut cfg_b = PublisherConfig::new(&ep, "kv-events");
    cfg_b.bind = true;
    let mut b = engine_b
        .block_on(Publisher::start(cfg_b))
        .expect("rebind the same port");
    let mut errors = 0;
    let mut restart = None;
    for _ in 0..300 {
        engine_b.block_on(b.publish(&empty())).unwrap();
        match rt.block_on(async { timeout(Duration::from_millis(50), rx.recv()).await }) {
            Ok(Some(SubscriberItem::Error { .. })) => errors += 1,
            Ok(Some(SubscriberItem::Listening { .. })) => {}
            Ok(Some(SubscriberItem::Batch { batch, .. })) if batch.events.is_empty() => {}
            Ok(Some(other)) => {
                restart = Some(other);
                break;
            }
            _ => {}
        }
    }
    match restart {
        Some(SubscriberItem::Restart {
            last_seq, new_seq, ..
        }) => {
            assert!(last_seq >= 1_000_000);
            assert!(new_seq < 1_000_000);
        }
        other => panic!("expected restart after reconnect, got {other:?}"),
    }
    assert!(
        errors <= 3,
        "a disconnect is reported once or twice, not in a loop ({errors})"
    );
    cancel.cancel();
}
