//! Hostile KV-event peers and lying publishers against real `kvmesh` processes (issue 37,
//! findings 4 and 5), over loopback. A second "host" is a second loopback address (127.0.0.2…).
//!
//! - Peers that complete the ZMTP handshake and then never subscribe (PUB port) or never ask
//!   (replay port) are dropped after a deadline, so a router that (re)starts afterwards gets
//!   events and replays (64 and 16 such peers used to fill the ports for good).
//! - One address may hold only its share of an event port's connections; with `allowed_peers`
//!   the engine refuses every other address at once.
//! - A router's bound SUB socket credits only publishers connecting from its endpoint's address.
//! - A stream that goes quiet while the endpoint keeps getting work is reported silent.
//! - One publisher's flood of stored blocks evicts only its own endpoint's blocks, and stores
//!   announced faster than any engine can store are capped and counted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hostile_common;

use std::time::{Duration, Instant};

use hostile_common::{
    closed_within, host_port, metric, router, sim_engine, sim_engine_with_events, zmtp_message,
    zmtp_peer,
};
use kvmesh_core::BlockHash;
use kvmesh_core::events::{BlockStored, EventBatch, EventEncoding, KvEvent, Medium, encode_batch};
use kvmesh_events::{Publisher, PublisherConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn post_json(url: &str, body: &Value) -> Value {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{url}: {text}");
    serde_json::from_str(&text).unwrap()
}

async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn get_text(url: &str) -> String {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The tokens the router's index credits `endpoint` with for `query` (`prompt` or `token_ids`).
async fn indexed_tokens(router: &str, endpoint: &str, query: &Value) -> u64 {
    let v = post_json(&format!("{router}/debug/prefix"), query).await;
    v["endpoints"][endpoint]["any_tokens"].as_u64().unwrap_or(0)
}

/// Polls `f` every 100 ms until it is true or `limit` passes; returns whether it became true.
async fn eventually<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A completion straight to an engine (its blocks are then published).
async fn complete(base: &str, prompt: &str) {
    post_json(
        &format!("{base}/v1/completions"),
        &json!({"model": "sim", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
}

/// A `BlockStored` batch of `blocks` 16-token blocks starting at token `first`, as a root run.
fn stored_run(first: u32, blocks: u32) -> EventBatch {
    let tokens: Vec<u32> = (first..first + blocks * 16).collect();
    let hashes = (0..blocks)
        .map(|i| BlockHash(u64::from(first) << 20 | u64::from(i)))
        .collect();
    EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored::run(
            Medium::Gpu,
            None,
            16,
            hashes,
            tokens,
        ))],
        data_parallel_rank: None,
    }
}

/// Whether the server has closed `s` (reads until EOF for up to `limit`).
async fn dropped(s: &mut TcpStream, limit: Duration) -> bool {
    closed_within(s, limit).await.0
}

#[tokio::test]
async fn idle_event_peers_are_dropped_and_a_new_router_gets_events() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, engine_url, pub_ep, replay_ep) =
        sim_engine_with_events(json!({}), dir.path()).await;
    let (pub_addr, replay_addr) = (host_port(&pub_ep), host_port(&replay_ep));
    // 64 subscribers that never subscribe and 16 replay clients that never ask, each from its own
    // address (the per-address cap is another test): every slot of both ports.
    let mut idle = Vec::new();
    for i in 0..64 {
        let s = zmtp_peer(&format!("127.0.1.{}", 10 + i), &pub_addr, "SUB").await;
        idle.push(s.expect("a PUB slot for each idle subscriber"));
    }
    for i in 0..16 {
        let s = zmtp_peer(&format!("127.0.2.{}", 10 + i), &replay_addr, "DEALER").await;
        idle.push(s.expect("a replay slot for each idle client"));
    }
    let started = Instant::now();
    let mut held = 0;
    for s in &mut idle {
        // Subscription deadline 5 s, checked every second; room for a loaded machine.
        let limit = Duration::from_secs(10).saturating_sub(started.elapsed());
        held += usize::from(!dropped(s, limit).await);
    }
    eprintln!(
        "80 idle event peers (64 PUB, 16 replay): {held} still held after {:?}",
        started.elapsed()
    );
    assert_eq!(held, 0, "idle peers still hold event-port slots");

    // A router that starts now follows the engine and catches up through the replay port.
    complete(&engine_url, &"before the router ".repeat(20)).await;
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nendpoints:\n  - {{name: e0, url: \"{engine_url}\", kv_events: {{endpoint: \"{pub_ep}\", topic: kv-events, replay_endpoint: \"{replay_ep}\"}}}}\n"
    );
    let (mut router, router_url) = router(&yaml, dir.path()).await;
    let prompt = "after the idle peers ".repeat(20);
    // Generous: under a full parallel test run a debug router has taken over 15 s to subscribe.
    let got_events = eventually(Duration::from_secs(40), || {
        let (r, e, p) = (router_url.clone(), engine_url.clone(), prompt.clone());
        async move {
            complete(&e, &p).await;
            indexed_tokens(&r, "e0", &json!({"prompt": p})).await > 0
        }
    })
    .await;
    assert!(got_events, "the new router got no events from the engine");
    let caught_up = indexed_tokens(
        &router_url,
        "e0",
        &json!({"prompt": "before the router ".repeat(20)}),
    )
    .await;
    assert!(caught_up > 0, "replay catch-up brought nothing");
    engine.assert_running("idle peers");
    router.assert_running("idle peers");
}

#[tokio::test]
async fn one_address_gets_its_share_and_an_allow_list_refuses_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (mut open_engine, _, pub_ep, _) = sim_engine_with_events(json!({}), dir.path()).await;
    let pub_addr = host_port(&pub_ep);
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(
            zmtp_peer("127.0.0.5", &pub_addr, "SUB")
                .await
                .expect("8 connections per address"),
        );
    }
    assert!(
        zmtp_peer("127.0.0.5", &pub_addr, "SUB").await.is_none(),
        "a 9th connection from one address is refused"
    );
    assert!(
        zmtp_peer("127.0.0.6", &pub_addr, "SUB").await.is_some(),
        "another address still gets in"
    );
    drop(held);
    open_engine.assert_running("per-address caps");

    let dir2 = tempfile::tempdir().unwrap();
    let (mut engine, engine_url, pub_ep, replay_ep) =
        sim_engine_with_events(json!({"allowed_peers": ["127.0.0.1"]}), dir2.path()).await;
    for (port, ep, kind) in [("PUB", &pub_ep, "SUB"), ("replay", &replay_ep, "DEALER")] {
        assert!(
            zmtp_peer("127.0.0.2", &host_port(ep), kind).await.is_none(),
            "{port}: a stranger is refused"
        );
        assert!(
            zmtp_peer("127.0.0.1", &host_port(ep), kind).await.is_some(),
            "{port}: an allowed address gets in"
        );
    }
    // And the allowed address gets the events.
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nendpoints:\n  - {{name: e0, url: \"{engine_url}\", kv_events: {{endpoint: \"{pub_ep}\", topic: kv-events, replay_endpoint: \"{replay_ep}\"}}}}\n"
    );
    let (mut router, router_url) = router(&yaml, dir2.path()).await;
    let prompt = "allowed subscriber ".repeat(20);
    let got = eventually(Duration::from_secs(15), || {
        let (r, e, p) = (router_url.clone(), engine_url.clone(), prompt.clone());
        async move {
            complete(&e, &p).await;
            indexed_tokens(&r, "e0", &json!({"prompt": p})).await > 0
        }
    })
    .await;
    assert!(got, "the allowed router got no events");
    engine.assert_running("the allow-list");
    router.assert_running("the allow-list");
}

/// Publishes `batch` as seq `seq` on a raw ZMTP PUB connection, after reading the subscriber's
/// subscription.
async fn raw_publish(s: &mut TcpStream, seq: u64, batch: &EventBatch) {
    let payload = encode_batch(batch, EventEncoding::Map);
    let msg = zmtp_message(&[b"kv-events", &seq.to_be_bytes(), &payload]);
    s.write_all(&msg).await.unwrap();
}

#[tokio::test]
async fn a_bound_sub_socket_credits_only_its_endpoints_address() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, engine_url) = sim_engine(&[], dir.path()).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sub_addr = format!("127.0.0.1:{port}");
    // The engine's URL host is 127.0.0.1: that is where its publisher connects from.
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nendpoints:\n  - {{name: e1, url: \"{engine_url}\", kv_events: {{endpoint: \"tcp://{sub_addr}\", bind: true, topic: kv-events}}}}\n"
    );
    let (mut router, router_url) = router(&yaml, dir.path()).await;
    // 2,016 tokens (126 blocks) injected from another address.
    let injected = stored_run(1_000_000, 126);
    let query = json!({"token_ids": (1_000_000u32..1_000_000 + 126 * 16).collect::<Vec<_>>()});
    // Wait for the router's socket to listen (it binds in the background).
    let listening = eventually(Duration::from_secs(10), || {
        let addr = sub_addr.clone();
        async move { TcpStream::connect(&addr).await.is_ok() }
    })
    .await;
    assert!(listening, "the router's SUB socket never listened");
    let mut credited = 0;
    if let Some(mut s) = zmtp_peer("127.0.0.2", &sub_addr, "PUB").await {
        // Let the subscription arrive, then inject.
        let mut sub = [0u8; 64];
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut sub)).await;
        raw_publish(&mut s, 0, &injected).await;
        let deadline = Instant::now() + Duration::from_secs(3);
        while credited == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            credited = indexed_tokens(&router_url, "e1", &query).await;
        }
    }
    eprintln!("tokens credited to e1 from a publisher at another address: {credited}");
    assert_eq!(credited, 0, "a stranger's events were credited");

    // The endpoint's own address is admitted and credited.
    let mut s = zmtp_peer("127.0.0.1", &sub_addr, "PUB")
        .await
        .expect("the endpoint's own address is admitted");
    let mut sub = [0u8; 64];
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut sub)).await;
    raw_publish(&mut s, 0, &injected).await;
    let credited_own = eventually(Duration::from_secs(5), || {
        let (r, q) = (router_url.clone(), query.clone());
        async move { indexed_tokens(&r, "e1", &q).await == 126 * 16 }
    })
    .await;
    assert!(
        credited_own,
        "events from the endpoint's address were not credited"
    );
    // The refusal is counted (the feeder copies its subscriber's counters every second).
    let counted = eventually(Duration::from_secs(5), || {
        let url = format!("{router_url}/metrics");
        async move {
            let text = get_text(&url).await;
            metric(
                &text,
                "kvmesh_indexer_refused_publishers_total",
                "endpoint=\"e1\"",
            ) >= 1.0
        }
    })
    .await;
    assert!(counted, "the refused publisher was not counted");
    engine.assert_running("injection");
    router.assert_running("injection");
}

/// A bound publisher the test controls; the router connects to it.
async fn fake_publisher() -> Publisher {
    let mut config = PublisherConfig::new("tcp://127.0.0.1:0", "kv-events");
    config.bind = true;
    Publisher::start(config).await.unwrap()
}

/// An engine `e0` whose KV events come from a [`fake_publisher`], and a router in front of it:
/// the engine, the publisher, the router and its URL.
async fn fed_by_fake_publisher(
    dir: &std::path::Path,
) -> (
    hostile_common::Proc,
    Publisher,
    hostile_common::Proc,
    String,
) {
    let (engine, engine_url) = sim_engine(&[], dir).await;
    let publisher = fake_publisher().await;
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nendpoints:\n  - {{name: e0, url: \"{engine_url}\", kv_events: {{endpoint: \"{}\", topic: kv-events}}}}\n",
        publisher.local_endpoint()
    );
    let (router, router_url) = router(&yaml, dir).await;
    (engine, publisher, router, router_url)
}

#[tokio::test]
async fn a_stream_that_goes_quiet_is_reported_silent() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, mut publisher, mut router, router_url) =
        fed_by_fake_publisher(dir.path()).await;
    let endpoints = format!("{router_url}/debug/endpoints");
    let e0 = |v: Value| v.as_array().unwrap()[0].clone();
    // The stream speaks once (connected and delivering)...
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        publisher.publish(&stored_run(5, 1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let received = e0(get_json(&endpoints).await)["event_batches_received"]
            .as_u64()
            .unwrap_or(0);
        if received > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the router never got the first batch"
        );
    }
    // ...then goes quiet while the endpoint keeps getting requests.
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    for i in 0..32 {
        post_json(
            &format!("{router_url}/v1/completions"),
            &json!({"model": "sim", "prompt": format!("quiet {i}"), "max_tokens": 1}),
        )
        .await;
    }
    let state = e0(get_json(&endpoints).await);
    eprintln!("after 32 placements on a quiet stream: {state}");
    assert_eq!(state["events_silent"], true, "{state}");
    let metrics = get_text(&format!("{router_url}/metrics")).await;
    assert_eq!(
        metric(
            &metrics,
            "kvmesh_router_endpoint_events_silent",
            "endpoint=\"e0\""
        ),
        1.0
    );
    // Speaking again clears it at the next check.
    publisher.publish(&stored_run(9, 1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..16 {
        post_json(
            &format!("{router_url}/v1/completions"),
            &json!({"model": "sim", "prompt": format!("again {i}"), "max_tokens": 1}),
        )
        .await;
    }
    assert_eq!(e0(get_json(&endpoints).await)["events_silent"], false);
    engine.assert_running("quiet stream");
    router.assert_running("quiet stream");
}

/// Publishes `payload` as a load report message numbered `seq`.
async fn send_load(publisher: &mut Publisher, seq: u64, payload: Vec<u8>) {
    let parts = vec![
        bytes::Bytes::from_static(kvmesh_core::load_report::LOAD_TOPIC.as_bytes()),
        bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
        bytes::Bytes::from(payload),
    ];
    publisher.send_raw_parts(parts).await.unwrap();
}

/// What an engine publishes on the load topic: garbage, a flood and a lie are each bounded and
/// counted (issue 35); a report that stops coming leaves the router on its own view, and its
/// metrics say so.
#[tokio::test]
async fn load_reports_that_are_garbage_a_flood_or_a_lie_are_bounded_and_counted() {
    use kvmesh_core::load_report::LoadReport;
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, mut publisher, mut router, router_url) =
        fed_by_fake_publisher(dir.path()).await;
    let metrics_url = format!("{router_url}/metrics");
    let reports = |text: &str, outcome: &str| {
        metric(
            text,
            "kvmesh_router_load_reports",
            &format!("endpoint=\"e0\",outcome=\"{outcome}\""),
        )
    };
    // Garbage, until the router is connected and has counted some.
    let mut seq = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut counted = false;
    while !counted && Instant::now() < deadline {
        seq += 1;
        send_load(&mut publisher, seq, b"\x93\x00not a report".to_vec()).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        counted = reports(&get_text(&metrics_url).await, "malformed") > 0.0;
    }
    assert!(counted, "garbage on the load topic was not counted");
    // A lie: an engine claiming a trillion tokens queued. It is believed (it only keeps work
    // away from that engine), shown, and forgotten once the reports stop.
    let lie = LoadReport {
        v: 1,
        requests: 1,
        prefill_tokens: 1_000_000_000_000,
        decode_tokens: 0,
        routers: Default::default(),
    };
    send_load(&mut publisher, seq + 1, lie.encode()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let text = get_text(&metrics_url).await;
    assert_eq!(
        metric(
            &text,
            "kvmesh_router_endpoint_load_shared",
            "endpoint=\"e0\""
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "kvmesh_router_endpoint_in_flight_uncached_tokens",
            "endpoint=\"e0\""
        ),
        1e12
    );
    // The only endpoint still serves.
    post_json(
        &format!("{router_url}/v1/completions"),
        &json!({"model": "sim", "prompt": "still served", "max_tokens": 1}),
    )
    .await;
    // A flood: 5,000 reports as fast as the socket takes them. Most are dropped unread.
    let rss_before = router.rss_kib();
    for i in 0..5_000u64 {
        send_load(&mut publisher, seq + 2 + i, lie.encode()).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = get_text(&metrics_url).await;
    let (accepted, flood) = (reports(&text, "accepted"), reports(&text, "flood"));
    eprintln!(
        "flood of 5,000 reports: accepted {accepted}, refused as flood {flood}, router RSS {} -> {} KiB",
        rss_before,
        router.rss_kib()
    );
    assert!(flood > 0.0, "{text}");
    assert!(router.rss_kib() < rss_before + 64 * 1024);
    // Silence: after the staleness bound the router is back on its own view, and says so.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let text = get_text(&metrics_url).await;
    assert_eq!(
        metric(
            &text,
            "kvmesh_router_endpoint_load_shared",
            "endpoint=\"e0\""
        ),
        0.0
    );
    assert_eq!(
        metric(
            &text,
            "kvmesh_router_endpoint_in_flight_uncached_tokens",
            "endpoint=\"e0\""
        ),
        0.0
    );
    engine.assert_running("load reports");
    router.assert_running("load reports");
}

/// Four 4,096-token documents the honest engine computes.
fn documents() -> Vec<String> {
    (0..4)
        .map(|d| {
            (0..4096)
                .map(|i| char::from(b'a' + ((i * 7 + d * 3) % 26) as u8))
                .collect()
        })
        .collect()
}

/// A router following an honest sim engine (e0) and a fake publisher (e1), with `index`
/// settings; the documents computed on the engine and indexed under e0.
async fn honest_and_flooding(
    index: &str,
    dir: &std::path::Path,
) -> (
    hostile_common::Proc,
    hostile_common::Proc,
    String,
    Publisher,
) {
    let (engine, engine_url, pub_ep, replay_ep) = sim_engine_with_events(json!({}), dir).await;
    let flood = fake_publisher().await;
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nindex: {{{index}}}\nendpoints:\n  \
         - {{name: e0, url: \"{engine_url}\", kv_events: {{endpoint: \"{pub_ep}\", topic: kv-events, replay_endpoint: \"{replay_ep}\"}}}}\n  \
         - {{name: e1, url: \"{engine_url}\", kv_events: {{endpoint: \"{}\", topic: kv-events}}}}\n",
        flood.local_endpoint()
    );
    let (router, router_url) = router(&yaml, dir).await;
    let nudges = std::sync::atomic::AtomicU32::new(0);
    for doc in documents() {
        let indexed = eventually(Duration::from_secs(15), || {
            let (r, e, d) = (router_url.clone(), engine_url.clone(), doc.clone());
            // A fresh short prompt too: its events move the engine's sequence on, so a batch the
            // router's subscriber missed while joining shows as a gap and is replayed (a repeat
            // of the document alone is a cache hit and publishes nothing).
            let n = nudges.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let nudge: String = (0..32)
                .map(|i| char::from(b'A' + ((n + i) % 26) as u8))
                .collect();
            async move {
                complete(&e, &d).await;
                complete(&e, &format!("{nudge}{n}")).await;
                indexed_tokens(&r, "e0", &json!({"prompt": d})).await == 4096
            }
        })
        .await;
        assert!(indexed, "the honest document was never fully indexed");
    }
    (engine, router, router_url, flood)
}

/// Publishes `batches` batches of 1,024 fresh blocks each; returns how long it took.
async fn flood(publisher: &mut Publisher, batches: u32) -> Duration {
    let started = Instant::now();
    for b in 0..batches {
        publisher
            .publish(&stored_run(10_000_000 + b * 1024 * 16, 1024))
            .await
            .unwrap();
        if b % 16 == 15 {
            // Let the router's subscriber keep up (the socket drops what a slow peer cannot
            // take; the point here is what the index does with what arrives).
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    started.elapsed()
}

async fn honest_tokens(router_url: &str) -> Vec<u64> {
    let mut kept = Vec::new();
    for doc in documents() {
        kept.push(indexed_tokens(router_url, "e0", &json!({"prompt": doc})).await);
    }
    kept
}

#[tokio::test]
async fn one_publishers_flood_evicts_only_its_own_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, mut router, router_url, mut publisher) =
        honest_and_flooding("max_blocks: 20000", dir.path()).await;
    // 200 × 1,024 = 204,800 blocks: ten times the whole index.
    let took = flood(&mut publisher, 200).await;
    let metrics_url = format!("{router_url}/metrics");
    let applied = eventually(Duration::from_secs(20), || {
        let url = metrics_url.clone();
        async move {
            let text = get_text(&url).await;
            metric(
                &text,
                "kvmesh_indexer_events_total",
                "endpoint=\"e1\",kind=\"stored\"",
            ) >= 150.0
        }
    })
    .await;
    assert!(applied, "the flood did not reach the index");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let kept = honest_tokens(&router_url).await;
    eprintln!(
        "flood of 204,800 blocks on e1 in {took:?} (max_blocks 20,000): honest e0 keeps {kept:?} of 4 x 4096 tokens"
    );
    assert_eq!(
        kept,
        vec![4096; 4],
        "the flood evicted the honest endpoint's blocks"
    );
    engine.assert_running("the flood");
    router.assert_running("the flood");
}

#[tokio::test]
async fn stores_announced_faster_than_an_engine_can_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, mut router, router_url, mut publisher) =
        honest_and_flooding("max_blocks: 20000, max_blocks_per_second: 2000", dir.path()).await;
    // 60 × 1,024 = 61,440 blocks in about a second; the cap lets 20,000 (10 s of burst) plus
    // 2,000/s through.
    let took = flood(&mut publisher, 60).await;
    let metrics_url = format!("{router_url}/metrics");
    let mut limited = 0.0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while limited < 30_000.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let text = get_text(&metrics_url).await;
        limited = metric(
            &text,
            "kvmesh_indexer_rate_limited_blocks_total",
            "endpoint=\"e1\"",
        );
    }
    let seen = limited >= 30_000.0;
    eprintln!(
        "61,440 blocks announced in {took:?} at a cap of 2,000/s (burst 20,000): {limited} skipped"
    );
    assert!(seen, "the flood was not capped: {limited} blocks skipped");
    assert_eq!(honest_tokens(&router_url).await, vec![4096; 4]);
    engine.assert_running("the capped flood");
    router.assert_running("the capped flood");
}
