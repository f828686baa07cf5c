//! The compute loop's tests, through the handle as the HTTP layer uses it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::{BlockHash, KvEvent, Medium, TokenId};

use super::*;
use crate::compute::profiles::GPT_OSS_120B_H200;
use crate::compute::sim::{SimBackend, SimConfig, SimH2d};
use crate::config::EngineConfig;
use crate::cpu_tier::{OffloadBlock, PinKind};
use crate::outbox::CollectingSink;

fn engine(cfg: EngineConfig, sink: CollectingSink) -> Engine {
    // Restores charged to the step: without sleeping, a copy engine would make restores wait on
    // the wall clock most of these tests do not model.
    engine_with(cfg, sink, SimH2d::Step, 1.0)
}

fn engine_with(cfg: EngineConfig, sink: CollectingSink, h2d: SimH2d, time_scale: f64) -> Engine {
    let backend = SimBackend::without_sleep(SimConfig {
        profile: &GPT_OSS_120B_H200,
        time_scale,
        kv_bytes_per_token: 8,
        block_size: cfg.block_size,
        model_id: "sim".into(),
        // The ladder: these tests check the handle's off-thread copy of the profile's curve.
        link: crate::compute::sim_link::SimLink::Ladder,
        h2d,
    });
    build_engine(
        cfg,
        Box::new(backend),
        Arc::new(kvmesh_text::ByteTokenizer),
        Arc::new(sink),
    )
    .unwrap()
}

fn request(prompt: Vec<TokenId>, max_tokens: usize) -> EngineRequest {
    EngineRequest::greedy("t", prompt, max_tokens)
}

async fn run_to_end(mut s: SeqStream) -> (Option<usize>, Vec<TokenId>, FinishInfo) {
    let mut toks = Vec::new();
    loop {
        match s.recv().await.unwrap() {
            SeqOutput::Started { .. } => {}
            SeqOutput::Token(t) => toks.push(t),
            SeqOutput::Finished(f) => return (s.cached_tokens(), toks, *f),
            SeqOutput::Error(e) => panic!("{e}"),
        }
    }
}

#[tokio::test]
async fn modelled_pull_time_follows_the_profile_off_the_compute_thread() {
    let e = engine(
        EngineConfig {
            num_gpu_blocks: 64,
            ..EngineConfig::default()
        },
        CollectingSink::default(),
    );
    let d = e.handle.modelled_pull_time(49_152).unwrap();
    assert!((d.as_secs_f64() - 0.235).abs() < 1e-3, "{d:?}");
    let d = e.handle.modelled_pull_time(8192).unwrap();
    assert!((d.as_secs_f64() - 0.057).abs() < 1e-3, "{d:?}");
    assert_eq!(e.handle.modelled_pull_time(0), Some(Duration::ZERO));
    e.shutdown();
}

#[tokio::test]
async fn pulled_blocks_in_the_cpu_tier_count_as_external_hits() {
    let sink = CollectingSink::default();
    let e = engine(
        EngineConfig {
            num_gpu_blocks: 64,
            ..EngineConfig::default()
        },
        sink.clone(),
    );
    let prompt: Vec<TokenId> = (0..100).map(|i| i % 200).collect();
    let hashes = e.handle.block_hashes(&prompt);
    // A P2P consumer would land these from a peer; here they come from nowhere.
    for (i, h) in hashes.iter().enumerate().take(4) {
        let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
        let payload = crate::compute::sim::sim_block_payload(*h, 16 * 8);
        assert!(e.handle.cpu_tier().insert_external(
            *h,
            parent,
            prompt[i * 16..(i + 1) * 16].to_vec(),
            payload.into()
        ));
    }
    let mut req = request(prompt, 2);
    req.external_hashes = hashes[..4].to_vec();
    req.external_query_tokens = 100;
    let (cached, toks, fin) = run_to_end(e.handle.submit(req).unwrap()).await;
    assert_eq!(cached, Some(64));
    assert_eq!(fin.cached_tokens, 64);
    assert_eq!(toks.len(), 2);
    let m = e.handle.metrics().encode();
    assert!(
        m.contains("vllm:external_prefix_cache_hits_total{model_name=\"sim\",engine=\"0\"} 64"),
        "{m}"
    );
    assert!(
        m.contains("vllm:external_prefix_cache_queries_total{model_name=\"sim\",engine=\"0\"} 100"),
        "{m}"
    );
    assert!(
        m.contains("vllm:prefix_cache_hits_total{model_name=\"sim\",engine=\"0\"} 0"),
        "{m}"
    );
    // The pulled blocks were published on the CPU tier, then restored into the GPU tier.
    let ev = sink.take();
    let stored_cpu = ev
        .iter()
        .filter(|e| matches!(e, KvEvent::BlockStored(s) if s.medium == Medium::Cpu))
        .count();
    let stored_gpu: Vec<BlockHash> = ev
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) if s.medium == Medium::Gpu => Some(s.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(stored_cpu >= 4);
    assert_eq!(stored_gpu, hashes);
    // Both tiers describe their KV group as vLLM 0.32 does (capture2: group 0, full attention).
    for event in &ev {
        if let KvEvent::BlockStored(s) = event {
            assert_eq!(
                (s.group_idx, s.kv_cache_spec_kind.as_deref()),
                (Some(0), Some(kvmesh_core::events::FULL_ATTENTION)),
                "{s:?}"
            );
        }
    }
    e.shutdown();
}

#[tokio::test]
async fn pulled_tokens_count_as_external_once_whatever_the_order() {
    let e = engine(
        EngineConfig {
            num_gpu_blocks: 64,
            ..EngineConfig::default()
        },
        CollectingSink::default(),
    );
    let prompt: Vec<TokenId> = (0..100).map(|i| i % 200).collect();
    let hashes = e.handle.block_hashes(&prompt);
    let lease = Instant::now() + Duration::from_secs(60);
    for (i, h) in hashes.iter().enumerate().take(4) {
        let payload = crate::compute::sim::sim_block_payload(*h, 16 * 8);
        let landed = e.handle.cpu_tier().land(
            OffloadBlock {
                hash: *h,
                parent: i.checked_sub(1).map(|p| hashes[p]),
                tokens: prompt[i * 16..(i + 1) * 16].to_vec(),
                payload: payload.into(),
                cache_salt: None,
            },
            lease,
        );
        assert_eq!(landed, crate::cpu_tier::Landed::Pinned);
    }
    let metric = |name: &str| {
        let m = e.handle.metrics().encode();
        let key = format!("{name}{{model_name=\"sim\",engine=\"0\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
    };
    // A request routed here as a local hit uses the pulled blocks first: a local hit for
    // it (it did not cause the pull)...
    let (cached, _, _) = run_to_end(e.handle.submit(request(prompt.clone(), 1)).unwrap()).await;
    assert_eq!(cached, Some(64));
    assert_eq!(metric("vllm:external_prefix_cache_hits_total"), 0);
    assert_eq!(metric("vllm:prefix_cache_hits_total"), 64);
    // ...and the request that pulled them still counts them external, though they are now
    // a GPU-tier hit.
    let mut puller = request(prompt.clone(), 1);
    puller.external_hashes = hashes[..4].to_vec();
    let (cached, _, _) = run_to_end(e.handle.submit(puller).unwrap()).await;
    assert_eq!(cached, Some(96));
    assert_eq!(metric("vllm:external_prefix_cache_hits_total"), 64);
    // A request that waited on the same pull comes later: local, not counted twice.
    let mut waiter = request(prompt, 1);
    waiter.external_hashes = hashes[..4].to_vec();
    run_to_end(e.handle.submit(waiter).unwrap()).await;
    assert_eq!(metric("vllm:external_prefix_cache_hits_total"), 64);
    assert_eq!(metric("vllm:prefix_cache_hits_total"), 64 + 32 + 96);
    e.shutdown();
}

#[tokio::test]
async fn a_block_landed_unpinned_at_the_cap_leaves_other_requests_pull_pins_alone() {
    let e = engine(
        EngineConfig {
            num_gpu_blocks: 64,
            ..EngineConfig::default()
        },
        CollectingSink::default(),
    );
    let prompt: Vec<TokenId> = (0..32).map(|i| i % 200).collect();
    let hashes = e.handle.block_hashes(&prompt);
    let tier = e.handle.cpu_tier();
    // Pull pins hold their whole share: the block lands unpinned.
    tier.set_pull_pin_fraction(0.0);
    let landed = tier.land(
        OffloadBlock {
            hash: hashes[0],
            parent: None,
            tokens: prompt[..16].to_vec(),
            payload: crate::compute::sim::sim_block_payload(hashes[0], 16 * 8).into(),
            cache_salt: None,
        },
        Instant::now() + Duration::from_secs(60),
    );
    assert_eq!(landed, crate::cpu_tier::Landed::Unpinned);
    // A request that waited on that pull pins what landed until it is scheduled.
    let mut waiter = request(prompt.clone(), 1);
    let n = tier.pin(
        PinKind::Pull,
        &hashes[..1],
        Instant::now() + Duration::from_secs(60),
    );
    waiter.external_hashes = hashes[..n].to_vec();
    waiter.pull_pinned_hashes = hashes[..n].to_vec();
    // The puller finishes first: the block counts external for it, but the pin is not its own.
    let mut puller = request(prompt, 1);
    puller.external_hashes = hashes[..1].to_vec();
    crate::p2p::release_pulled(&e.handle, &puller);
    assert_eq!(tier.pin_count(hashes[0]), 1, "the waiter's pin survives");
    crate::p2p::release_pulled(&e.handle, &waiter);
    assert_eq!(tier.pin_count(hashes[0]), 0);
    e.shutdown();
}

#[tokio::test]
async fn chunked_prefill_marks_pending_and_completes_blocks_progressively() {
    let sink = CollectingSink::default();
    let cfg = EngineConfig {
        num_gpu_blocks: 64,
        max_num_batched_tokens: 32,
        ..EngineConfig::default()
    };
    let e = engine(cfg, sink);
    let prompt: Vec<TokenId> = (0..160).map(|i| (i * 3) % 250).collect();
    let hashes = e.handle.block_hashes(&prompt);
    let (cached, toks, fin) =
        run_to_end(e.handle.submit(request(prompt.clone(), 3)).unwrap()).await;
    assert_eq!(
        (cached, toks.len(), fin.reason),
        (Some(0), 3, FinishReason::Length)
    );
    assert_eq!(fin.created_cache_tokens, 160);
    for h in &hashes {
        assert!(e.handle.cpu_tier().contains(*h));
        assert!(!e.handle.cpu_tier().is_pending(*h));
    }
    // Greedy sim output is a function of position only: a repeat gives the same tokens.
    let (cached, toks2, _) = run_to_end(e.handle.submit(request(prompt, 3)).unwrap()).await;
    assert_eq!(cached, Some(144));
    assert_eq!(toks, toks2);
    let usage = e
        .handle
        .inspect_pool(|p| (p.usage(), p.check_invariants()))
        .await
        .unwrap();
    assert_eq!(usage.0, 0.0);
    usage.1.unwrap();
    e.shutdown();
}

/// Random mixes of shared-prefix prompts, tiny pools (preemption), chunking and aborts: every
/// kept request finishes with its full output and the pool ends empty and consistent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_workloads_finish_and_leave_a_consistent_pool() {
    use rand::{Rng, SeedableRng};
    let seed = std::env::var("KVMESH_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(11u64);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut preemptions = 0;
    for round in 0..4 {
        let cfg = EngineConfig {
            num_gpu_blocks: rng.random_range(24..64),
            max_num_batched_tokens: rng.random_range(16..300),
            max_num_seqs: rng.random_range(1..8),
            cpu_offload_bytes: rng.random_range(1_000..40_000),
            ..EngineConfig::default()
        };
        // Odd rounds overlap restores with compute (6 ms of wall time per 200 tokens), so
        // requests wait admitted for their blocks, get preempted while waiting, and share them.
        let e = if round % 2 == 1 {
            engine_with(
                cfg.clone(),
                CollectingSink::default(),
                SimH2d::Overlap,
                0.05,
            )
        } else {
            engine(cfg.clone(), CollectingSink::default())
        };
        let bases: Vec<Vec<TokenId>> = (0..3)
            .map(|b| (0..200).map(|i| (i * 7 + b * 13) % 250).collect())
            .collect();
        let mut tasks = Vec::new();
        for i in 0..30 {
            let base = &bases[rng.random_range(0..3)];
            let keep = rng.random_range(0..base.len());
            let mut prompt = base[..keep].to_vec();
            prompt.extend((0..rng.random_range(1..60)).map(|j| ((i * 31 + j) % 250) as TokenId));
            let max_tokens = rng.random_range(1..40);
            let abort = rng.random_bool(0.2);
            let stream = e.handle.submit(request(prompt, max_tokens)).unwrap();
            tasks.push(tokio::spawn(async move {
                if abort {
                    drop(stream);
                    return;
                }
                let (_, toks, fin) = run_to_end(stream).await;
                assert!(
                    fin.reason == FinishReason::Length,
                    "seed {seed} round {round}: {fin:?}"
                );
                // Every sequence fits the pool alone (≤ 300 tokens), so none is cut short.
                assert_eq!(
                    (toks.len(), fin.completion_tokens),
                    (max_tokens, max_tokens)
                );
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("request hung")
                .unwrap();
        }
        // Aborted streams are processed asynchronously; wait for the pool to drain.
        let t0 = Instant::now();
        loop {
            let (usage, ok) = e
                .handle
                .inspect_pool(|p| (p.usage(), p.check_invariants()))
                .await
                .unwrap();
            ok.unwrap_or_else(|err| panic!("seed {seed} round {round}: {err}"));
            if usage == 0.0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "blocks leaked: usage {usage}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let st = e.handle.cpu_tier().stats();
        assert!(st.used_bytes <= cfg.cpu_offload_bytes);
        preemptions += e.handle.metrics().num_preemptions.get();
        e.shutdown();
    }
    assert!(preemptions > 0, "the workload should exercise preemption");
}

/// `--sim-h2d overlap`: a request restoring a long prefix from the CPU tier waits, admitted, for
/// its copy; a request submitted right after it, needing nothing copied, is not held up by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_delays_only_the_request_that_needs_its_blocks() {
    let cfg = EngineConfig {
        num_gpu_blocks: 256,
        cpu_offload_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    // 1024 tokens x 73,728 B at 50 GB/s = 1.51 ms modelled, 302 ms of wall time at this scale.
    let e = engine_with(cfg, CollectingSink::default(), SimH2d::Overlap, 0.005);
    let history: Vec<TokenId> = (0..1024).map(|i| (i * 7 % 250) as TokenId).collect();
    let hashes = e.handle.block_hashes(&history);
    let blocks: Vec<OffloadBlock> = hashes
        .iter()
        .enumerate()
        .map(|(i, h)| OffloadBlock {
            hash: *h,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens: history[i * 16..(i + 1) * 16].to_vec(),
            payload: crate::compute::sim::sim_block_payload(*h, 16 * 8).into(),
            cache_salt: None,
        })
        .collect();
    assert_eq!(e.handle.cpu_tier().insert_run(&blocks), 64);

    let mut returning = history.clone();
    returning.extend([1, 2, 3]);
    let t0 = Instant::now();
    let restoring = e.handle.submit(request(returning, 1)).unwrap();
    let fresh = e.handle.submit(request(vec![9; 40], 1)).unwrap();
    let restored = tokio::spawn(async move {
        let out = run_to_end(restoring).await;
        (out, t0.elapsed())
    });
    let (_, _, fresh_fin) = run_to_end(fresh).await;
    let fresh_done = t0.elapsed();
    let ((cached, _, fin), restored_done) = restored.await.unwrap();
    assert_eq!((cached, fin.cached_tokens), (Some(1024), 1024));
    assert_eq!(fresh_fin.cached_tokens, 0);
    assert!(
        restored_done >= Duration::from_millis(295),
        "the restoring request ran before its copy landed: {restored_done:?}"
    );
    // Finished well before the other request's copy landed (~302 ms), not merely first.
    assert!(
        fresh_done + Duration::from_millis(150) < restored_done,
        "the fresh request waited for another request's copy: {fresh_done:?} vs {restored_done:?}"
    );
    let m = e.handle.metrics();
    assert_eq!(m.cpu_restored_blocks.get(), 64);
    assert!(m.cpu_restore_wait_seconds.get() > 0.25);
    let copy_s = m.cpu_restore_modelled_seconds.get();
    assert!((copy_s - 1024.0 * 73_728.0 / 50e9).abs() < 1e-9, "{copy_s}");
    e.shutdown();
}
