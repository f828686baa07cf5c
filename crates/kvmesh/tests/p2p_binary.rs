//! Two `kvmesh engine` processes with `--p2p-port 0`: B pulls a prefix A holds when a request
//! names A in `kv_transfer_params.remote_kv_source`; peers authenticate with a shared secret read
//! from `--p2p-secret-file`; a peer with another secret is refused and B computes instead.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::timeout;

mod common;

use common::{EngineProcess, spawn_engine};

/// A sim engine with a P2P producer, peers authenticated with the secret in `secret`.
async fn engine(secret: &std::path::Path) -> EngineProcess {
    let mut args: Vec<std::ffi::OsString> = [
        "--served-model-name",
        "sim-bin",
        "--backend",
        "sim",
        "--profile",
        "gpt-oss-120b-h200",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "512",
        "--cpu-offload-bytes",
        "64MiB",
        "--time-scale",
        "100",
        "--p2p-port",
        "0",
        "--p2p-allowed-peers",
        "127.0.0.1",
        "--p2p-timeout-ms",
        "2000",
        "--p2p-secret-file",
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    args.push(secret.into());
    spawn_engine(args).await
}

async fn complete(base: &str, prompt: &[u32], kvp: Option<Value>) -> Value {
    let mut body = json!({"model": "sim-bin", "prompt": prompt, "max_tokens": 3, "temperature": 0});
    if let Some(p) = kvp {
        body["kv_transfer_params"] = p;
    }
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Sum of the samples of `name` whose labels contain `label` (e.g. `direction="in"`).
async fn metric(base: &str, name: &str, label: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn cached(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_binaries_pull_a_prefix_from_each_other() {
    timeout(Duration::from_secs(90), async {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("p2p.secret");
        std::fs::write(&secret, "correct horse battery staple\n").unwrap();
        let other = dir.path().join("other.secret");
        std::fs::write(&other, "something else").unwrap();
        let (a, b, c) = tokio::join!(engine(&secret), engine(&secret), engine(&other));

        let prefix: Vec<u32> = (0..1024u32).map(|i| (i * 31 + 7) % 256).collect();
        complete(&a.http, &prefix, None).await;
        let mut prompt = prefix.clone();
        prompt.extend((0..40u32).map(|i| (i * 13) % 256));
        let src = json!({"remote_kv_source": {"kv_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": a.p2p_port.unwrap()}});

        let got = complete(&b.http, &prompt, Some(src.clone())).await;
        assert_eq!(cached(&got), 1024, "{got}");
        assert_eq!(metric(&b.http, "vllm:external_prefix_cache_hits_total", "").await, 1024.0);
        assert_eq!(metric(&b.http, "kvmesh_p2p_blocks_total", "direction=\"in\"").await, 64.0);
        assert_eq!(metric(&b.http, "kvmesh_p2p_payload_bytes_total", "direction=\"in\"").await, 64.0 * 16.0 * 32.0);
        assert_eq!(metric(&a.http, "kvmesh_p2p_blocks_total", "direction=\"out\"").await, 64.0);

        // Wrong secret: refused, computed, same answer.
        let refused = complete(&c.http, &prompt, Some(src)).await;
        assert_eq!(cached(&refused), 0);
        assert_eq!(refused["choices"][0]["text"], got["choices"][0]["text"]);
        assert_eq!(metric(&c.http, "kvmesh_p2p_pulls_total", "reason=\"auth_failed\"").await, 1.0);
        assert_eq!(metric(&a.http, "kvmesh_p2p_refused_connections_total", "reason=\"auth_failed\"").await, 1.0);
    })
    .await
    .expect("test timed out");
}
