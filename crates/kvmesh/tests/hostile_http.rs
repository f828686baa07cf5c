//! Hostile HTTP clients against real `kvmesh router` and `kvmesh engine` processes (issue 37,
//! finding 1 and the body-memory part of finding 2), over loopback. A second "host" is a second
//! loopback address (127.0.0.2…), so per-address limits can be exercised on one machine.
//!
//! - Bodies trickled one byte a second are cut by the whole-body deadline (they used to hold
//!   their connection forever: the old timer restarted on every chunk), while probes from another
//!   address keep being answered.
//! - Connections past the per-address cap and past the total cap are answered 503 and closed at
//!   once, and counted (`kvmesh_http_refused_connections_total`).
//! - Bodies past the global body-memory budget are answered 503 with `Retry-After`.
//! - A large chat or completions body costs each server at most 3x itself in peak RSS.
//!
//! Experiment-sized (ignored; `cargo test -p kvmesh --release --test hostile_http -- --ignored
//! --nocapture`): `large_bodies_peak_rss` measures both servers' peak RSS for one 60 MiB chat
//! body and for four at once, then the same for completions bodies; `slow_body_flood_with_default_limits` opens 16,000 trickling
//! connections from four addresses against a router with its default limits and reports what it
//! held, refused and cut, its RSS, and probe latency from a fifth address.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hostile_common;

use std::path::Path;
use std::time::{Duration, Instant};

use hostile_common::{
    Proc, closed_within, connect_from, host_port, metric, router, sim_engine, status_code,
};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// How long a whole body may take in these tests (plus 1 s per MiB received).
const BODY_TIMEOUT: Duration = Duration::from_secs(2);
/// A trickled body must be cut within this (the deadline plus room for a loaded 2-core machine).
const CUT_WITHIN: Duration = Duration::from_secs(8);

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// Headers of a completion request declaring a `len`-byte body (which the caller then sends, or
/// not).
fn post_head(len: usize) -> Vec<u8> {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    )
    .into_bytes()
}

/// Opens `n` connections from `source` to `addr`, each sending a request's headers and then one
/// body byte per second until the server closes it; returns how many were still open after
/// [`CUT_WITHIN`], and the status codes the server answered.
async fn trickle_bodies(source: &str, addr: &str, n: usize) -> (usize, Vec<u16>) {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (source, addr) = (source.to_owned(), addr.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut s = connect_from(&source, &addr).await.unwrap();
            s.write_all(&post_head(100_000)).await.unwrap();
            let (mut rd, mut wr) = s.into_split();
            let drip = tokio::spawn(async move {
                for _ in 0..100 {
                    if wr.write_all(b" ").await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            });
            let mut got = Vec::new();
            let closed = tokio::time::timeout(CUT_WITHIN, async {
                let mut buf = [0u8; 1024];
                loop {
                    match tokio::io::AsyncReadExt::read(&mut rd, &mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => got.extend_from_slice(&buf[..k]),
                    }
                }
            })
            .await
            .is_ok();
            drip.abort();
            (closed, status_code(&got))
        }));
    }
    let mut held = 0;
    let mut statuses = Vec::new();
    for t in tasks {
        let (closed, status) = t.await.unwrap();
        held += usize::from(!closed);
        statuses.extend(status);
    }
    (held, statuses)
}

fn summary(lat: &[Duration]) -> String {
    let mut v: Vec<f64> = lat.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return "no probes".into();
    }
    format!(
        "{} probes, median {:.1} ms, max {:.1} ms",
        v.len(),
        v[v.len() / 2],
        v[v.len() - 1]
    )
}

async fn completion_ok(base: &str) {
    let r = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "sim", "prompt": "hello there, general kenobi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    assert_eq!(status, 200, "{}", r.text().await.unwrap_or_default());
}

fn router_yaml(engine: &str, http: &str, extra: &str) -> String {
    format!(
        "block_size: 16\ntokenizer: byte\n{extra}http: {{{http}}}\nendpoints:\n  - {{name: e0, url: \"{engine}\"}}\n"
    )
}

#[tokio::test]
async fn trickled_bodies_are_cut_by_a_whole_body_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, engine_url) = sim_engine(
        &["--http-body-timeout", "2s", "--http-body-min-rate", "1MiB"],
        dir.path(),
    )
    .await;
    let yaml = router_yaml(
        &engine_url,
        "body_timeout: 2s, body_min_bytes_per_second: 1048576",
        "",
    );
    let (mut router, router_url) = router(&yaml, dir.path()).await;
    completion_ok(&router_url).await;

    for (name, base) in [("router", &router_url), ("engine", &engine_url)] {
        let addr = host_port(base);
        let started = Instant::now();
        let client = client();
        let health = format!("{base}/health");
        let mut lat = Vec::new();
        let attack = trickle_bodies("127.0.0.2", &addr, 50);
        tokio::pin!(attack);
        let (held, statuses) = loop {
            tokio::select! {
                out = &mut attack => break out,
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    let t = Instant::now();
                    let r = client.get(&health).send().await.unwrap();
                    assert_eq!(r.status(), 200, "{name} /health during the attack");
                    lat.push(t.elapsed());
                }
            }
        };
        eprintln!(
            "{name}: 50 trickled bodies: {held} still open after {CUT_WITHIN:?} (deadline {BODY_TIMEOUT:?}); answers {:?}; /health during the attack: {} ({:?} total)",
            {
                let mut s = statuses.clone();
                s.dedup();
                s
            },
            summary(&lat),
            started.elapsed()
        );
        assert_eq!(
            held, 0,
            "{name}: trickled bodies still held after {CUT_WITHIN:?}"
        );
        assert!(
            statuses.iter().all(|&s| s == 408),
            "{name}: a cut body is answered 408: {statuses:?}"
        );
        let metrics = client.get(format!("{base}/metrics")).send().await.unwrap();
        let text = metrics.text().await.unwrap();
        assert!(
            metric(
                &text,
                "kvmesh_http_refused_bodies_total",
                "reason=\"deadline\""
            ) >= 50.0,
            "{name}: deadline refusals counted:\n{text}"
        );
    }
    completion_ok(&router_url).await;
    engine.assert_running("the trickle");
    router.assert_running("the trickle");
}

/// Opens `n` connections from `source` that send nothing; returns the ones still open and how
/// many the server answered 503 and closed at once (within 100 ms).
async fn idle_connections(source: &str, addr: &str, n: usize) -> (Vec<TcpStream>, usize) {
    let mut open = Vec::new();
    let mut refused = 0;
    for _ in 0..n {
        let mut s = connect_from(source, addr).await.unwrap();
        let (closed, got) = closed_within(&mut s, Duration::from_millis(100)).await;
        if closed {
            assert_eq!(
                status_code(&got),
                Some(503),
                "{:?}",
                String::from_utf8_lossy(&got)
            );
            let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
            assert!(text.contains("retry-after: 1"), "{text}");
            refused += 1;
        } else {
            open.push(s);
        }
    }
    (open, refused)
}

#[tokio::test]
async fn connections_past_the_caps_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, engine_url) = sim_engine(
        &[
            "--http-max-connections",
            "40",
            "--http-max-connections-per-ip",
            "16",
            // Idle connections must outlive the test's ~10 s of opening them.
            "--header-read-timeout",
            "60s",
        ],
        dir.path(),
    )
    .await;
    let yaml = router_yaml(
        &engine_url,
        "max_connections: 40, max_connections_per_ip: 16",
        "header_read_timeout: 60s\n",
    );
    let (mut router, router_url) = router(&yaml, dir.path()).await;
    for (name, base) in [("router", &router_url), ("engine", &engine_url)] {
        let addr = host_port(base);
        // One source takes its share; its next connection is refused, another source's is not.
        let (a, refused_a) = idle_connections("127.0.0.2", &addr, 20).await;
        assert_eq!((a.len(), refused_a), (16, 4), "{name}: 16 per address");
        let (b, refused_b) = idle_connections("127.0.0.3", &addr, 16).await;
        assert_eq!((b.len(), refused_b), (16, 0), "{name}");
        // 32 open: a third source gets the last slots (8, less the router's own connections to
        // the engine), then the total cap refuses.
        let (c, refused_c) = idle_connections("127.0.0.4", &addr, 12).await;
        assert!(
            (6..=8).contains(&c.len()) && c.len() + refused_c == 12,
            "{name}: 40 in total, got {} more and {refused_c} refused",
            c.len()
        );
        eprintln!(
            "{name}: caps 40 total / 16 per address: held {} idle connections, refused {} at once",
            a.len() + b.len() + c.len(),
            refused_a + refused_b + refused_c
        );
        drop((a, b, c));
        // Slots come back as the server sees the closes.
        let deadline = Instant::now() + Duration::from_secs(10);
        let text = loop {
            match client().get(format!("{base}/metrics")).send().await {
                Ok(r) if r.status() == 200 => break r.text().await.unwrap(),
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => panic!("{name}: /metrics after the caps: {other:?}"),
            }
        };
        assert_eq!(
            metric(
                &text,
                "kvmesh_http_refused_connections_total",
                "reason=\"max_connections_per_ip\""
            ),
            4.0,
            "{name}:\n{text}"
        );
        // (At least: a /metrics attempt made before the closes were seen is refused too.)
        assert!(
            metric(
                &text,
                "kvmesh_http_refused_connections_total",
                "reason=\"max_connections\""
            ) >= refused_c as f64,
            "{name}:\n{text}"
        );
    }
    completion_ok(&router_url).await;
    engine.assert_running("the caps");
    router.assert_running("the caps");
}

#[tokio::test]
async fn bodies_past_the_memory_budget_get_503_with_retry_after() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, engine_url) = sim_engine(&[], dir.path()).await;
    let yaml = router_yaml(
        &engine_url,
        "body_memory_bytes: 8388608",
        "max_body_bytes: 4194304\n",
    );
    let (mut router, router_url) = router(&yaml, dir.path()).await;
    let addr = host_port(&router_url);
    // Two bodies of 4 MiB, 3.5 MiB of each sent and then held: 7 MiB of the 8 MiB budget.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = connect_from("127.0.0.2", &addr).await.unwrap();
        s.write_all(&post_head(4 << 20)).await.unwrap();
        s.write_all(&vec![b' '; 7 << 19]).await.unwrap();
        held.push(s);
    }
    let client = client();
    let in_flight = || async {
        let text = client
            .get(format!("{router_url}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        metric(&text, "kvmesh_http_body_bytes_in_flight", "")
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight().await < f64::from(7 << 20) {
        assert!(Instant::now() < deadline, "the held bodies never arrived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let big = json!({"model": "sim", "prompt": "x".repeat(2 << 20), "max_tokens": 1});
    let refused = client
        .post(format!("{router_url}/v1/completions"))
        .json(&big)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let err: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(err["error"]["type"], "ServiceUnavailableError", "{err}");
    // A small request still fits.
    completion_ok(&router_url).await;
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    while in_flight().await > 0.0 {
        assert!(Instant::now() < deadline, "the budget was not given back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = client
        .post(format!("{router_url}/v1/completions"))
        .json(&big)
        .send()
        .await
        .unwrap();
    assert_ne!(
        after.status(),
        503,
        "room again once the held bodies are gone"
    );
    let text = client
        .get(format!("{router_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(
            &text,
            "kvmesh_http_refused_bodies_total",
            "reason=\"memory_budget\""
        ),
        1.0,
        "{text}"
    );
    engine.assert_running("the budget");
    router.assert_running("the budget");
}

/// A sim engine and a router in front of it, both with their default limits, answering.
async fn default_pair(dir: &Path) -> (Proc, String, Proc, String) {
    let (engine, engine_url) = sim_engine(&[], dir).await;
    let (router, router_url) = router(
        &format!(
            "block_size: 16\ntokenizer: byte\nendpoints:\n  - {{name: e0, url: \"{engine_url}\"}}\n"
        ),
        dir,
    )
    .await;
    completion_ok(&router_url).await;
    (engine, engine_url, router, router_url)
}

/// A chat body and a completions body whose prompt text is `bytes` long.
/// A chat body, the same with one JSON escape in its text, and a completions body, each with
/// `bytes` of prompt text.
fn large_bodies(bytes: usize) -> [(&'static str, &'static str, Vec<u8>); 3] {
    let text = "a".repeat(bytes);
    let chat = |text: &str| {
        let body = json!({
            "model": "sim", "max_tokens": 1,
            "messages": [{"role": "user", "content": text}],
        });
        serde_json::to_vec(&body).unwrap()
    };
    let completion = json!({"model": "sim", "max_tokens": 1, "prompt": text});
    [
        ("chat", "/v1/chat/completions", chat(&text)),
        (
            "chat, escaped",
            "/v1/chat/completions",
            chat(&(text.clone() + "\n")),
        ),
        (
            "completions",
            "/v1/completions",
            serde_json::to_vec(&completion).unwrap(),
        ),
    ]
}

/// The amplification bound docs/reliability.md states, held: one 16 MiB chat body, and one
/// 16 MiB completions body (both past the router's default `max_prompt_tokens`), raise the
/// router's and the engine's peak RSS by at most 3x the body; both answer vLLM's context-length
/// 400 and give the memory back. (Measured 2.0x on both. Before the router bounded prompts it
/// held ~10x: body, fields, messages, rendered text and 4 bytes of token id per byte; before
/// fields and messages borrowed from the body, 4.0x router, 3.0x engine.) A chat text with one
/// JSON escape is decoded into a copy: three copies then, held to 3x plus 4 MiB of working
/// memory (measured 3.0x plus 0.2 to 1.5 MiB). Every order of the three bodies gives the same
/// numbers now that the binary fixes glibc's mmap threshold (`src/malloc.rs`); before, one
/// body's cost ranged 1x to 5x with what the previous request had freed.
#[tokio::test]
async fn a_large_body_costs_a_bounded_multiple_of_itself() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, engine_url, mut router, router_url) = default_pair(dir.path()).await;
    for (what, path, body) in large_bodies(16 << 20) {
        let kib = (body.len() >> 10) as u64;
        for (name, base) in [("router", &router_url), ("engine", &engine_url)] {
            let server = if name == "router" { &router } else { &engine };
            let before = server.rss_kib();
            server.reset_peak();
            let r = client()
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400, "{name} {what}");
            let text = r.text().await.unwrap();
            assert!(
                text.contains("maximum context length"),
                "{name} {what}: {text}"
            );
            let growth = server.peak_rss_kib().saturating_sub(before);
            eprintln!("{name}, {what}: peak RSS +{growth} KiB for a {kib} KiB body");
            let bound = if what == "chat, escaped" {
                3 * kib + 4096
            } else {
                3 * kib
            };
            assert!(
                growth <= bound,
                "{name} {what}: peak RSS grew {growth} KiB for a {kib} KiB body (bound {bound} KiB)"
            );
        }
    }
    engine.assert_running("a large body");
    router.assert_running("a large body");
}

/// The same bound with an HF tokenizer and a chat template, the router's usual setup: a word-level
/// vocabulary whose tokens are several bytes long, so the text's length alone does not prove a
/// 16 MiB prompt too long (it has 2.8 M tokens). The router counts it a piece at a time and
/// refuses it without encoding it whole (which builds per-token strings and offsets: before the
/// pieces, the chat body cost the router +1.15 GiB, 74x). A chat body is held to 3x plus 8 MiB
/// (the template engine's copy of the text is the third; measured 3.0x plus ~2 MiB).
#[tokio::test]
async fn a_large_prompt_through_an_hf_tokenizer_is_refused_within_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizers/wordlevel.json");
    let tpl = dir.path().join("chat.jinja");
    std::fs::write(
        &tpl,
        "{% for m in messages %}{{ m.role }} says {{ m.content }} {% endfor %}",
    )
    .unwrap();
    let (mut engine, engine_url) = sim_engine(&[], dir.path()).await;
    let (mut router, router_url) = router(
        &format!(
            "block_size: 16\ntokenizer: {{path: \"{}\", chat_template: \"{}\"}}\nendpoints:\n  - {{name: e0, url: \"{engine_url}\"}}\n",
            tok.display(),
            tpl.display()
        ),
        dir.path(),
    )
    .await;
    let text = "hello world ".repeat((16 << 20) / 12);
    for (what, path, body) in [
        (
            "chat",
            "/v1/chat/completions",
            json!({"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}),
        ),
        (
            "completions",
            "/v1/completions",
            json!({"model": "sim", "max_tokens": 1, "prompt": text}),
        ),
    ] {
        let body = serde_json::to_vec(&body).unwrap();
        let kib = (body.len() >> 10) as u64;
        let before = router.rss_kib();
        router.reset_peak();
        let r = client()
            .post(format!("{router_url}{path}"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{what}");
        let answer = r.text().await.unwrap();
        assert!(
            answer.contains("maximum context length"),
            "{what}: {answer}"
        );
        let growth = router.peak_rss_kib().saturating_sub(before);
        eprintln!("router (HF tokenizer), {what}: peak RSS +{growth} KiB for a {kib} KiB body");
        // Rendering a chat template copies each message's text into the template engine's
        // own value: body, that copy and the rendered prompt are three, plus working memory.
        let bound = if what == "chat" {
            3 * kib + 8192
        } else {
            3 * kib
        };
        assert!(
            growth <= bound,
            "{what}: peak RSS grew {growth} KiB for a {kib} KiB body (bound {bound} KiB)"
        );
    }
    engine.assert_running("an HF-tokenized large prompt");
    router.assert_running("an HF-tokenized large prompt");
}

/// Peak RSS of a sim engine and a router in front of it for one 60 MiB chat body and for four
/// at once, then the same with completions bodies, sent to each server directly (the issue's
/// measurement: router peak 643–754 MB for one chat body, 2.07 GB for four). Prints the
/// numbers; asserts only that both survive.
#[tokio::test]
#[ignore = "experiment-sized: ~1 GB of traffic; run with --release --ignored --nocapture"]
async fn large_bodies_peak_rss() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, engine_url, mut router, router_url) = default_pair(dir.path()).await;
    for ((what, path, body), (name, base)) in large_bodies(60 << 20).into_iter().flat_map(|b| {
        [
            (b.clone(), ("router", &router_url)),
            (b, ("engine", &engine_url)),
        ]
    }) {
        for n in [1usize, 4] {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (engine_before, router_before) = (engine.rss_kib(), router.rss_kib());
            engine.reset_peak();
            router.reset_peak();
            let mut sends = Vec::new();
            for _ in 0..n {
                let (client, url, body) = (client(), format!("{base}{path}"), body.clone());
                sends.push(tokio::spawn(async move {
                    let r = client
                        .post(url)
                        .header("content-type", "application/json")
                        .body(body)
                        .timeout(Duration::from_secs(300))
                        .send()
                        .await;
                    r.map(|r| r.status().as_u16()).unwrap_or(0)
                }));
            }
            let mut statuses = Vec::new();
            for s in sends {
                statuses.push(s.await.unwrap());
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            eprintln!(
                "{n} x {} MiB {what} body -> {name}: answers {statuses:?}; router RSS {} MiB, peak {} MiB (+{} MiB), after {} MiB; engine RSS {} MiB, peak {} MiB (+{} MiB), after {} MiB",
                body.len() >> 20,
                router_before >> 10,
                router.peak_rss_kib() >> 10,
                router.peak_rss_kib().saturating_sub(router_before) >> 10,
                router.rss_kib() >> 10,
                engine_before >> 10,
                engine.peak_rss_kib() >> 10,
                engine.peak_rss_kib().saturating_sub(engine_before) >> 10,
                engine.rss_kib() >> 10,
            );
        }
    }
    engine.assert_running("large bodies");
    router.assert_running("large bodies");
}

/// The attack at scale against a router with its default limits: 16,000 connections from
/// four addresses (4,000 each), each trickling a body one byte a second. Reports how many the
/// router held and refused, how long until it had cut them all, its peak RSS, and /health from a
/// fifth address during the attack (refused at once while every slot is taken, never hanging).
#[tokio::test]
#[ignore = "experiment-sized: 16,000 connections for ~45 s; run with --ignored --nocapture"]
async fn slow_body_flood_with_default_limits() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, _, mut router, router_url) = default_pair(dir.path()).await;
    let addr = host_port(&router_url);
    let baseline = router.rss_kib();
    router.reset_peak();
    let started = Instant::now();
    let mut attackers = Vec::new();
    for a in 0..4 {
        for _ in 0..4_000 {
            let addr = addr.clone();
            attackers.push(tokio::spawn(async move {
                let Ok(mut s) = connect_from(&format!("127.0.0.{}", 10 + a), &addr).await else {
                    return (false, None);
                };
                if s.write_all(&post_head(100_000)).await.is_err() {
                    return (false, None);
                }
                let (mut rd, mut wr) = s.into_split();
                let drip = tokio::spawn(async move {
                    while wr.write_all(b" ").await.is_ok() {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                });
                let mut got = Vec::new();
                let mut buf = [0u8; 512];
                let held_until = loop {
                    match tokio::io::AsyncReadExt::read(&mut rd, &mut buf).await {
                        Ok(0) | Err(_) => break Instant::now(),
                        Ok(k) => got.extend_from_slice(&buf[..k]),
                    }
                };
                drip.abort();
                (true, Some((status_code(&got), held_until)))
            }));
        }
    }
    let client = client();
    let mut probes = Vec::new();
    let mut refused_probes = 0;
    while !attackers.iter().all(|t| t.is_finished()) && started.elapsed() < Duration::from_secs(90)
    {
        let t = Instant::now();
        match client.get(format!("{router_url}/health")).send().await {
            Ok(r) if r.status() == 200 => probes.push(t.elapsed()),
            _ => refused_probes += 1,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut statuses = std::collections::BTreeMap::new();
    let mut last_cut = Duration::ZERO;
    for t in attackers {
        if let (true, Some((status, until))) = t.await.unwrap() {
            *statuses.entry(status).or_insert(0u32) += 1;
            if status == Some(408) {
                last_cut = last_cut.max(until.duration_since(started));
            }
        }
    }
    eprintln!(
        "16,000 trickling connections from 4 addresses, default limits: answers {statuses:?}; last 408 at {last_cut:?}; router RSS {} MiB before, peak {} MiB; /health during the attack: {} ok ({}), {refused_probes} refused",
        baseline >> 10,
        router.peak_rss_kib() >> 10,
        probes.len(),
        summary(&probes),
    );
    completion_ok(&router_url).await;
    engine.assert_running("the flood");
    router.assert_running("the flood");
}
