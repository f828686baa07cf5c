//! The KV-event feeder end to end: real vLLM frames (`tests/fixtures/vllm/capture2.json`,
//! `capture3.json`) published through a real ZMQ socket into `Indexer`, then every captured
//! prompt looked up. The expected answer is computed independently of the router's keys: replay
//! the engine hashes of the events into a set (what vLLM holds) and count how many leading blocks
//! of each prompt's golden vLLM hashes are in it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::eventually;
use kvmesh_core::chain::chain_keys;
use kvmesh_core::events::{EventBatch, EventEncoding, KvEvent, Medium, decode_batch, encode_batch};
use kvmesh_events::{Publisher, PublisherConfig};
use kvmesh_index::{EndpointId, IndexConfig, PrefixIndex};
use kvmesh_router::indexer::{EventSource, Indexer, IndexerConfig, SourceMetricsSnapshot};
use tokio_util::sync::CancellationToken;

const EP: EndpointId = EndpointId(7);
const EP_NAME: &str = "engine-7";
const TOPIC: &str = "kv-events";

fn fixture(name: &str) -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/vllm/").to_owned() + name;
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture readable"))
        .expect("fixture is JSON")
}

/// Standard base64 (the fixtures' payload encoding). Kept local: this crate's dev-dependencies
/// are owned elsewhere and the fixtures need nothing more than this.
fn b64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let digits: Vec<u8> = s.bytes().filter(|c| *c != b'=').collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let acc = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, c)| acc | (val(*c) << (18 - 6 * i)));
        for i in 0..chunk.len() - 1 {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out
}

/// `(topic, seq, payload)` of every captured ZMQ message.
fn frames(name: &str) -> Vec<(String, u64, Vec<u8>)> {
    fixture(name)["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["topic"].as_str().unwrap().to_owned(),
                f["seq"].as_u64().unwrap(),
                b64(f["payload_b64"].as_str().unwrap()),
            )
        })
        .collect()
}

/// Golden prompts: tokens and vLLM's per-block event hashes (sha256_cbor, seed "0").
fn golden(name: &str) -> Vec<(Vec<u32>, Vec<u64>)> {
    fixture(name)["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["algo"] == "sha256_cbor")
        .map(|c| {
            let tokens = c["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let hashes = c["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["u64"].as_u64().unwrap())
                .collect();
            (tokens, hashes)
        })
        .collect()
}

/// The engine's GPU content after the frames, by engine hash.
fn held_after(frames: &[(String, u64, Vec<u8>)]) -> HashSet<u64> {
    let mut held = HashSet::new();
    for (_, _, payload) in frames {
        for ev in decode_batch(payload).unwrap().events {
            match ev {
                KvEvent::BlockStored(s) if s.medium == Medium::Gpu => {
                    held.extend(s.block_hashes.iter().map(|h| h.0))
                }
                KvEvent::BlockRemoved(r) if r.medium == Medium::Gpu => {
                    for h in r.block_hashes {
                        held.remove(&h.0);
                    }
                }
                KvEvent::AllBlocksCleared => held.clear(),
                _ => {}
            }
        }
    }
    held
}

fn empty_batch() -> Bytes {
    Bytes::from(encode_batch(
        &EventBatch {
            ts: 0.0,
            events: Vec::new(),
            data_parallel_rank: None,
        },
        EventEncoding::Map,
    ))
}

fn parts(topic: &str, seq: u64, payload: impl Into<Bytes>) -> Vec<Bytes> {
    vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.into(),
    ]
}

fn source_metrics(indexer: &Indexer) -> SourceMetricsSnapshot {
    indexer
        .metrics()
        .sources
        .into_iter()
        .find(|s| s.endpoint == EP)
        .expect("source registered")
}

struct Rig {
    indexer: Indexer,
    publisher: Publisher,
    cancel: CancellationToken,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// An indexer whose source binds loopback port 0, and a publisher connected to it that is known
/// to be delivering (a probe batch on a sibling topic arrived), so no test frame is lost to the
/// ZMQ slow-joiner effect.
async fn rig(block_size: usize, gap_grace: Duration) -> Rig {
    let cancel = CancellationToken::new();
    let index = Arc::new(PrefixIndex::new(IndexConfig {
        block_size,
        ..IndexConfig::default()
    }));
    let source = EventSource {
        endpoint: EP,
        name: EP_NAME.to_owned(),
        zmq_endpoint: "tcp://127.0.0.1:0".to_owned(),
        bind: true,
        topic: TOPIC.to_owned(),
        replay_endpoint: None,
    };
    let indexer = Indexer::start_with_config(
        index,
        vec![source],
        IndexerConfig {
            gap_grace,
            stats_interval: Duration::from_millis(200),
            ..IndexerConfig::default()
        },
        cancel.clone(),
    );
    eventually(10, "the subscriber to bind", || {
        indexer.listening(EP).is_some()
    })
    .await;
    let address = indexer.listening(EP).unwrap();
    let mut publisher = Publisher::start(PublisherConfig::new(address, TOPIC))
        .await
        .unwrap();
    let probe_topic = format!("{TOPIC}-probe");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while source_metrics(&indexer).batches == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "publisher never reached the subscriber"
        );
        publisher
            .send_raw_parts(parts(&probe_topic, 0, empty_batch()))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Rig {
        indexer,
        publisher,
        cancel,
    }
}

async fn publish_capture(rig: &mut Rig, frames: &[(String, u64, Vec<u8>)]) {
    let before = source_metrics(&rig.indexer).batches;
    for (topic, seq, payload) in frames {
        rig.publisher
            .send_raw_parts(parts(topic, *seq, payload.clone()))
            .await
            .unwrap();
    }
    let want = before + frames.len() as u64;
    eventually(10, "all captured batches to be applied", || {
        source_metrics(&rig.indexer).batches >= want
    })
    .await;
}

/// Looks every golden prompt up and compares with what the engine held (in router blocks).
fn check_prompts(
    indexer: &Indexer,
    block_size: usize,
    golden: &[(Vec<u32>, Vec<u64>)],
    held: &HashSet<u64>,
) -> usize {
    let ratio = 32 / block_size;
    let mut matched_prompts = 0;
    for (i, (tokens, hashes)) in golden.iter().enumerate() {
        let expect_engine_blocks = hashes.iter().take_while(|h| held.contains(h)).count();
        let keys = chain_keys(tokens, block_size);
        let got = indexer.index().find_matches(&keys);
        let (gpu, cpu, any) = got
            .iter()
            .find(|m| m.endpoint == EP)
            .map_or((0, 0, 0), |m| (m.gpu_blocks, m.cpu_blocks, m.any_blocks));
        assert_eq!(
            gpu,
            expect_engine_blocks * ratio,
            "prompt {i} ({} tokens), block size {block_size}",
            tokens.len()
        );
        assert_eq!(
            (cpu, any),
            (0, gpu),
            "prompt {i}: no CPU tier in these captures"
        );
        assert!(
            got.iter().all(|m| m.endpoint == EP),
            "only one endpoint publishes"
        );
        if gpu > 0 {
            matched_prompts += 1;
        }
    }
    matched_prompts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture2_prompts_match_what_vllm_stored() {
    let frames = frames("capture2.json");
    let golden = golden("golden2.json");
    let held = held_after(&frames);
    for block_size in [32, 16] {
        tokio::time::timeout(Duration::from_secs(30), async {
            let mut rig = rig(block_size, Duration::from_secs(60)).await;
            publish_capture(&mut rig, &frames).await;
            let matched = check_prompts(&rig.indexer, block_size, &golden, &held);
            // 100, 104 and 300 tokens have full blocks; the 20-token prompt has none.
            assert_eq!(matched, 3);
            let m = source_metrics(&rig.indexer);
            assert_eq!(
                (m.gaps, m.malformed, m.apply_errors, m.restarts),
                (0, 0, 0, 0),
                "{m:?}"
            );
            assert_eq!(m.last_seq, Some(6));
            let stats = rig.indexer.metrics().index;
            assert_eq!(stats.memberships as usize, held.len() * (32 / block_size));
        })
        .await
        .expect("test timed out");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture3_evictions_and_reset_are_tracked() {
    let frames = frames("capture3.json");
    let golden = golden("golden3.json");
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut rig = rig(32, Duration::from_secs(60)).await;
        // Before the reset: evictions (BlockRemoved) are reflected prompt by prompt.
        let reset_at = frames
            .iter()
            .position(|(_, _, p)| {
                decode_batch(p)
                    .unwrap()
                    .events
                    .contains(&KvEvent::AllBlocksCleared)
            })
            .expect("capture3 has AllBlocksCleared");
        publish_capture(&mut rig, &frames[..reset_at]).await;
        let held = held_after(&frames[..reset_at]);
        assert!(held.len() <= 96, "the engine had 96 GPU blocks");
        let before = check_prompts(&rig.indexer, 32, &golden, &held);
        assert!(
            before >= 2,
            "several prompts cached before the reset ({before})"
        );
        assert_eq!(rig.indexer.metrics().index.memberships as usize, held.len());
        // After AllBlocksCleared and the last store, only what was stored again is known.
        publish_capture(&mut rig, &frames[reset_at..]).await;
        let held = held_after(&frames);
        check_prompts(&rig.indexer, 32, &golden, &held);
        assert_eq!(rig.indexer.metrics().index.memberships as usize, held.len());
        let m = source_metrics(&rig.indexer);
        assert_eq!((m.gaps, m.malformed, m.restarts), (0, 0, 0), "{m:?}");
        assert_eq!(m.events, 9 + 66 + 1, "9 stored, 66 removed, 1 cleared");
    })
    .await
    .expect("test timed out");
}

/// A GPU store of `tokens` (one 4-token block per hash, chained from the root).
fn store(tokens: &[u32], first_hash: u64) -> Bytes {
    let n = tokens.len() / 4;
    let ev = KvEvent::BlockStored(kvmesh_core::events::BlockStored {
        block_hashes: (0..n as u64)
            .map(|i| kvmesh_core::BlockHash(first_hash + i))
            .collect(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: 4,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        cache_salt: None,
    });
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    Bytes::from(encode_batch(
        &EventBatch {
            ts,
            events: vec![ev],
            data_parallel_rank: None,
        },
        EventEncoding::Map,
    ))
}

fn gpu_blocks(indexer: &Indexer, tokens: &[u32]) -> usize {
    indexer
        .index()
        .find_matches(&chain_keys(tokens, 4))
        .iter()
        .find(|m| m.endpoint == EP)
        .map_or(0, |m| m.gpu_blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_batches_make_the_endpoint_suspect_then_stale_entries_age_out() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut rig = rig(4, Duration::from_millis(500)).await;
        let (a, b, c): (Vec<u32>, Vec<u32>, Vec<u32>) =
            ((0..8).collect(), (100..108).collect(), (200..208).collect());
        rig.publisher
            .send_raw_parts(parts(TOPIC, 1, store(&a, 10)))
            .await
            .unwrap();
        rig.publisher
            .send_raw_parts(parts(TOPIC, 2, store(&b, 20)))
            .await
            .unwrap();
        // seq 3 is lost; seq 4 re-stores `a` and stores `c`.
        rig.publisher
            .send_raw_parts(parts(TOPIC, 4, store(&a, 10)))
            .await
            .unwrap();
        rig.publisher
            .send_raw_parts(parts(TOPIC, 5, store(&c, 30)))
            .await
            .unwrap();
        eventually(10, "batches", || {
            source_metrics(&rig.indexer).last_seq == Some(5)
        })
        .await;
        let m = source_metrics(&rig.indexer);
        assert_eq!((m.gaps, m.lost_batches, m.replays), (1, 1, 0), "{m:?}");
        assert!(m.suspect);
        assert!(m.lag_seconds >= 0.0 && m.lag_seconds < 5.0, "{m:?}");
        // During the grace period every entry still answers.
        assert_eq!(
            (
                gpu_blocks(&rig.indexer, &a),
                gpu_blocks(&rig.indexer, &b),
                gpu_blocks(&rig.indexer, &c)
            ),
            (2, 2, 2)
        );
        eventually(10, "age-out", || !source_metrics(&rig.indexer).suspect).await;
        // `b` was not confirmed after the loss: aged out. `a` and `c` were stored again: kept.
        assert_eq!(
            (
                gpu_blocks(&rig.indexer, &a),
                gpu_blocks(&rig.indexer, &b),
                gpu_blocks(&rig.indexer, &c)
            ),
            (2, 0, 2)
        );
        assert_eq!(source_metrics(&rig.indexer).aged_out_blocks, 2);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_clears_and_malformed_frames_are_skipped() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut rig = rig(4, Duration::from_secs(60)).await;
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (100..108).collect());
        rig.publisher
            .send_raw_parts(parts(TOPIC, 5, store(&a, 10)))
            .await
            .unwrap();
        rig.publisher
            .send_raw_parts(parts(TOPIC, 6, Bytes::from_static(b"\xc1garbage")))
            .await
            .unwrap();
        rig.publisher
            .send_raw_parts(vec![
                Bytes::from_static(b"kv-events"),
                Bytes::from_static(b"x"),
            ])
            .await
            .unwrap();
        rig.publisher
            .send_raw_parts(parts(TOPIC, 7, store(&b, 20)))
            .await
            .unwrap();
        eventually(10, "seq 7", || {
            source_metrics(&rig.indexer).last_seq == Some(7)
        })
        .await;
        assert_eq!(
            (gpu_blocks(&rig.indexer, &a), gpu_blocks(&rig.indexer, &b)),
            (2, 2)
        );
        assert_eq!(source_metrics(&rig.indexer).malformed, 2);
        // A new incarnation starts again at 0 and knows only `b`.
        rig.publisher
            .send_raw_parts(parts(TOPIC, 0, store(&b, 20)))
            .await
            .unwrap();
        eventually(10, "restart", || source_metrics(&rig.indexer).restarts == 1).await;
        eventually(10, "seq 0", || {
            source_metrics(&rig.indexer).last_seq == Some(0)
        })
        .await;
        assert_eq!(
            (gpu_blocks(&rig.indexer, &a), gpu_blocks(&rig.indexer, &b)),
            (0, 2)
        );
        // The registry exports the per-endpoint series.
        let mut registry = prometheus_client::registry::Registry::default();
        rig.indexer.register_metrics(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("kvmesh_indexer_restarts_total{endpoint=\"engine-7\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvmesh_indexer_malformed_total{endpoint=\"engine-7\"} 2"),
            "{text}"
        );
        assert!(text.contains("kvmesh_index_memberships 2"), "{text}");
        rig.indexer.remove_source(EP);
        assert!(
            rig.indexer
                .index()
                .find_matches(&chain_keys(&b, 4))
                .is_empty()
        );
    })
    .await
    .expect("test timed out");
}

/// A publisher with a replay ring, connecting to a loopback port nobody listens on yet: what it
/// publishes goes into the void (its ring keeps it) until an indexer binds that port.
async fn replaying_publisher() -> (Publisher, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bind = format!("tcp://127.0.0.1:{port}");
    let mut pconfig = PublisherConfig::new(&bind, TOPIC);
    pconfig.replay_endpoint = Some("tcp://127.0.0.1:0".to_owned());
    (Publisher::start(pconfig).await.unwrap(), bind)
}

/// An indexer (block size 4) binding `bind` for `publisher`'s events, with its replay endpoint.
fn replay_indexer(bind: &str, publisher: &Publisher, cancel: &CancellationToken) -> Indexer {
    let source = EventSource {
        endpoint: EP,
        name: EP_NAME.to_owned(),
        zmq_endpoint: bind.to_owned(),
        bind: true,
        topic: TOPIC.to_owned(),
        replay_endpoint: publisher.replay_endpoint().map(str::to_owned),
    };
    let index = Arc::new(PrefixIndex::new(IndexConfig {
        block_size: 4,
        ..IndexConfig::default()
    }));
    Indexer::start(index, vec![source], cancel.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_filled_from_the_replay_endpoint() {
    tokio::time::timeout(Duration::from_secs(30), async {
        // Seqs 1 and 2 go into the void (the ring keeps them) before the indexer binds.
        let (a, b, c): (Vec<u32>, Vec<u32>, Vec<u32>) =
            ((0..8).collect(), (100..108).collect(), (200..208).collect());
        let cancel = CancellationToken::new();
        let (mut publisher, bind) = replaying_publisher().await;
        publisher.set_next_seq(1);
        publisher.publish_payload(store(&a, 10)).await.unwrap();
        publisher.publish_payload(store(&b, 20)).await.unwrap();
        let indexer = replay_indexer(&bind, &publisher, &cancel);
        // seq 0 reaches the subscriber first (sent until it does), so 1 and 2 are a gap.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while source_metrics(&indexer).batches == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "publisher never reached the subscriber"
            );
            publisher
                .send_raw_parts(parts(TOPIC, 0, empty_batch()))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(publisher.next_seq(), 3);
        publisher.publish_payload(store(&c, 30)).await.unwrap();
        eventually(10, "seq 3", || source_metrics(&indexer).last_seq == Some(3)).await;
        let m = source_metrics(&indexer);
        // Filled from the ring either way: by the catch-up every source runs on connect when it
        // reads the ring first, or by the gap replay when seq 0 arrived before it (both orders
        // happen; a loaded machine favours the first).
        assert!(m.replays + m.catch_ups >= 1, "{m:?}");
        assert_eq!(
            (m.replay_failures, m.catch_up_failures, m.gaps, m.suspect),
            (0, 0, 0, false),
            "{m:?}"
        );
        assert_eq!(
            (
                gpu_blocks(&indexer, &a),
                gpu_blocks(&indexer, &b),
                gpu_blocks(&indexer, &c)
            ),
            (2, 2, 2)
        );
        cancel.cancel();
    })
    .await
    .expect("test timed out");
}

/// A router that joins a stream already running (started after the engine, or restarted) fills
/// its index from what the engine's replay ring still holds — at once, while the engine is idle,
/// not when it next publishes — without calling that a gap, and only then says it caught up.
///
/// The restart case: a publisher that connects holds early batches until its first subscriber
/// comes, so a first router takes them live; the router that replaces it joins mid-stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_joiner_catches_up_from_the_replay_ring() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (100..108).collect());
        let cancel = CancellationToken::new();
        let (mut publisher, bind) = replaying_publisher().await;
        let first_cancel = CancellationToken::new();
        let first = replay_indexer(&bind, &publisher, &first_cancel);
        publisher.publish_payload(store(&a, 10)).await.unwrap();
        publisher.publish_payload(store(&b, 20)).await.unwrap();
        eventually(10, "the first router indexed both batches", || {
            gpu_blocks(&first, &a) == 2 && gpu_blocks(&first, &b) == 2
        })
        .await;
        assert!(first.caught_up());
        // It asked on connect, when the ring was still empty.
        assert_eq!(source_metrics(&first).catch_ups, 1);
        // The router restarts while the engine is idle: only its ring has the early batches.
        first_cancel.cancel();
        drop(first);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let indexer = replay_indexer(&bind, &publisher, &cancel);
        eventually(
            10,
            "both early batches indexed with nothing published",
            || gpu_blocks(&indexer, &a) == 2 && gpu_blocks(&indexer, &b) == 2,
        )
        .await;
        eventually(10, "caught up", || indexer.caught_up()).await;
        // The stream resumes where the replay ended: live batches are neither gaps nor doubles.
        let c: Vec<u32> = (200..208).collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        publisher.publish_payload(store(&c, 30)).await.unwrap();
        while gpu_blocks(&indexer, &c) < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "live batch never arrived"
            );
            publisher.publish_payload(empty_batch()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let m = source_metrics(&indexer);
        assert_eq!((m.catch_ups, m.gaps, m.suspect), (1, 0, false), "{m:?}");
        cancel.cancel();
    })
    .await
    .expect("test timed out");
}

/// A router joining mid-stream whose engine's replay endpoint does not answer starts from the live
/// stream and says so in `/metrics` (`kvmesh_indexer_replays_total{kind="catch_up_failed"}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_catch_up_is_counted() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let cancel = CancellationToken::new();
        let (mut publisher, bind) = replaying_publisher().await;
        publisher.set_next_seq(5);
        let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let source = EventSource {
            endpoint: EP,
            name: EP_NAME.to_owned(),
            zmq_endpoint: bind.clone(),
            bind: true,
            topic: TOPIC.to_owned(),
            replay_endpoint: Some(format!("tcp://127.0.0.1:{dead_port}")),
        };
        let index = Arc::new(PrefixIndex::new(IndexConfig {
            block_size: 4,
            ..IndexConfig::default()
        }));
        let indexer = Indexer::start(index, vec![source], cancel.clone());
        let a: Vec<u32> = (0..8).collect();
        publisher.publish_payload(store(&a, 10)).await.unwrap();
        eventually(10, "the live batch indexed", || {
            gpu_blocks(&indexer, &a) == 2
        })
        .await;
        // Once on connect, once more when the first live batch shows the stream ran before.
        eventually(10, "the failed catch-ups counted", || {
            source_metrics(&indexer).catch_up_failures == 2
        })
        .await;
        assert!(
            indexer.caught_up(),
            "a failed attempt does not hold readiness"
        );
        let m = source_metrics(&indexer);
        assert_eq!((m.catch_ups, m.gaps, m.suspect), (2, 0, false), "{m:?}");
        cancel.cancel();
    })
    .await
    .expect("test timed out");
}
