//! Tenants (vLLM's `cache_salt`) on sim engines over HTTP: a salted request shares cached blocks
//! only with requests of the same salt, its KV events name the salt as vLLM's do (so a router
//! keys them in the salt's space), and a P2P pull for another key space misses because the salt
//! is inside every block hash the producer serves by.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{
    PROFILE, TestServer, base_config, cached_tokens, p2p_config, send_completion, source,
    start_engine, tokens,
};
use kvmesh_core::{BlockHash, BlockHasher, HashAlgo, KvEvent, Medium, TenantKeys};
use serde_json::{Value, json};

const FAST: f64 = 1000.0;

/// Greedy completion of `prompt` with `cache_salt` (None: no salt field), optionally naming a
/// P2P source.
async fn complete_salted(
    addr: std::net::SocketAddr,
    prompt: &[u32],
    salt: Option<&str>,
    kvp: Option<Value>,
) -> Value {
    let mut body =
        json!({"model": "sim-test", "prompt": prompt, "max_tokens": 2, "temperature": 0});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    send_completion(addr, body, kvp).await
}

/// vLLM's event hashes of `prompt`'s full blocks under `salt` (seed "0", block 16: the test
/// engines' settings), from the hasher checked against vLLM's own digests.
fn vllm_hashes(prompt: &[u32], salt: Option<&str>) -> Vec<BlockHash> {
    let tenant = TenantKeys {
        lora: None,
        cache_salt: salt.map(str::to_owned),
    };
    BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 16)
        .hash_prompt_with(prompt, &tenant)
        .iter()
        .map(|d| d.event_hash())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_prompt_is_cached_only_for_its_own_salt() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let mut e = TestServer::start(base_config(), FAST).await;
        let prompt = tokens(3, 320); // 20 blocks; 19 may come from cache (not the last token's)
        let a = complete_salted(e.server.addr, &prompt, Some("tenant-a"), None).await;
        assert_eq!(cached_tokens(&a), 0);
        let again = complete_salted(e.server.addr, &prompt, Some("tenant-a"), None).await;
        assert_eq!(cached_tokens(&again), 304, "same tenant: a hit");
        let b = complete_salted(e.server.addr, &prompt, Some("tenant-b"), None).await;
        assert_eq!(cached_tokens(&b), 0, "another tenant: no hit");
        let plain = complete_salted(e.server.addr, &prompt, None, None).await;
        assert_eq!(
            cached_tokens(&plain),
            0,
            "unsalted: no hit on salted blocks"
        );
        let plain2 = complete_salted(e.server.addr, &prompt, None, None).await;
        assert_eq!(
            cached_tokens(&plain2),
            304,
            "unsalted requests hit as before"
        );
        assert_eq!(a["choices"][0]["text"], plain["choices"][0]["text"]);

        // The GPU events: one chain per key space, each starting with a run that names its
        // salt (none for the unsalted one), with vLLM's hashes for that salt.
        let events = e.drain_events(Duration::from_millis(400)).await;
        let roots: Vec<_> = events
            .iter()
            .filter_map(|(_, ev)| match ev {
                KvEvent::BlockStored(s)
                    if s.medium == Medium::Gpu && s.parent_block_hash.is_none() =>
                {
                    Some((s.cache_salt.clone(), s.block_hashes[0]))
                }
                _ => None,
            })
            .collect();
        for salt in [Some("tenant-a"), Some("tenant-b"), None] {
            let first = vllm_hashes(&prompt, salt)[0];
            assert!(
                roots.contains(&(salt.map(str::to_owned), first)),
                "no chain for {salt:?} starting at {first:?} in {roots:?}"
            );
        }
        // Later runs never name a salt: it is block 0's key only.
        assert!(events.iter().all(|(_, ev)| match ev {
            KvEvent::BlockStored(s) => s.parent_block_hash.is_none() || s.cache_salt.is_none(),
            _ => true,
        }));

        // An empty salt is refused, as vLLM refuses it.
        let (status, body) = e
            .post(
                "/v1/completions",
                json!({"model": "sim-test", "prompt": prompt, "max_tokens": 1, "cache_salt": ""}),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], "cache_salt");
        e.stop().await;
    })
    .await
    .expect("test timed out");
}

/// The producer serves blocks by hash, and the salt is inside every hash: a pull for another key
/// space asks for hashes the producer does not hold, so it misses and the consumer computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_never_crosses_key_spaces() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, FAST, 32).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let b = start_engine(p2p_config(), PROFILE, FAST, 32).await;
        let prompt = tokens(4, 320);
        // Only tenant-a's blocks exist on A.
        complete_salted(a.addr, &prompt, Some("tenant-a"), None).await;
        let external = |e: &kvmesh_engine::server::RunningServer| {
            e.engine
                .metrics()
                .p2p
                .blocks(kvmesh_transfer::Direction::In)
        };

        let plain = complete_salted(b.addr, &prompt, None, Some(source(a_p2p))).await;
        assert_eq!(
            cached_tokens(&plain),
            0,
            "unsalted pull of salted blocks: {plain}"
        );
        let other = complete_salted(b.addr, &prompt, Some("tenant-b"), Some(source(a_p2p))).await;
        assert_eq!(
            cached_tokens(&other),
            0,
            "tenant-b pull of tenant-a blocks: {other}"
        );
        assert_eq!(external(&b), 0, "no block crossed");
        assert!(b.engine.metrics().p2p.pulls_by_reason("miss") >= 2);
        assert_eq!(
            a.engine
                .metrics()
                .p2p
                .blocks(kvmesh_transfer::Direction::Out),
            0
        );

        // The same tenant pulls them.
        let same = complete_salted(b.addr, &prompt, Some("tenant-a"), Some(source(a_p2p))).await;
        assert_eq!(cached_tokens(&same), 304, "{same}");
        assert_eq!(external(&b), 19);
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}
