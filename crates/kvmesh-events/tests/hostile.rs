//! Hostile bytes on every socket kind (PUB, replay ROUTER, bound SUB), sent over raw TCP on
//! loopback: a 2^62-byte long-frame header, endless "more" frames, truncated and garbage
//! greetings, a subscription flood. After each the process must be alive, its RSS bounded, and
//! the same socket must still serve a well-behaved peer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvmesh_core::events::{EventBatch, KvEvent};
use kvmesh_events::{
    Publisher, PublisherConfig, SubscriberConfig, SubscriberItem, request_replay,
    subscribe_with_stats,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc::Receiver;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

fn cleared() -> EventBatch {
    EventBatch {
        ts: 1.0,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: Some(0),
    }
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn host_port(endpoint: &str) -> String {
    endpoint.trim_start_matches("tcp://").to_owned()
}

/// A ZMTP 3.0 greeting (NULL) followed by a READY naming `socket_type`.
fn greeting_and_ready(socket_type: &str) -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    let mut mechanism = b"NULL".to_vec();
    mechanism.resize(20, 0);
    g.extend(mechanism);
    g.push(0);
    g.extend([0u8; 31]);
    let mut body = b"\x05READY".to_vec();
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend((socket_type.len() as u32).to_be_bytes());
    body.extend(socket_type.as_bytes());
    g.extend([0x04, body.len() as u8]);
    g.extend(body);
    g
}

/// The ~90-byte packet of the issue: greeting, READY, then a long frame declaring 2^62 bytes.
fn length_bomb(socket_type: &str) -> Vec<u8> {
    let mut p = greeting_and_ready(socket_type);
    p.push(0x02);
    p.extend((1u64 << 62).to_be_bytes());
    p.extend([0xAB; 8]);
    p
}

/// Sends `bytes` and waits until the peer closes the connection (or 10 s pass).
async fn send_and_expect_close(addr: &str, bytes: &[u8]) -> bool {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut buf = vec![0u8; 4096];
    timeout(Duration::from_secs(10), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

async fn next_batch(rx: &mut Receiver<SubscriberItem>) -> u64 {
    timeout(Duration::from_secs(10), async {
        loop {
            match rx.recv().await.expect("open") {
                SubscriberItem::Batch { seq, .. } => return seq,
                _ => continue,
            }
        }
    })
    .await
    .expect("a batch in time")
}

async fn listening(rx: &mut Receiver<SubscriberItem>) -> String {
    timeout(Duration::from_secs(10), async {
        loop {
            if let SubscriberItem::Listening { endpoint } = rx.recv().await.expect("open") {
                return endpoint;
            }
        }
    })
    .await
    .expect("listening in time")
}

/// Publishes until the subscriber has a batch (PUB/SUB slow joiner).
async fn delivered(publisher: &mut Publisher, rx: &mut Receiver<SubscriberItem>) {
    timeout(Duration::from_secs(10), async {
        loop {
            publisher.publish(&cleared()).await.unwrap();
            if let Ok(Some(SubscriberItem::Batch { .. })) =
                timeout(Duration::from_millis(50), rx.recv()).await
            {
                return;
            }
        }
    })
    .await
    .expect("delivered in time");
}

#[tokio::test]
async fn length_bombs_and_endless_frames_leave_pub_and_replay_serving() {
    let mut config = PublisherConfig::new("tcp://127.0.0.1:0", "kv-events");
    config.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    let mut publisher = Publisher::start(config).await.unwrap();
    let stats = publisher.stats();
    let pub_addr = host_port(publisher.local_endpoint());
    let replay_ep = publisher.replay_endpoint().unwrap().to_owned();
    let rss_before = rss_kib();

    assert!(send_and_expect_close(&pub_addr, &length_bomb("SUB")).await);
    assert!(send_and_expect_close(&host_port(&replay_ep), &length_bomb("DEALER")).await);
    // Endless "more" frames: 1 MiB of empty frames that never end a message.
    let mut flood = greeting_and_ready("SUB");
    flood.extend(std::iter::repeat_n([0x01u8, 0x00], 1 << 19).flatten());
    assert!(send_and_expect_close(&pub_addr, &flood).await);
    let mut flood = greeting_and_ready("DEALER");
    flood.extend(std::iter::repeat_n([0x01u8, 0x00], 1 << 19).flatten());
    assert!(send_and_expect_close(&host_port(&replay_ep), &flood).await);
    // More subscriptions than a peer may hold.
    let mut subs = greeting_and_ready("SUB");
    for i in 0..200u32 {
        let topic = format!("\x01t{i}");
        subs.extend([0x00, topic.len() as u8]);
        subs.extend(topic.as_bytes());
    }
    assert!(send_and_expect_close(&pub_addr, &subs).await);
    // A peer of the wrong kind, and a greeting that is not ZMTP.
    assert!(send_and_expect_close(&pub_addr, &greeting_and_ready("PUB")).await);
    assert!(send_and_expect_close(&pub_addr, b"GET / HTTP/1.1\r\n\r\n").await);

    let grown = rss_kib().saturating_sub(rss_before);
    assert!(grown < 64 * 1024, "RSS grew by {grown} KiB");
    assert!(stats.protocol_errors() >= 6, "{}", stats.protocol_errors());

    // Still serving: a subscriber gets batches, replay answers.
    let cancel = CancellationToken::new();
    let (mut rx, _) = subscribe_with_stats(
        SubscriberConfig::connect(publisher.local_endpoint()),
        cancel.clone(),
    );
    listening(&mut rx).await;
    delivered(&mut publisher, &mut rx).await;
    let replayed = request_replay(&replay_ep, 0).await.unwrap();
    assert!(!replayed.is_empty());
    cancel.cancel();
}

#[tokio::test]
async fn a_bound_subscriber_survives_bombs_and_truncated_greetings() {
    let cancel = CancellationToken::new();
    let (mut rx, stats) =
        subscribe_with_stats(SubscriberConfig::bind("tcp://127.0.0.1:0"), cancel.clone());
    let ep = listening(&mut rx).await;
    let addr = host_port(&ep);
    let rss_before = rss_kib();

    assert!(send_and_expect_close(&addr, &length_bomb("PUB")).await);
    let mut flood = greeting_and_ready("PUB");
    flood.extend(std::iter::repeat_n([0x01u8, 0x00], 1 << 19).flatten());
    assert!(send_and_expect_close(&addr, &flood).await);
    // A frame bigger than the bound, declared honestly.
    let mut big = greeting_and_ready("PUB");
    big.push(0x02);
    big.extend(((64u64 << 20) + 1).to_be_bytes());
    assert!(send_and_expect_close(&addr, &big).await);
    // Truncated greetings: the peer hangs up mid-greeting, or sends half and goes quiet.
    let full = greeting_and_ready("PUB");
    for cut in [1, 10, 11, 40, 63] {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&full[..cut]).await.unwrap();
        drop(s);
    }
    let mut quiet = TcpStream::connect(&addr).await.unwrap();
    quiet.write_all(&full[..20]).await.unwrap();

    let grown = rss_kib().saturating_sub(rss_before);
    assert!(grown < 64 * 1024, "RSS grew by {grown} KiB");
    assert!(stats.protocol_errors() >= 3, "{}", stats.protocol_errors());

    // A well-behaved publisher connecting afterwards is heard.
    let mut publisher = Publisher::start(PublisherConfig::new(&ep, "kv-events"))
        .await
        .unwrap();
    let seq = publisher.publish(&cleared()).await.unwrap();
    assert_eq!(next_batch(&mut rx).await, seq);
    drop(quiet);
    cancel.cancel();
}

#[tokio::test]
async fn a_connected_subscriber_reports_a_hostile_publisher_and_reconnects() {
    // A fake "publisher" that bombs every subscriber that connects to it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ep = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = s.write_all(&length_bomb("PUB")).await;
                let mut sink = vec![0u8; 1024];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    let cancel = CancellationToken::new();
    let (mut rx, stats) = subscribe_with_stats(SubscriberConfig::connect(&ep), cancel.clone());
    let mut dropped = 0;
    timeout(Duration::from_secs(10), async {
        while dropped < 2 {
            if let Some(SubscriberItem::Error { error }) = rx.recv().await
                && error.contains("exceeds the bound")
            {
                dropped += 1;
            }
        }
    })
    .await
    .expect("the bomb is reported, and again after reconnecting");
    assert!(stats.protocol_errors() >= 2);
    cancel.cancel();
}
