//! Real kvmesh engines (sim backend) started in-process on loopback, with KV events and a P2P port.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use kvmesh_engine::EngineConfig;
use kvmesh_engine::config::KvEventsConfig;
use kvmesh_engine::server::{RunningServer, ServerOptions, sim_backend, start_server};
use kvmesh_router::RouterHandle;
use kvmesh_text::ByteTokenizer;

/// The sim profile the router tests' engines run.
pub const PROFILE: &str = "gpt-oss-120b-h200";

pub struct SimEngine {
    pub name: String,
    pub url: String,
    /// `tcp://127.0.0.1:PORT` the router connects to.
    pub events: String,
    pub p2p_port: u16,
    pub server: RunningServer,
}

/// Sim engine config: block 16, `num_gpu_blocks`, KV events on a port the engine binds, and a
/// P2P producer on a port it binds, open to loopback peers.
pub fn sim_config(num_gpu_blocks: usize) -> EngineConfig {
    let mut config = EngineConfig {
        port: 0,
        num_gpu_blocks,
        kv_events: Some(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","topic":"kv-events"}"#)
                .unwrap(),
        ),
        ..EngineConfig::default()
    };
    config.p2p.port = Some(0);
    config.p2p.allowed_peers = vec!["127.0.0.1".to_owned()];
    config
}

/// Starts a sim engine (block 16, gpt-oss profile divided by `time_scale`).
pub async fn start_engine(name: &str, time_scale: f64, num_gpu_blocks: usize) -> SimEngine {
    start_engine_with(name, sim_config(num_gpu_blocks), time_scale).await
}

/// Starts a sim engine from `config` (see [`sim_config`]) with the gpt-oss profile divided by
/// `time_scale`.
pub async fn start_engine_with(name: &str, config: EngineConfig, time_scale: f64) -> SimEngine {
    let backend = sim_backend(&config, PROFILE, time_scale, 32).unwrap();
    let server = start_server(
        config,
        backend,
        Arc::new(ByteTokenizer),
        ServerOptions::default(),
    )
    .await
    .unwrap();
    let bound = server.events_endpoint.clone().unwrap();
    let port = bound.rsplit(':').next().unwrap();
    SimEngine {
        name: name.to_owned(),
        url: format!("http://{}", server.addr),
        events: format!("tcp://127.0.0.1:{port}"),
        p2p_port: server.p2p_addr.unwrap().port(),
        server,
    }
}

/// Shuts the router down, then every engine.
pub async fn stop(r: RouterHandle, engines: Vec<SimEngine>) {
    r.shutdown().await.unwrap();
    for e in engines {
        e.server.shutdown().await;
    }
}

/// Router `endpoints:` YAML for these engines.
pub fn engines_yaml(engines: &[&SimEngine]) -> String {
    let mut s = String::from("endpoints:\n");
    for e in engines {
        s.push_str(&format!(
            "  - {{name: {}, url: \"{}\", p2p: \"127.0.0.1:{}\", kv_events: {{endpoint: \"{}\", topic: kv-events}}}}\n",
            e.name, e.url, e.p2p_port, e.events
        ));
    }
    s
}

/// Sum of a metric's samples in an engine's `/metrics`.
pub async fn engine_metric(url: &str, name: &str) -> f64 {
    super::scrape_metric(url, name, "").await
}
