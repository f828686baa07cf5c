//! kvmesh-events against libzmq — the library vLLM's pyzmq wraps — as the peer: vLLM 0.32's replay
//! framing in both directions (golden frames), PUB/SUB both ways, and a connecting publisher whose
//! early events wait for a late-binding subscriber.
//!
//! Two kinds of evidence: a recording of vLLM 0.32's own `ZmqEventPublisher` answering a replay
//! (`tests/fixtures/vllm/replay_capture.json`, made by `scripts/record-vllm-replay.py`), replayed
//! verbatim to kvmesh's client and compared byte for byte with kvmesh's server; and a libzmq ROUTER
//! transcribed from vLLM 0.32's `vllm/distributed/kv_events.py`
//! (`ZmqEventPublisher._service_replay`):
//!
//! ```python
//! frame = self._replay.recv_multipart()
//! if len(frame) != 3: ...warning; return
//! client_id, _, start_seq_bytes = frame
//! start_seq = int.from_bytes(start_seq_bytes, "big")
//! for seq, buf in self._buffer:
//!     if seq >= start_seq:
//!         self._replay.send_multipart((client_id, b"", self._topic_bytes, seq.to_bytes(8, "big"), buf))
//! self._replay.send_multipart((client_id, b"", b"", self.END_SEQ, b""))   # END_SEQ = (-1).to_bytes(8, "big", signed=True)
//! ```
//!
//! and the payloads are the real vLLM payloads of `tests/fixtures/vllm/capture2.json`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use base64::Engine as _;
use kvmesh_core::events::{EventBatch, KvEvent, decode_batch};
use kvmesh_events::{
    Publisher, PublisherConfig, REPLAY_END_SEQ, SubscriberConfig, SubscriberItem,
    request_replay_outcome, subscribe,
};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

/// `(seq, payload)` of every frame vLLM 0.32 published in the capture.
fn captured() -> Vec<(u64, Vec<u8>)> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vllm/capture2.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let payload = base64::engine::general_purpose::STANDARD
                .decode(f["payload_b64"].as_str().unwrap())
                .unwrap();
            (f["seq"].as_u64().unwrap(), payload)
        })
        .collect()
}

/// vLLM's replay ROUTER, transcribed from `_service_replay` above; serves `requests` requests.
fn vllm_replay_server(
    topic: &'static [u8],
    buffer: Vec<(u64, Vec<u8>)>,
    requests: usize,
) -> String {
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.bind("tcp://127.0.0.1:0").unwrap();
    let ep = router.get_last_endpoint().unwrap().unwrap();
    thread::spawn(move || {
        let _ctx = ctx;
        for _ in 0..requests {
            let frame = router.recv_multipart(0).unwrap();
            if frame.len() != 3 {
                continue;
            }
            let (client_id, start) = (&frame[0], &frame[2]);
            let start_seq = start.iter().fold(0u64, |a, b| (a << 8) | u64::from(*b));
            for (seq, buf) in &buffer {
                if *seq >= start_seq {
                    let seq_bytes = seq.to_be_bytes();
                    let parts: Vec<&[u8]> = vec![client_id, b"", topic, &seq_bytes, buf];
                    router.send_multipart(parts, 0).unwrap();
                }
            }
            let end: Vec<&[u8]> = vec![client_id, b"", b"", &REPLAY_END_SEQ, b""];
            router.send_multipart(end, 0).unwrap();
        }
    });
    ep
}

/// Asks `ep` for a replay as a libzmq DEALER sending `request` (as vLLM's own clients do) and
/// returns every reply up to and including the end marker.
async fn dealer_replay(ep: String, request: Vec<Vec<u8>>) -> Vec<Vec<Vec<u8>>> {
    tokio::task::spawn_blocking(move || {
        let ctx = zmq::Context::new();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_linger(0).unwrap();
        dealer.set_rcvtimeo(5000).unwrap();
        dealer.connect(&ep).unwrap();
        dealer.send_multipart(request, 0).unwrap();
        let mut got = Vec::new();
        loop {
            let m = dealer.recv_multipart(0).unwrap();
            let end = m.get(2).is_some_and(|s| s[..] == REPLAY_END_SEQ);
            got.push(m);
            if end {
                return got;
            }
        }
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn the_replay_client_reads_vllm_032_framing() {
    let frames = captured();
    assert!(!frames.is_empty());
    let ep = vllm_replay_server(b"kv-events", frames.clone(), 2);
    let all = request_replay_outcome(&ep, 0).await.unwrap();
    assert_eq!(all.malformed, 0);
    let want: Vec<(u64, EventBatch)> = frames
        .iter()
        .map(|(s, p)| (*s, decode_batch(p).unwrap()))
        .collect();
    assert_eq!(all.batches, want);
    // From a later seq: only what vLLM's `seq >= start_seq` keeps.
    let from = frames[1].0;
    let tail = request_replay_outcome(&ep, from).await.unwrap();
    assert_eq!(tail.batches, want[1..].to_vec());
}

#[tokio::test]
async fn kvmesh_replay_server_answers_exactly_like_vllm() {
    let mut config = PublisherConfig::new("tcp://127.0.0.1:0", "kv-events");
    config.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    let mut publisher = Publisher::start(config).await.unwrap();
    let frames = captured();
    let mut seqs = Vec::new();
    for (_, payload) in &frames {
        seqs.push(
            publisher
                .publish_payload(payload.clone().into())
                .await
                .unwrap(),
        );
    }
    let ep = publisher.replay_endpoint().unwrap().to_owned();
    // REQ's envelope: an empty delimiter, then the start seq.
    let got = dealer_replay(ep, vec![vec![], 1u64.to_be_bytes().to_vec()]).await;
    let mut want: Vec<Vec<Vec<u8>>> = frames
        .iter()
        .zip(&seqs)
        .filter(|(_, s)| **s >= 1)
        .map(|((_, p), s)| {
            vec![
                vec![],
                b"kv-events".to_vec(),
                s.to_be_bytes().to_vec(),
                p.clone(),
            ]
        })
        .collect();
    want.push(vec![vec![], vec![], REPLAY_END_SEQ.to_vec(), vec![]]);
    assert_eq!(got, want);
}

#[tokio::test]
async fn libzmq_sub_hears_a_bound_kvmesh_pub() {
    let mut publisher = Publisher::start(PublisherConfig::new("tcp://127.0.0.1:0", "kv-events"))
        .await
        .unwrap();
    let ep = publisher.local_endpoint().to_owned();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<Vec<u8>>>();
    let reader = thread::spawn(move || {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_linger(0).unwrap();
        sub.set_subscribe(b"kv").unwrap();
        sub.set_rcvtimeo(10_000).unwrap();
        sub.connect(&ep).unwrap();
        if let Ok(m) = sub.recv_multipart(0) {
            let _ = tx.send(m);
        }
    });
    let batch = EventBatch {
        ts: 2.0,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: Some(0),
    };
    let got = timeout(Duration::from_secs(10), async {
        loop {
            publisher.publish(&batch).await.unwrap();
            if let Ok(m) = rx.try_recv() {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("libzmq SUB received");
    assert_eq!(got.len(), 3);
    assert_eq!(got[0], b"kv-events");
    assert_eq!(decode_batch(&got[2]).unwrap(), batch);
    reader.join().unwrap();
}

#[tokio::test]
async fn a_connecting_kvmesh_pub_keeps_early_events_for_a_late_libzmq_sub() {
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
    // Published while nobody listens: buffered, not lost.
    let mut early = Vec::new();
    for _ in 0..3 {
        early.push(
            publisher
                .publish(&EventBatch {
                    ts: 3.0,
                    events: vec![KvEvent::AllBlocksCleared],
                    data_parallel_rank: None,
                })
                .await
                .unwrap(),
        );
    }
    let got = tokio::task::spawn_blocking(move || {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_linger(0).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(10_000).unwrap();
        sub.bind(&ep).unwrap();
        (0..3)
            .map(|_| {
                let m = sub.recv_multipart(0).unwrap();
                u64::from_be_bytes(m[1].as_slice().try_into().unwrap())
            })
            .collect::<Vec<u64>>()
    })
    .await
    .unwrap();
    assert_eq!(got, early, "every early batch, in order");
}

#[tokio::test]
async fn kvmesh_sub_hears_a_libzmq_pub_both_ways() {
    for bind_sub in [false, true] {
        let cancel = CancellationToken::new();
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        let mut rx = if bind_sub {
            let mut rx = subscribe(SubscriberConfig::bind("tcp://127.0.0.1:0"), cancel.clone());
            let ep = loop {
                if let Some(SubscriberItem::Listening { endpoint }) = rx.recv().await {
                    break endpoint;
                }
            };
            publisher.connect(&ep).unwrap();
            rx
        } else {
            publisher.bind("tcp://127.0.0.1:0").unwrap();
            let ep = publisher.get_last_endpoint().unwrap().unwrap();
            subscribe(SubscriberConfig::connect(ep), cancel.clone())
        };
        let (_, payload) = captured().remove(0);
        let seq = timeout(Duration::from_secs(10), async {
            loop {
                let seq_bytes = 7u64.to_be_bytes();
                let parts: Vec<&[u8]> = vec![b"kv-events", &seq_bytes, &payload];
                publisher.send_multipart(parts, zmq::DONTWAIT).unwrap();
                if let Ok(Some(SubscriberItem::Batch { seq, batch, .. })) =
                    timeout(Duration::from_millis(50), rx.recv()).await
                {
                    assert_eq!(batch, decode_batch(&payload).unwrap());
                    return seq;
                }
            }
        })
        .await
        .expect("batch from libzmq");
        assert_eq!(seq, 7, "bind_sub={bind_sub}");
        cancel.cancel();
    }
}

/// `tests/fixtures/vllm/replay_capture.json`: vLLM 0.32's own `ZmqEventPublisher` run by
/// `scripts/record-vllm-replay.py` — the request a DEALER sent and every reply it received.
struct Recording {
    request: Vec<Vec<u8>>,
    replies: Vec<Vec<Vec<u8>>>,
}

fn recording() -> Recording {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm/replay_capture.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let frames = |a: &serde_json::Value| -> Vec<Vec<u8>> {
        a.as_array()
            .unwrap()
            .iter()
            .map(|h| hex::decode(h.as_str().unwrap()).unwrap())
            .collect()
    };
    Recording {
        request: frames(&v["request_hex"]),
        replies: v["replies_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(frames)
            .collect(),
    }
}

/// A ROUTER that answers one request with the recorded replies, verbatim, and hands back what the
/// client sent (without the identity ROUTER adds).
fn recorded_replay_server(
    replies: Vec<Vec<Vec<u8>>>,
) -> (String, std::sync::mpsc::Receiver<Vec<Vec<u8>>>) {
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.bind("tcp://127.0.0.1:0").unwrap();
    let ep = router.get_last_endpoint().unwrap().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let _ctx = ctx;
        let mut frame = router.recv_multipart(0).unwrap();
        let client_id = frame.remove(0);
        tx.send(frame).unwrap();
        for reply in &replies {
            let mut parts: Vec<&[u8]> = vec![&client_id];
            parts.extend(reply.iter().map(Vec::as_slice));
            router.send_multipart(parts, 0).unwrap();
        }
    });
    (ep, rx)
}

/// The recorded batches decode to what vLLM published (seq 1 and 2 of three), the client's request
/// is byte for byte what vLLM's ROUTER was sent, and nothing is counted malformed.
#[tokio::test]
async fn the_replay_client_reads_a_recorded_vllm_replay() {
    let rec = recording();
    let (ep, sent) = recorded_replay_server(rec.replies.clone());
    let out = request_replay_outcome(&ep, 1).await.unwrap();
    assert_eq!(
        sent.recv().unwrap(),
        rec.request,
        "kvmesh's request = the recorded one"
    );
    assert_eq!(out.malformed, 0);
    let seqs: Vec<u64> = out.batches.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![1, 2]);
    let (_, first) = &out.batches[0];
    assert_eq!(first.events.len(), 2, "{first:?}");
    match (&first.events[0], &first.events[1]) {
        (KvEvent::BlockStored(s), KvEvent::BlockRemoved(r)) => {
            assert_eq!(s.token_ids, (32..48).collect::<Vec<u32>>());
            assert_eq!(s.block_hashes.len(), 1);
            assert!(s.parent_block_hash.is_some());
            assert_eq!(r.block_hashes.len(), 1);
        }
        other => panic!("unexpected events {other:?}"),
    }
    assert!(matches!(
        out.batches[1].1.events[..],
        [KvEvent::AllBlocksCleared]
    ));
}

/// kvmesh's replay server, given the same payloads, sends the recorded frames byte for byte.
#[tokio::test]
async fn kvmesh_replay_server_matches_the_vllm_recording_byte_for_byte() {
    let rec = recording();
    let mut config = PublisherConfig::new("tcp://127.0.0.1:0", "kv-events");
    config.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    let mut publisher = Publisher::start(config).await.unwrap();
    // Seq 0 was published but not asked for; seq 1 and 2 carry the recorded payloads.
    publisher
        .publish_payload(rec.replies[0][3].clone().into())
        .await
        .unwrap();
    for reply in &rec.replies[..2] {
        publisher
            .publish_payload(reply[3].clone().into())
            .await
            .unwrap();
    }
    let ep = publisher.replay_endpoint().unwrap().to_owned();
    let got = dealer_replay(ep, rec.request.clone()).await;
    assert_eq!(got, rec.replies);
}
