//! Addresses an engine tells others: an engine bound on all interfaces names its
//! `--advertise-host` in P/D hand-off params (prefill leg, and a decode leg with bi-directional
//! transfer), never the bind address nor loopback; without one it does not start when peers
//! beyond this host would need the address. 127.0.0.2 and 127.0.0.3 stand for other machines'
//! IPs: any 127/8 address is loopback on Linux, so the decoder's pull through it really connects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::complete_ignore_eos as complete;
use common::{
    PROFILE, cached_tokens, p2p_config, prefill_leg, start_engine, tokens, try_start_engine,
};
use kvmesh_engine::server::ServerError;
use kvmesh_engine::{EngineConfig, Role};
use kvmesh_transfer::Secret;
use serde_json::json;
use tokio::time::timeout;

const SECRET: &str = "advertise-test";

/// An engine on all interfaces whose producer serves any authenticated peer (so peers may be on
/// other hosts and must be told where it is).
fn wildcard(role: Role, advertise: Option<&str>) -> EngineConfig {
    let mut cfg = p2p_config();
    cfg.host = "0.0.0.0".into();
    cfg.advertise_host = advertise.map(str::to_owned);
    cfg.p2p.role = role;
    cfg.p2p.secret = Some(Secret::from(SECRET));
    cfg
}

/// Where this test reaches a server bound on 0.0.0.0.
fn local(addr: SocketAddr) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], addr.port()))
}

#[tokio::test]
async fn a_wildcard_engine_whose_peers_need_its_address_does_not_start_without_one() {
    let Err(err) = try_start_engine(wildcard(Role::Prefill, None), PROFILE, 1000.0, 32).await
    else {
        panic!("a prefiller on 0.0.0.0 started with no address to hand its decoders")
    };
    assert!(matches!(err, ServerError::Config(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("--advertise-host") && msg.contains("0.0.0.0"),
        "{msg}"
    );
}

/// The prefill leg names 127.0.0.2, the decoder pulls the prompt through that address, and a
/// bi-directional decode leg on another wildcard engine names its own advertised host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_params_name_the_advertised_host_and_peers_reach_it_there() {
    timeout(Duration::from_secs(30), async {
        let p = start_engine(
            wildcard(Role::Prefill, Some("127.0.0.2")),
            PROFILE,
            1000.0,
            32,
        )
        .await;
        assert_eq!(p.advertised_host.as_deref(), Some("127.0.0.2"));
        let pp = p.p2p_addr.unwrap();
        assert!(pp.ip().is_unspecified(), "bound on all interfaces: {pp}");
        let mut dcfg = wildcard(Role::Decode, Some("127.0.0.3"));
        dcfg.p2p.bidirectional_kv_xfer = true;
        // Only the advertised address is a peer this decoder may pull from.
        dcfg.p2p.allowed_peers = vec!["127.0.0.2".into()];
        let d = start_engine(dcfg, PROFILE, 1000.0, 32).await;
        let prompt = tokens(3, 640);

        let pre = complete(local(p.addr), &prompt, 1, Some(prefill_leg())).await;
        let kvp = pre["kv_transfer_params"].clone();
        assert_eq!(kvp["remote_host"], json!("127.0.0.2"), "{kvp}");
        assert_eq!(kvp["remote_port"], json!(pp.port()));
        assert_eq!(
            kvp["remote_engine_id"],
            json!(format!("kvmesh-127.0.0.2:{}", pp.port()))
        );

        let got = complete(local(d.addr), &prompt, 20, Some(kvp)).await;
        let pulled = 639 / 16 * 16;
        assert_eq!(
            cached_tokens(&got),
            pulled as u64,
            "the decoder pulled through the advertised address"
        );
        let back = &got["kv_transfer_params"];
        assert_eq!(back["do_remote_decode"], json!(true), "{back}");
        assert_eq!(back["remote_host"], json!("127.0.0.3"), "{back}");
        assert_eq!(back["remote_port"], json!(d.p2p_addr.unwrap().port()));
        p.shutdown().await;
        d.shutdown().await;
    })
    .await
    .unwrap();
}

/// Peers admitted only on loopback share this host: loopback is then a true address.
#[tokio::test]
async fn a_wildcard_engine_serving_only_loopback_advertises_loopback() {
    let mut cfg = wildcard(Role::Prefill, None);
    cfg.p2p.secret = None;
    cfg.p2p.allowed_consumers = vec!["127.0.0.0/8".into()];
    let p = start_engine(cfg, PROFILE, 1000.0, 32).await;
    let pre = complete(local(p.addr), &tokens(4, 64), 1, Some(prefill_leg())).await;
    assert_eq!(pre["kv_transfer_params"]["remote_host"], json!("127.0.0.1"));
    p.shutdown().await;
}
