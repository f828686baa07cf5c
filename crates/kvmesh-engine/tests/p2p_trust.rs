//! Who may do what to an engine's P2P producer, through the engine's own config and server:
//! blocks a prefiller retains for its decoder are released only by a read under that decoder's
//! request id (another peer reading them leaves them held); an engine whose producer would bind
//! beyond loopback without a secret or a consumer allow-list does not start; with a secret the
//! whole P/D hand-off runs over MACed frames.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{PROFILE, complete_ignore_eos as complete, p2p_config, prefill_leg, tokens};
use common::{start_engine, try_start_engine};
use kvmesh_core::BlockHash;
use kvmesh_engine::server::{RunningServer, ServerError};
use kvmesh_engine::{EngineConfig, Role};
use kvmesh_transfer::{AllowList, ClientConfig, PullClient, PullOutcome, Secret, VecSink};
use tokio::time::{Instant, timeout};

fn prefiller(secret: Option<&str>) -> EngineConfig {
    let mut cfg = p2p_config();
    cfg.p2p.role = Role::Prefill;
    cfg.p2p.secret = secret.map(Secret::from);
    cfg
}

/// The prefill leg's retained block ids and request id.
async fn prefill(p: &RunningServer) -> (Vec<BlockHash>, String) {
    let pre = complete(p.addr, &tokens(7, 640), 1, Some(prefill_leg())).await;
    let kvp = &pre["kv_transfer_params"];
    let ids = kvp["remote_block_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| BlockHash(v.as_u64().unwrap()))
        .collect();
    (ids, kvp["remote_request_id"].as_str().unwrap().to_owned())
}

fn reader(p: &RunningServer, secret: Option<&str>) -> PullClient {
    let mut allowed = AllowList::none();
    allowed.add_socket(p.p2p_addr.unwrap());
    PullClient::new(
        p.engine.fingerprint(),
        ClientConfig {
            allowed_peers: allowed,
            secret: secret.map(Secret::from),
            ..ClientConfig::default()
        },
    )
}

async fn held(p: &RunningServer, ids: &[BlockHash]) -> usize {
    ids.iter()
        .filter(|h| p.engine.cpu_tier().pin_count(**h) > 0)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_is_released_only_by_the_request_it_was_kept_for() {
    timeout(Duration::from_secs(30), async {
        let p = start_engine(prefiller(None), PROFILE, 1000.0, 32).await;
        let (ids, request_id) = prefill(&p).await;
        assert_eq!(held(&p, &ids).await, ids.len(), "retained for the decoder");
        let client = reader(&p, None);
        // Another peer reads every retained block under its own request id: nothing is freed.
        let mut sink = VecSink::default();
        let report = client
            .pull(p.p2p_addr.unwrap(), "not-the-decoder", &ids, &mut sink)
            .await;
        assert_eq!(report.outcome, PullOutcome::Complete);
        assert_eq!(held(&p, &ids).await, ids.len(), "still retained");
        // The decoder's read (its `remote_request_id`) releases them.
        let mut sink = VecSink::default();
        let report = client
            .pull(p.p2p_addr.unwrap(), &request_id, &ids, &mut sink)
            .await;
        assert_eq!(report.outcome, PullOutcome::Complete);
        let start = Instant::now();
        while held(&p, &ids).await > 0 {
            assert!(start.elapsed() < Duration::from_secs(5), "not released");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        p.shutdown().await;
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_the_hand_off_runs_over_authenticated_frames() {
    timeout(Duration::from_secs(30), async {
        let p = start_engine(prefiller(Some("fleet-secret")), PROFILE, 1000.0, 32).await;
        let (ids, request_id) = prefill(&p).await;
        let wrong = reader(&p, Some("guess"));
        let mut sink = VecSink::default();
        let report = wrong
            .pull(p.p2p_addr.unwrap(), &request_id, &ids, &mut sink)
            .await;
        assert!(matches!(report.outcome, PullOutcome::Failed { .. }));
        assert_eq!(
            held(&p, &ids).await,
            ids.len(),
            "a refused peer frees nothing"
        );
        let right = reader(&p, Some("fleet-secret"));
        let mut sink = VecSink::default();
        let report = right
            .pull(p.p2p_addr.unwrap(), &request_id, &ids, &mut sink)
            .await;
        assert_eq!(report.outcome, PullOutcome::Complete);
        assert_eq!(sink.blocks.len(), ids.len());
        assert_eq!(p.engine.metrics().p2p.refused("auth_failed"), 1);
        assert_eq!(p.engine.metrics().p2p.refused("mac_failed"), 0);
        p.shutdown().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn an_engine_whose_producer_would_serve_any_host_does_not_start() {
    let mut cfg = p2p_config();
    cfg.host = "0.0.0.0".into();
    cfg.port = 0;
    let Err(err) = try_start_engine(cfg.clone(), PROFILE, 1000.0, 32).await else {
        panic!("an unprotected producer on 0.0.0.0 started")
    };
    assert!(matches!(err, ServerError::Config(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("--p2p-secret-file") && msg.contains("--p2p-allowed-consumers"),
        "{msg}"
    );
    // An allow-list is enough.
    cfg.p2p.allowed_consumers = vec!["127.0.0.0/8".into()];
    let ok = start_engine(cfg, PROFILE, 1000.0, 32).await;
    ok.shutdown().await;
}
