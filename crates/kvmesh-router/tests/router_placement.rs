//! The default placement balances prefill *work*, not request counts (issue #13's case): a short
//! prompt goes to the endpoint with three short requests in flight, not the one with a single
//! 40K-token prefill queued, and `/debug/decisions` says so with predicted times.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{FakeEngine, Mode, endpoints_yaml, get_json, start_router};
use serde_json::{Value, json};

async fn send(router: &str, prompt: String) -> reqwest::Response {
    common::client()
        .post(format!("{router}/v1/completions"))
        .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 4}))
        .send()
        .await
        .unwrap()
}

fn served_by(r: &reqwest::Response) -> String {
    r.headers()
        .get("x-kvmesh-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_pipeline_places_by_queued_prefill_work_not_request_count() {
    let a = FakeEngine::start("a").await;
    let b = FakeEngine::start("b").await;
    // Both hold every request for 3 s before the first byte: everything stays "in flight".
    a.set_mode(Mode::Slow(Duration::from_secs(3)));
    b.set_mode(Mode::Slow(Duration::from_secs(3)));
    // No scheduling_profiles: the router's default pipeline (predicted TTFT, priced pulls).
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nmetrics_scrape_interval: 1h\n{}",
        endpoints_yaml(&[&a, &b])
    );
    let router = start_router(&yaml, None).await;
    let url = format!("http://{}", router.addr);

    let long = tokio::spawn({
        let url = url.clone();
        async move { send(&url, common::doc(1, 40_000)).await }
    });
    common::eventually(5, "the long prompt to arrive", || {
        a.count() + b.count() == 1
    })
    .await;
    let (busy, idle, busy_name) = if a.count() == 1 {
        (&a, &b, "e0")
    } else {
        (&b, &a, "e1")
    };
    // Three short prompts: each goes where no long prefill is queued.
    let mut shorts = Vec::new();
    for i in 0..3 {
        let url = url.clone();
        shorts.push(tokio::spawn(async move {
            send(&url, common::doc(10 + i, 200)).await
        }));
        let want = i as usize + 1;
        common::eventually(5, "a short prompt to arrive", || idle.count() == want).await;
    }
    assert_eq!(busy.count(), 1);
    // Request counts now say 1 vs 3; queued prefill work says ~40,000 vs ~600 tokens.
    let fifth = send(&url, common::doc(20, 24)).await;
    assert!(fifth.status().is_success());
    assert_ne!(served_by(&fifth), busy_name, "went behind the 40K prefill");
    assert_eq!(idle.count(), 4);

    let decisions = get_json(&format!("{url}/debug/decisions?last=1")).await;
    let last = &decisions[0];
    // The default placement is configs/router.yaml's profile.
    assert_eq!(last["profile"], "ttft-p2p");
    let cands = last["candidates"].as_array().unwrap();
    let predicted = |name: &str| -> Value {
        cands
            .iter()
            .find(|c| c["endpoint"] == name)
            .map(|c| c["predicted"].clone())
            .unwrap()
    };
    let busy_pred = predicted(busy_name);
    let idle_pred = predicted(if busy_name == "e0" { "e1" } else { "e0" });
    assert!(
        busy_pred["queue_ms"].as_f64().unwrap() > 1000.0,
        "{busy_pred}"
    );
    assert!(
        idle_pred["total_ms"].as_f64().unwrap() < busy_pred["total_ms"].as_f64().unwrap() / 10.0,
        "{idle_pred} vs {busy_pred}"
    );
    assert!(long.await.unwrap().status().is_success());
    for s in shorts {
        assert!(s.await.unwrap().status().is_success());
    }
}

/// With `admission_queue:`, requests beyond every endpoint's prefill share wait at the router and leave
/// shortest work first: a short prompt that arrives after a long one still reaches the engine
/// first, and both decisions record how long they were held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admission_queue_lets_short_prompts_overtake_long_ones() {
    let a = FakeEngine::start("a").await;
    a.set_mode(Mode::Slow(Duration::from_millis(800)));
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nmetrics_scrape_interval: 1h\n\
         admission_queue: {{max_queued_prefill_tokens: 50, aging: 0, max_hold: 30s}}\n{}",
        endpoints_yaml(&[&a])
    );
    let router = start_router(&yaml, None).await;
    let url = format!("http://{}", router.addr);
    let spawn = |len: usize, seed: u32| {
        let url = url.clone();
        tokio::spawn(async move { send(&url, common::doc(seed, len)).await })
    };
    // Fills the engine's share: 5,000 queued prefill tokens > 50. Every later prompt is larger
    // than the share too, so each waits for the previous one's first byte: the order is exact.
    let first = spawn(5000, 1);
    common::eventually(5, "the first prompt to arrive", || a.count() == 1).await;
    let long = spawn(4000, 2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let short = spawn(100, 3);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(a.count(), 1, "both later prompts are held at the router");
    let held = common::scrape_metric(&url, "kvmesh_router_admission_queue_waiting", "").await;
    assert_eq!(held, 2.0);
    for r in [first, long, short] {
        assert!(r.await.unwrap().status().is_success());
    }
    let lens: Vec<usize> = a
        .state
        .received
        .lock()
        .iter()
        .map(|r| r.body["prompt"].as_str().map_or(0, str::len))
        .collect();
    assert_eq!(
        lens,
        vec![5000, 100, 4000],
        "the short prompt overtook the long one"
    );
    let decisions = get_json(&format!("{url}/debug/decisions?last=3")).await;
    let held: Vec<f64> = decisions
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["held_ms"].as_f64().unwrap())
        .collect();
    assert_eq!(held[0], 0.0);
    assert!(held[1] > 300.0 && held[2] > 300.0, "{held:?}");
}

/// With `pulls_when_held: false`, a request that waited in the admission queue is placed
/// without a P2P pull: it was held because every endpoint's prefill queue was full, and a pull
/// would only move it to another full queue. The same request placed on arrival pulls, and with
/// `pulls_when_held: true` (the default) a held one pulls too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_pulls_when_held_off_a_request_released_from_the_admission_queue_does_not_pull() {
    for pulls_when_held in [false, true] {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        // e1 answers its first request long before e0: its first byte is what releases the
        // held request, so it goes to e1, the emptier endpoint, and e0 is the only holder.
        e0.set_mode(Mode::Slow(Duration::from_secs(3)));
        e1.set_mode(Mode::Slow(Duration::from_millis(400)));
        let prefix = std::sync::Arc::new(common::FakePrefix::default());
        prefix.set(&[(0, 20, 20)]); // e0 holds 320 tokens of every prompt, in both tiers
        let yaml = format!(
            "seed: 7\nblock_size: 16\ntokenizer: byte\nmetrics_scrape_interval: 1h\n\
             admission_queue: {{max_queued_prefill_tokens: 50, aging: 0, max_hold: 30s, pulls_when_held: {pulls_when_held}}}\n\
             plugins:\n  - {{type: queue-scorer, name: queue}}\n  - {{type: max-score-picker, name: max}}\n  \
             - {{type: p2p-source-producer, name: p2p, parameters: {{min_cached_token_delta: 64}}}}\n\
             scheduling_profiles:\n  - name: load-p2p\n    \
             plugins: [{{plugin_ref: queue, weight: 1}}, {{plugin_ref: max}}, {{plugin_ref: p2p}}]\n{}",
            endpoints_yaml(&[&e0, &e1])
        );
        let router = start_router(&yaml, Some(prefix)).await;
        let url = format!("http://{}", router.addr);
        let spawn = |seed: u32| {
            let url = url.clone();
            tokio::spawn(async move { send(&url, common::doc(seed, 5000)).await })
        };
        // One 5,000-token prompt fills each endpoint's share (the second goes to the emptier
        // e1, on arrival, and pulls what e0 holds).
        let first = spawn(1);
        common::eventually(5, "the first prompt to arrive", || {
            e0.count() + e1.count() == 1
        })
        .await;
        let second = spawn(2);
        common::eventually(5, "the second prompt to arrive", || {
            e0.count() + e1.count() == 2
        })
        .await;
        let held = spawn(3);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(e0.count() + e1.count(), 2, "the third prompt is held");
        for r in [first, second, held] {
            assert!(r.await.unwrap().status().is_success());
        }
        let decisions = get_json(&format!("{url}/debug/decisions?last=3")).await;
        let decisions = decisions.as_array().unwrap();
        let (on_arrival, released) = (&decisions[1], &decisions[2]);
        assert_eq!(on_arrival["held_ms"], 0.0);
        assert_eq!(on_arrival["outcome"], "pull_named", "{on_arrival}");
        assert!(released["held_ms"].as_f64().unwrap() > 200.0, "{released}");
        assert_eq!(released["endpoint"], "e1", "{released}");
        let want = if pulls_when_held {
            "pull_named"
        } else {
            "cold"
        };
        assert_eq!(
            released["outcome"], want,
            "pulls_when_held: {pulls_when_held}"
        );
    }
}

/// A request the admission queue releases while first-seen prompts still wait there is priced
/// as landing after them: they are released as fast as its pull's destination has room, and
/// computed before its blocks arrive. Alone in the queue, the same request pulls to the emptier
/// endpoint; with two first-seen prompts held behind it, it stays on the endpoint that holds its
/// prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_released_ahead_of_first_seen_prompts_stays_with_its_prefix_rather_than_pull() {
    for held_behind in [0, 2] {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        // e1's first byte releases the held request (1 s leaves the later prompts ample time
        // to reach the queue on a busy machine); e0 stays busy for the whole test.
        e0.set_mode(Mode::Slow(Duration::from_secs(3)));
        e1.set_mode(Mode::Slow(Duration::from_secs(1)));
        let prefix = std::sync::Arc::new(common::FakePrefix::default());
        // e0 holds 8,000 tokens of every 12,000-token prompt, in both tiers; 5,000-token
        // prompts are first-seen.
        prefix.set(&[(0, 500, 500)]);
        *prefix.cold_below_blocks.lock() = 700;
        // The default pipeline (predicted TTFT, priced pulls). A 12,000-token prompt leaves
        // 4,000 tokens to compute: more than an endpoint's 3,900-token share.
        let yaml = format!(
            "seed: 7\nblock_size: 16\ntokenizer: byte\nmetrics_scrape_interval: 1h\n\
             admission_queue: {{max_queued_prefill_tokens: 3900, aging: 0, max_hold: 30s}}\n{}",
            endpoints_yaml(&[&e0, &e1])
        );
        let router = start_router(&yaml, Some(prefix)).await;
        let url = format!("http://{}", router.addr);
        let spawn = |seed: u32, len: usize| {
            let url = url.clone();
            tokio::spawn(async move { send(&url, common::doc(seed, len)).await })
        };
        let mut sent = vec![spawn(1, 12_000)];
        common::eventually(5, "the first prompt to arrive", || e0.count() == 1).await;
        sent.push(spawn(2, 12_000)); // pulls into e1 on arrival
        common::eventually(5, "the second prompt to arrive", || e1.count() == 1).await;
        sent.push(spawn(3, 12_000));
        for seed in 4..4 + held_behind {
            tokio::time::sleep(Duration::from_millis(50)).await;
            sent.push(spawn(seed, 5_000));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(e0.count() + e1.count(), 2, "the later prompts are held");
        for r in sent {
            assert!(r.await.unwrap().status().is_success());
        }
        let decisions = get_json(&format!("{url}/debug/decisions?last={}", 3 + held_behind)).await;
        let decisions = decisions.as_array().unwrap();
        let (on_arrival, released) = (&decisions[1], &decisions[2]);
        assert_eq!(on_arrival["outcome"], "pull_named", "{on_arrival}");
        assert!(released["held_ms"].as_f64().unwrap() > 200.0, "{released}");
        assert_eq!(released["prompt_tokens"], 12_000, "{released}");
        let at_e1 = released["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["endpoint"] == "e1")
            .unwrap();
        let overtaken = at_e1["predicted"]["overtaken_ms"].as_f64().unwrap();
        if held_behind == 0 {
            assert_eq!(overtaken, 0.0, "{at_e1}");
            assert_eq!(released["endpoint"], "e1", "{released}");
            assert_eq!(released["outcome"], "pull_named", "{released}");
        } else {
            // The first 5,000-token prompt would go to idle e1 ahead of the pull (2,500 charged
            // < e0's 4,000 queued); then e1's share is full. 5,000 tokens at 25K tokens/s.
            assert!((overtaken - 200.0).abs() < 1.0, "{at_e1}");
            assert_eq!(released["endpoint"], "e0", "{released}");
            assert_eq!(released["outcome"], "local_hit", "{released}");
        }
    }
}
