//! Gateway behaviour against fake OpenAI engines on loopback: pass-through (JSON and SSE without
//! buffering), errors, 400s that never reach an engine, load released on every path, P2P source
//! injection, explanations, health ejection, endpoints-file reload.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{
    FakeEngine, FakePrefix, Mode, client, endpoints_yaml, eventually, get_json, get_text,
    post_json, start_router,
};
use futures::StreamExt;
use kvmesh_router::RouterHandle;
use serde_json::{Value, json};
use tokio::sync::Notify;

const LIMIT: Duration = Duration::from_secs(30);

fn in_flight(r: &RouterHandle) -> Vec<u64> {
    r.state
        .endpoints
        .list()
        .iter()
        .map(|e| e.load.snapshot().requests)
        .collect()
}

fn load_zero(r: &RouterHandle) -> bool {
    r.state
        .endpoints
        .list()
        .iter()
        .all(|e| e.load.snapshot() == Default::default())
}

#[tokio::test]
async fn malformed_requests_get_400_without_reaching_an_engine() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        let r = start_router(&endpoints_yaml(&[&e0]), None).await;
        let base = format!("http://{}", r.addr);
        for (path, body) in [
            ("/v1/completions", "{not json"),
            ("/v1/completions", r#"{"model":"m"}"#),
            ("/v1/completions", r#"{"prompt":[1,-1]}"#),
            ("/v1/completions", r#"{"prompt":"x","max_tokens":"many"}"#),
            ("/v1/chat/completions", r#"{"messages":[]}"#),
            (
                "/v1/chat/completions",
                r#"{"messages":[{"role":"user","content":7}]}"#,
            ),
        ] {
            let resp = client()
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 400, "{body}");
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["code"], 400);
            assert!(v["error"]["message"].as_str().unwrap().len() > 3);
        }
        let resp = client()
            .post(format!("{base}/v1/completions"))
            .header("x-kvmesh-profile", "nope")
            .body(r#"{"prompt":"x"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        assert_eq!(e0.count(), 0, "no malformed request may reach the engine");
        let metrics = get_text(&format!("{base}/metrics")).await;
        assert!(
            metrics.contains("kvmesh_router_errors_total{kind=\"bad_request\"} 7"),
            "{metrics}"
        );
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn json_and_sse_pass_through_and_engine_errors_are_passed_on() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        let r = start_router(&endpoints_yaml(&[&e0]), None).await;
        let base = format!("http://{}", r.addr);
        let resp = post_json(&format!("{base}/v1/completions"), &json!({"prompt": "hello", "max_tokens": 3})).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-kvmesh-endpoint"], "e0");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["engine"], "e0");
        // Forwarded body keeps unknown fields and the prompt verbatim.
        let resp = post_json(&format!("{base}/v1/chat/completions"), &json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "cache_salt": "s"})).await;
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let text = resp.text().await.unwrap();
        assert_eq!(text.matches("data: ").count(), 4);
        assert!(text.ends_with("data: [DONE]\n\n"));
        let got = e0.state.received.lock().last().map(|r| (r.path.clone(), r.body.clone())).unwrap();
        assert_eq!(got.0, "/v1/chat/completions");
        assert_eq!(got.1["cache_salt"], "s");
        // Engine errors: status and body unchanged; load released.
        e0.set_mode(Mode::Error(422, r#"{"error":{"message":"engine says no","code":422}}"#.into()));
        let resp = post_json(&format!("{base}/v1/completions"), &json!({"prompt": "x"})).await;
        assert_eq!(resp.status(), 422);
        assert!(resp.text().await.unwrap().contains("engine says no"));
        assert!(load_zero(&r));
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn streams_are_not_buffered_and_load_is_held_until_the_end() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        let gate = Arc::new(Notify::new());
        e0.set_mode(Mode::Gated(Arc::clone(&gate)));
        let r = start_router(&endpoints_yaml(&[&e0]), None).await;
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "a".repeat(100), "stream": true, "max_tokens": 7}),
        )
        .await;
        let mut body = resp.bytes_stream();
        let first = body.next().await.unwrap().unwrap();
        assert!(
            std::str::from_utf8(&first).unwrap().contains("t0"),
            "first chunk arrives before the engine finishes"
        );
        let snap = r.state.endpoints.list()[0].load.snapshot();
        assert_eq!(snap.requests, 1);
        assert_eq!(
            snap.uncached_tokens, 0,
            "prefill is over once the first byte arrived"
        );
        assert_eq!(snap.decode_tokens, 7);
        gate.notify_one();
        let mut rest = Vec::new();
        while let Some(c) = body.next().await {
            rest.extend_from_slice(&c.unwrap());
        }
        assert!(String::from_utf8(rest).unwrap().contains("[DONE]"));
        eventually(5, "load released at stream end", || load_zero(&r)).await;
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn client_disconnect_releases_load_and_cancels_upstream() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        e0.set_mode(Mode::Hang);
        let r = start_router(&endpoints_yaml(&[&e0]), None).await;
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "hang", "stream": true}),
        )
        .await;
        let mut body = resp.bytes_stream();
        body.next().await.unwrap().unwrap();
        assert_eq!(in_flight(&r), vec![1]);
        drop(body);
        eventually(5, "load released after disconnect", || load_zero(&r)).await;
        eventually(5, "upstream stream cancelled", || {
            e0.state.cancelled.load(Ordering::SeqCst) == 1
        })
        .await;
        // Disconnect while waiting for response headers (engine slow).
        e0.set_mode(Mode::Slow(Duration::from_secs(60)));
        let url = format!("http://{}/v1/completions", r.addr);
        let req = tokio::spawn(async move {
            client()
                .post(url)
                .json(&json!({"prompt": "slow"}))
                .send()
                .await
        });
        eventually(5, "request in flight", || in_flight(&r) == vec![1]).await;
        req.abort();
        eventually(5, "load released after early disconnect", || load_zero(&r)).await;
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn upstream_timeout_and_dead_engine_release_load() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        e0.set_mode(Mode::Slow(Duration::from_secs(30)));
        let yaml = format!("request_timeout: 200ms\n{}", endpoints_yaml(&[&e0]));
        let r = start_router(&yaml, None).await;
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "x"}),
        )
        .await;
        assert_eq!(resp.status(), 504);
        assert!(load_zero(&r));
        r.shutdown().await.unwrap();
        // An endpoint nobody listens on: 502, load released.
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", dead.local_addr().unwrap());
        drop(dead);
        let r = start_router(
            &format!("endpoints:\n  - {{name: dead, url: \"{url}\"}}\n"),
            None,
        )
        .await;
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "x"}),
        )
        .await;
        assert_eq!(resp.status(), 502);
        assert!(load_zero(&r));
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

const LOAD_P2P: &str = r#"
seed: 7
source_header: true
trust_client_kv_transfer_params: true
plugins:
  - {type: queue-scorer, name: queue}
  - {type: round-robin-picker, name: rr}
  - {type: p2p-source-producer, name: p2p, parameters: {min_cached_token_delta: 64}}
scheduling_profiles:
  - name: load-p2p
    plugins: [{plugin_ref: queue, weight: 1}, {plugin_ref: rr}, {plugin_ref: p2p}]
"#;

#[tokio::test]
async fn p2p_source_is_injected_and_explained() {
    tokio::time::timeout(LIMIT, async {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        let prefix = Arc::new(FakePrefix::default());
        // e0 holds 20 blocks (320 tokens) in both tiers.
        prefix.set(&[(0, 20, 20)]);
        let yaml = format!("{LOAD_P2P}{}", endpoints_yaml(&[&e0, &e1]));
        let r = start_router(&yaml, Some(prefix.clone())).await;
        let base = format!("http://{}", r.addr);
        let prompt = "p".repeat(400);
        let mut sources = Vec::new();
        for i in 0..4 {
            let resp = client()
                .post(format!("{base}/v1/completions"))
                .header("x-kvmesh-explain", "1")
                .header("x-kv-cache-source-host-port", "10.0.0.1:1")
                .header("x-request-id", format!("req-{i}"))
                .json(&json!({"prompt": prompt, "kv_transfer_params": {"keep": true}}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let decision: Value =
                serde_json::from_str(resp.headers()["x-kvmesh-decision"].to_str().unwrap())
                    .unwrap();
            sources.push((
                decision["endpoint"].as_str().unwrap().to_owned(),
                decision["p2p_source"].clone(),
            ));
        }
        // Round robin alternates; requests on e1 pull from e0; requests on e0 are local hits.
        for (ep, src) in &sources {
            if ep == "e1" {
                assert_eq!(src, "e0");
            } else {
                assert!(src.is_null());
            }
        }
        let on_e1: Vec<_> = e1
            .state
            .received
            .lock()
            .iter()
            .map(|r| (r.headers.clone(), r.body.clone()))
            .collect();
        assert_eq!(on_e1.len(), 2);
        for (h, b) in &on_e1 {
            let src = &b["kv_transfer_params"]["remote_kv_source"];
            assert_eq!(src["remote_host"], "127.0.0.1");
            assert_eq!(src["remote_port"], 7000);
            assert_eq!(src["kv_request_id"], h["x-request-id"].to_str().unwrap());
            assert_eq!(
                b["kv_transfer_params"]["keep"], true,
                "other kv_transfer_params keys are kept"
            );
            assert_eq!(h["x-kv-cache-source-host-port"], "127.0.0.1:7000");
        }
        for r in e0.state.received.lock().iter() {
            assert!(
                r.body["kv_transfer_params"]
                    .get("remote_kv_source")
                    .is_none()
            );
            assert!(
                r.headers.get("x-kv-cache-source-host-port").is_none(),
                "inbound copies are stripped"
            );
        }
        let decisions: Value = get_json(&format!("{base}/debug/decisions?last=2")).await;
        let decisions = decisions.as_array().unwrap();
        assert_eq!(decisions.len(), 2);
        assert_eq!(decisions[1]["request_id"], "req-3");
        let d = decisions.iter().find(|d| d["endpoint"] == "e1").unwrap();
        assert_eq!(d["outcome"], "pull_named");
        assert_eq!(d["p2p"]["source_tokens"], 320);
        assert_eq!(d["p2p"]["delta_tokens"], 320);
        assert!(d["candidates"][0]["scores"]["queue"].is_number());
        let d = decisions.iter().find(|d| d["endpoint"] == "e0").unwrap();
        assert_eq!(d["p2p"]["skipped"], "self_source");
        let metrics = get_text(&format!("{base}/metrics")).await;
        assert!(
            metrics.contains("kvmesh_router_decisions_total{outcome=\"pull_named\"} 2"),
            "{metrics}"
        );
        assert!(
            metrics.contains("kvmesh_router_pull_skipped_total{reason=\"self\"} 2"),
            "{metrics}"
        );
        assert!(
            metrics
                .contains("kvmesh_router_requests_total{profile=\"load-p2p\",endpoint=\"e1\"} 2"),
            "{metrics}"
        );
        assert!(
            metrics.contains("kvmesh_router_prefill_rate_tokens_per_second{endpoint=\"e0\"}"),
            "{metrics}"
        );
        // /debug/prefix reports the index view per endpoint.
        let p: Value = post_json(&format!("{base}/debug/prefix"), &json!({"prompt": prompt}))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(p["endpoints"]["e0"]["gpu_tokens"], 320);
        assert_eq!(p["endpoints"]["e1"]["cpu_tokens"], 0);
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn unhealthy_endpoints_are_ejected_and_readmitted() {
    tokio::time::timeout(LIMIT, async {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        let yaml = format!(
            "health_check: {{interval: 50ms, timeout: 200ms, unhealthy_threshold: 2, healthy_threshold: 2}}\nmetrics_scrape_interval: 50ms\n{}",
            endpoints_yaml(&[&e0, &e1])
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        e1.state.healthy.store(false, Ordering::SeqCst);
        let healthy = |r: &RouterHandle| r.state.endpoints.list().iter().map(|e| e.is_healthy()).collect::<Vec<_>>();
        eventually(5, "e1 ejected", || healthy(&r) == vec![true, false]).await;
        for _ in 0..6 {
            let resp = post_json(&format!("{base}/v1/completions"), &json!({"prompt": "x"})).await;
            assert_eq!(resp.headers()["x-kvmesh-endpoint"], "e0");
        }
        assert_eq!(e1.count(), 0);
        e1.state.healthy.store(true, Ordering::SeqCst);
        eventually(5, "e1 readmitted", || healthy(&r) == vec![true, true]).await;
        // Scraped gauges reach the candidates.
        eventually(5, "metrics scraped", || r.state.endpoints.list().iter().all(|e| e.metrics().is_some())).await;
        let m = r.state.endpoints.list()[0].metrics().unwrap();
        assert_eq!(m.kv_usage, 0.25);
        let metrics = get_text(&format!("{base}/metrics")).await;
        assert!(metrics.contains("kvmesh_router_endpoint_changes_total{kind=\"ejected\"} 1"), "{metrics}");
        assert!(metrics.contains("kvmesh_router_endpoint_kv_usage_ratio{endpoint=\"e1\"} 0.25"), "{metrics}");
        let h = client().get(format!("{base}/health")).send().await.unwrap();
        assert_eq!(h.status(), 200);
        let models: Value = get_json(&format!("{base}/v1/models")).await;
        assert_eq!(models["data"][0]["id"], "m");
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// The router's current endpoints, by name.
fn endpoint_names(r: &RouterHandle) -> Vec<String> {
    r.state
        .endpoints
        .list()
        .iter()
        .map(|e| e.name.to_string())
        .collect()
}

#[tokio::test]
async fn endpoints_file_changes_apply_without_restart() {
    tokio::time::timeout(LIMIT, async {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fleet.yaml");
        std::fs::write(&file, endpoints_yaml(&[&e0])).unwrap();
        let yaml = format!("endpoints_file: {}\n", file.display());
        let r = start_router(&yaml, None).await;
        assert_eq!(endpoint_names(&r), vec!["e0"]);
        std::fs::write(&file, endpoints_yaml(&[&e0, &e1])).unwrap();
        eventually(10, "e1 added", || endpoint_names(&r) == vec!["e0", "e1"]).await;
        // A broken file leaves the list alone.
        std::fs::write(&file, "endpoints: [{name: x}]").unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(endpoint_names(&r), vec!["e0", "e1"]);
        // Replace by rename (as editors do), dropping e0.
        let tmp = dir.path().join("fleet.yaml.tmp");
        std::fs::write(&tmp, format!("- {{name: e1, url: \"{}\"}}\n", e1.url)).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
        eventually(10, "e0 removed", || endpoint_names(&r) == vec!["e1"]).await;
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "x"}),
        )
        .await;
        assert_eq!(resp.headers()["x-kvmesh-endpoint"], "e1");
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// Endpoints listed inline in the router config (the shipped configs' form) are watched too.
#[tokio::test]
async fn inline_endpoint_changes_in_the_config_apply_without_restart() {
    tokio::time::timeout(LIMIT, async {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("router.yaml");
        std::fs::write(&path, format!("seed: 1\n{}", endpoints_yaml(&[&e0]))).unwrap();
        let config = kvmesh_router::RouterConfig::load(&path).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let options = kvmesh_router::RouterOptions {
            config_path: Some(path.clone()),
            ..Default::default()
        };
        let r = kvmesh_router::start(config, listener, options)
            .await
            .unwrap();
        assert_eq!(endpoint_names(&r), vec!["e0"]);
        std::fs::write(&path, format!("seed: 1\n{}", endpoints_yaml(&[&e0, &e1]))).unwrap();
        eventually(10, "e1 added", || endpoint_names(&r) == vec!["e0", "e1"]).await;
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn cold_requests_spread_across_endpoints() {
    tokio::time::timeout(LIMIT, async {
        let engines = [
            FakeEngine::start("e0").await,
            FakeEngine::start("e1").await,
            FakeEngine::start("e2").await,
        ];
        let refs: Vec<&FakeEngine> = engines.iter().collect();
        let r = start_router(&format!("seed: 3\n{}", endpoints_yaml(&refs)), None).await;
        for i in 0..30 {
            post_json(
                &format!("http://{}/v1/completions", r.addr),
                &json!({"prompt": format!("cold {i}")}),
            )
            .await;
        }
        // Default affinity profile, all scores tied: random tie-break must use every endpoint.
        for e in &engines {
            assert!(e.count() >= 3, "{} got {}", e.state.name, e.count());
        }
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn streamed_ttft_on_an_idle_endpoint_teaches_the_cost_model() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        let r = start_router(&endpoints_yaml(&[&e0]), None).await;
        let id = r.state.endpoints.list()[0].id;
        // Too short to be a clean prefill sample: ignored.
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "short", "stream": true}),
        )
        .await;
        resp.text().await.unwrap();
        assert!(r.state.cost_model.prefill_rates().is_empty());
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "x".repeat(2000), "stream": true}),
        )
        .await;
        resp.text().await.unwrap();
        let rates = r.state.cost_model.prefill_rates();
        assert_eq!(rates.len(), 1);
        assert_eq!(rates[0].0, id);
        assert_eq!(rates[0].1.samples, 1);
        assert_ne!(rates[0].1.tokens_per_second, 25_000.0);
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn hf_tokenizer_and_chat_template_from_config() {
    tokio::time::timeout(LIMIT, async {
        let dir = tempfile::tempdir().unwrap();
        let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tokenizers/wordlevel.json");
        let tpl = dir.path().join("chat.jinja");
        std::fs::write(
            &tpl,
            "{% for m in messages %}{{ m.role }} says {{ m.content }} {% endfor %}",
        )
        .unwrap();
        let e0 = FakeEngine::start("e0").await;
        let yaml = format!(
            "tokenizer: {{path: \"{}\", chat_template: \"{}\"}}\n{}",
            tok.display(),
            tpl.display(),
            endpoints_yaml(&[&e0])
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        post_json(
            &format!("{base}/v1/completions"),
            &json!({"prompt": "hello world hello"}),
        )
        .await;
        post_json(
            &format!("{base}/v1/chat/completions"),
            &json!({"messages": [{"role": "user", "content": "hello world"}]}),
        )
        .await;
        let d: Value = get_json(&format!("{base}/debug/decisions?last=2")).await;
        assert_eq!(d[0]["prompt_tokens"], 3);
        // "user says hello world" = 4 words.
        assert_eq!(d[1]["prompt_tokens"], 4);
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// The router owns `kv_transfer_params`: a client's own (here pointing an engine at another host's
/// port) never reach an engine unless the config trusts clients, and every drop is counted.
#[tokio::test]
async fn client_kv_transfer_params_are_dropped_unless_trusted() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        let r = start_router(&endpoints_yaml(&[&e0]), None).await;
        let base = format!("http://{}", r.addr);
        let hostile = json!({"prompt": "x",
            "kv_transfer_params": {"remote_kv_source": {"kv_request_id": "r", "remote_host": "10.9.9.9", "remote_port": 22}}});
        assert_eq!(post_json(&format!("{base}/v1/completions"), &hostile).await.status(), 200);
        let body = e0.last_body();
        assert!(body.get("kv_transfer_params").is_none(), "{body}");
        assert_eq!(body["prompt"], "x");
        let dropped = common::scrape_metric(&base, "kvmesh_router_client_kv_transfer_params_dropped_total", "").await;
        assert_eq!(dropped, 1.0);
        r.shutdown().await.unwrap();
        let yaml = format!("trust_client_kv_transfer_params: true\n{}", endpoints_yaml(&[&e0]));
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        assert_eq!(post_json(&format!("{base}/v1/completions"), &hostile).await.status(), 200);
        assert_eq!(
            e0.last_body()["kv_transfer_params"]["remote_kv_source"]["remote_port"],
            22,
            "trusted clients' params pass"
        );
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// An engine that refuses the connection costs the client nothing: the request is placed once more
/// on another endpoint, and the refusing one is ejected at once (not after health checks), its
/// index entries dropped (its process, and its cache, are gone).
#[tokio::test]
async fn a_refused_connection_is_retried_elsewhere_and_ejects_the_endpoint() {
    tokio::time::timeout(LIMIT, async {
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead_url = format!("http://{}", dead.local_addr().unwrap());
        drop(dead);
        let e1 = FakeEngine::start("e1").await;
        // Round robin starts with the dead endpoint; a long health interval keeps the health loop
        // out of it: only the refused connection can eject it.
        let yaml = format!(
            r#"
seed: 1
health_check: {{interval: 60s, timeout: 1s, unhealthy_threshold: 3, healthy_threshold: 1, path: /health}}
plugins: [{{type: round-robin-picker, name: rr}}]
scheduling_profiles: [{{name: rr, plugins: [{{plugin_ref: rr}}]}}]
endpoints:
  - {{name: dead, url: "{dead_url}"}}
  - {{name: e1, url: "{}"}}
"#,
            e1.url
        );
        let prefix = Arc::new(FakePrefix::default());
        prefix.set(&[(0, 4, 4), (1, 1, 0)]);
        let r = start_router(&yaml, Some(prefix.clone())).await;
        let base = format!("http://{}", r.addr);
        for i in 0..4 {
            let resp = post_json(&format!("{base}/v1/completions"), &json!({"prompt": format!("q{i}")})).await;
            assert_eq!(resp.status(), 200, "request {i}");
            assert_eq!(resp.headers()["x-kvmesh-endpoint"], "e1");
        }
        assert_eq!(e1.count(), 4);
        let list = r.state.endpoints.list();
        assert!(!list.iter().find(|e| e.name.as_ref() == "dead").unwrap().is_healthy());
        let metric = |name: &'static str, labels: &'static str| common::scrape_metric(&base, name, labels);
        assert_eq!(metric("kvmesh_router_retries_total", "").await, 1.0);
        assert_eq!(metric("kvmesh_router_endpoint_changes_total", "kind=\"ejected\"").await, 1.0);
        let held: Vec<u32> = prefix.matches.lock().iter().map(|m| m.endpoint.0).collect();
        assert_eq!(held, vec![1], "the refusing endpoint's index entries are dropped");
        assert!(load_zero(&r));
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// Beyond `max_in_flight` (streams count until they end) the router answers 503 with
/// `Retry-After`, and takes requests again once the held ones finish.
#[tokio::test]
async fn overload_is_refused_with_retry_after() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        let gate = Arc::new(Notify::new());
        e0.set_mode(Mode::Gated(Arc::clone(&gate)));
        let yaml = format!("max_in_flight: 1\n{}", endpoints_yaml(&[&e0]));
        let r = start_router(&yaml, None).await;
        let url = format!("http://{}/v1/completions", r.addr);
        let held = post_json(&url, &json!({"prompt": "a", "stream": true})).await;
        assert_eq!(held.status(), 200);
        let mut body = held.bytes_stream();
        body.next().await.unwrap().unwrap();
        let refused = post_json(&url, &json!({"prompt": "b"})).await;
        assert_eq!(refused.status(), 503);
        assert_eq!(refused.headers()["retry-after"], "1");
        let err: Value = refused.json().await.unwrap();
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("max_in_flight"),
            "{err}"
        );
        gate.notify_one();
        while body.next().await.is_some() {}
        drop(body);
        eventually(5, "the slot is released at stream end", || {
            r.state.in_flight.load(Ordering::SeqCst) == 0
        })
        .await;
        e0.set_mode(Mode::Echo);
        assert_eq!(post_json(&url, &json!({"prompt": "c"})).await.status(), 200);
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// An endpoint configured with KV events whose stream delivers nothing (here: nobody publishes
/// there) is routed blind; after a few placements the router says so in `/metrics` and
/// `/debug/endpoints`. An endpoint without `kv_events` is never flagged.
#[tokio::test]
async fn a_silent_event_stream_is_reported() {
    tokio::time::timeout(LIMIT, async {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let yaml = format!(
            r#"
plugins: [{{type: round-robin-picker, name: rr}}]
scheduling_profiles: [{{name: rr, plugins: [{{plugin_ref: rr}}]}}]
endpoints:
  - {{name: e0, url: "{}", kv_events: {{endpoint: "tcp://127.0.0.1:{port}", bind: true, topic: ""}}}}
  - {{name: e1, url: "{}"}}
"#,
            e0.url, e1.url
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        let silent = || {
            common::scrape_metric(&base, "kvmesh_router_endpoint_events_silent", "endpoint=\"e0\"")
        };
        for i in 0..40 {
            let resp = post_json(&format!("{base}/v1/completions"), &json!({"prompt": format!("q{i}")})).await;
            assert_eq!(resp.status(), 200);
            if i == 10 {
                assert_eq!(silent().await, 0.0, "not before 16 placements");
            }
        }
        assert_eq!(silent().await, 1.0);
        let eps = get_json(&format!("{base}/debug/endpoints")).await;
        let e0v = eps.as_array().unwrap().iter().find(|e| e["name"] == "e0").unwrap();
        assert_eq!(e0v["events_silent"], true, "{eps}");
        assert_eq!(e0v["event_batches_received"], 0);
        assert_eq!(e0v["placed"], 20);
        let e1v = eps.as_array().unwrap().iter().find(|e| e["name"] == "e1").unwrap();
        assert_eq!(e1v["events_silent"], false);
        assert!(e1v["event_batches_received"].is_null());
        let metrics = get_text(&format!("{base}/metrics")).await;
        assert!(!metrics.contains("kvmesh_router_endpoint_events_silent{endpoint=\"e1\"}"), "{metrics}");
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// P/D: a decoder that refuses the connection costs the client nothing either — the decode leg is
/// placed once more on another decoder, and the refusing one is ejected.
#[tokio::test]
async fn a_refused_decode_leg_is_retried_on_another_decoder() {
    tokio::time::timeout(LIMIT, async {
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead_url = format!("http://{}", dead.local_addr().unwrap());
        drop(dead);
        let (p0, d1) = (FakeEngine::start("p0").await, FakeEngine::start("d1").await);
        let yaml = format!(
            r#"
health_check: {{interval: 60s, timeout: 1s, unhealthy_threshold: 3, healthy_threshold: 1, path: /health}}
plugins: [{{type: round-robin-picker, name: rrp}}, {{type: round-robin-picker, name: rrd}}]
scheduling_profiles:
  - {{name: p, plugins: [{{plugin_ref: rrp}}]}}
  - {{name: d, plugins: [{{plugin_ref: rrd}}]}}
pd: {{prefill_profile: p, decode_profile: d}}
endpoints:
  - {{name: p0, url: "{}", role: prefill}}
  - {{name: dead, url: "{dead_url}", role: decode}}
  - {{name: d1, url: "{}", role: decode}}
"#,
            p0.url, d1.url
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        for i in 0..3 {
            let resp = post_json(&format!("{base}/v1/completions"), &json!({"prompt": format!("q{i}")})).await;
            assert_eq!(resp.status(), 200, "request {i}");
            assert_eq!(resp.headers()["x-kvmesh-endpoint"], "d1");
        }
        assert_eq!(d1.count(), 3);
        let base2 = base.clone();
        let metric = move |name: &'static str, labels: &'static str| {
            let base = base2.clone();
            async move { common::scrape_metric(&base, name, labels).await }
        };
        assert_eq!(metric("kvmesh_router_retries_total", "").await, 1.0);
        assert_eq!(metric("kvmesh_router_endpoint_changes_total", "kind=\"ejected\"").await, 1.0);
        assert!(load_zero(&r));
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// An endpoint the health loop ejects because its connections are refused (the process is gone)
/// loses its index entries too, so a restarted process is not credited with its predecessor's
/// cache; one that merely answers 503 keeps them (it may still hold its cache).
#[tokio::test]
async fn a_refusing_endpoint_ejected_by_health_checks_loses_its_index_entries() {
    tokio::time::timeout(LIMIT, async {
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead_url = format!("http://{}", dead.local_addr().unwrap());
        drop(dead);
        let sick = FakeEngine::start("sick").await;
        sick.state.healthy.store(false, Ordering::SeqCst);
        let prefix = Arc::new(FakePrefix::default());
        prefix.set(&[(0, 10, 10), (1, 10, 10)]);
        let yaml = format!(
            r#"
health_check: {{interval: 50ms, timeout: 1s, unhealthy_threshold: 2, healthy_threshold: 1, path: /health}}
endpoints:
  - {{name: dead, url: "{dead_url}"}}
  - {{name: sick, url: "{}"}}
"#,
            sick.url
        );
        let r = start_router(&yaml, Some(prefix.clone())).await;
        eventually(5, "both ejected", || {
            r.state.endpoints.list().iter().all(|e| !e.is_healthy())
        })
        .await;
        let held: Vec<u32> = prefix.matches.lock().iter().map(|m| m.endpoint.0).collect();
        assert_eq!(held, vec![1], "the refusing endpoint's entries are gone, the 503 one's kept");
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}
