//! Real kvmesh engines (sim backend) started in-process on loopback, with KV events and a P2P port.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use kvmesh_engine::EngineConfig;
use kvmesh_engine::config::KvEventsConfig;
use kvmesh_engine::server::{RunningServer, ServerOptions, sim_backend, start_server};
use kvmesh_text::ByteTokenizer;

pub struct SimEngine {
    pub name: String,
    pub url: String,
    /// `tcp://127.0.0.1:PORT` the router connects to.
    pub events: String,
    pub p2p_port: u16,
    pub server: RunningServer,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts a sim engine (block 16, gpt-oss profile divided by `time_scale`).
pub async fn start_engine(name: &str, time_scale: f64, num_gpu_blocks: usize) -> SimEngine {
    let p2p_port = free_port();
    let mut config = EngineConfig {
        port: 0,
        num_gpu_blocks,
        kv_events: Some(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","topic":"kv-events"}"#)
                .unwrap(),
        ),
        ..EngineConfig::default()
    };
    config.p2p.port = Some(p2p_port);
    config.p2p.allowed_peers = vec!["127.0.0.1".to_owned()];
    let backend = sim_backend(&config, "gpt-oss-120b-h200", time_scale, 32).unwrap();
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
        p2p_port,
        server,
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
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
