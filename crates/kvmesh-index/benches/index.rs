//! Prefix-index benchmarks: ingestion rate, lookup latency (criterion), then a report with lookup
//! percentiles, bytes allocated per lookup and bytes per membership at 10 M memberships (measured
//! with a counting global allocator).
//!
//! `cargo bench -p kvmesh-index --bench index` (the report runs only under `--bench`; set
//! `KVMESH_INDEX_BENCH_SKIP_MEMORY=1` to skip the 10 M-membership builds,
//! `KVMESH_INDEX_BENCH_SKIP_LOOKUP=1` to skip the lookup percentiles, and
//! `KVMESH_INDEX_BENCH_MEMBERSHIPS=6000000,12600000` to measure memory at other sizes: tables
//! grow in steps, so bytes per membership varies along the growth cycle).

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::alloc::System;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvmesh_core::chain::chain_keys;
use kvmesh_core::events::{BlockRemoved, BlockStored, KvEvent, Medium};
use kvmesh_core::{BlockHash, ChainKey};
use kvmesh_index::{EndpointId, IndexConfig, PrefixIndex};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn store(
    hashes: Vec<u64>,
    parent: Option<u64>,
    tokens: Vec<u32>,
    bs: u32,
    medium: Medium,
) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.into_iter().map(BlockHash).collect(),
        parent_block_hash: parent.map(BlockHash),
        token_ids: tokens,
        block_size: bs,
        lora_id: None,
        medium,
        lora_name: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        cache_salt: None,
    })
}

fn remove(hashes: &[u64], medium: Medium) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| BlockHash(*h)).collect(),
        medium,
        group_idx: None,
    })
}

fn tokens(rng: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..128_000)).collect()
}

/// Stores `n_blocks` fresh blocks of `bs` tokens on `endpoint` in events of `per_event` blocks.
fn fill(
    index: &PrefixIndex,
    rng: &mut ChaCha8Rng,
    endpoint: EndpointId,
    n_blocks: usize,
    per_event: usize,
    bs: usize,
) {
    let mut left = n_blocks;
    while left > 0 {
        let n = left.min(per_event);
        let hashes: Vec<u64> = (0..n).map(|_| rng.random()).collect();
        index
            .apply_event(
                endpoint,
                &store(hashes, None, tokens(rng, n * bs), bs as u32, Medium::Gpu),
            )
            .unwrap();
        left -= n;
    }
}

/// Ingestion: steady state of store + remove of 64-block runs (block 16) on a 1 M-block index.
fn bench_ingest(c: &mut Criterion) {
    const BS: usize = 16;
    const RUN: usize = 64;
    let index = PrefixIndex::new(IndexConfig {
        block_size: BS,
        max_blocks: 4_000_000,
        ..IndexConfig::default()
    });
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for e in 0..8 {
        fill(&index, &mut rng, EndpointId(e), 125_000, 256, BS);
    }
    let events: Vec<(KvEvent, KvEvent)> = (0..512)
        .map(|_| {
            let hashes: Vec<u64> = (0..RUN).map(|_| rng.random()).collect();
            let rm = remove(&hashes, Medium::Gpu);
            (
                store(
                    hashes,
                    None,
                    tokens(&mut rng, RUN * BS),
                    BS as u32,
                    Medium::Gpu,
                ),
                rm,
            )
        })
        .collect();
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(2 * RUN as u64));
    let mut i = 0usize;
    g.bench_function("store+remove 64 blocks (block 16)", |b| {
        b.iter(|| {
            let (s, r) = &events[i % events.len()];
            let ep = EndpointId((i % 8) as u32);
            index.apply_event(ep, s).unwrap();
            index.apply_event(ep, r).unwrap();
            i += 1;
        })
    });
    g.finish();
}

/// A warm index for the lookup benchmark: 96 endpoints, each holding a prefix of one 240K-token
/// prompt (block 64 → 3,750 keys) in GPU, every other one also in CPU, over ~1 M background blocks.
/// `full`: every endpoint holds the whole prompt (no early exit: the worst case).
struct LookupSetup {
    index: PrefixIndex,
    tokens: Vec<u32>,
    keys: Vec<ChainKey>,
}

fn lookup_setup(full: bool) -> LookupSetup {
    const BS: usize = 64;
    let index = PrefixIndex::new(IndexConfig {
        block_size: BS,
        max_blocks: 4_000_000,
        ..IndexConfig::default()
    });
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let prompt = tokens(&mut rng, 240_000);
    let keys = chain_keys(&prompt, BS);
    let hashes: Vec<u64> = (0..keys.len()).map(|i| 0x1000 + i as u64).collect();
    for e in 0..96u32 {
        let n = if full {
            keys.len()
        } else {
            keys.len() / 2 + rng.random_range(0..=keys.len() / 2)
        };
        let mut parent = None;
        for chunk in (0..n).collect::<Vec<_>>().chunks(256) {
            let (a, b) = (chunk[0], chunk[chunk.len() - 1] + 1);
            let ev = store(
                hashes[a..b].to_vec(),
                parent,
                prompt[a * BS..b * BS].to_vec(),
                BS as u32,
                Medium::Gpu,
            );
            index.apply_event(EndpointId(e), &ev).unwrap();
            parent = Some(hashes[b - 1]);
        }
        if e % 2 == 0 {
            index
                .apply_event(
                    EndpointId(e),
                    &store(hashes[..n].to_vec(), None, Vec::new(), 0, Medium::Cpu),
                )
                .unwrap();
        }
        fill(&index, &mut rng, EndpointId(e), 10_000, 256, BS);
    }
    LookupSetup {
        index,
        tokens: prompt,
        keys,
    }
}

fn bench_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("lookup 240K tokens, block 64, 96 endpoints");
    g.sample_size(50).measurement_time(Duration::from_secs(5));
    for full in [false, true] {
        let s = lookup_setup(full);
        let name = if full {
            "find_matches (all hold full prefix)"
        } else {
            "find_matches (prefixes 50-100%)"
        };
        g.bench_function(name, |b| {
            b.iter(|| black_box(s.index.find_matches(black_box(&s.keys))))
        });
        if !full {
            g.bench_function("chain_keys (router-side hashing of the prompt)", |b| {
                b.iter(|| black_box(chain_keys(black_box(&s.tokens), 64)))
            });
        }
    }
    g.finish();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report_lookup() {
    for full in [false, true] {
        let s = lookup_setup(full);
        for _ in 0..50 {
            black_box(s.index.find_matches(&s.keys));
        }
        let mut times = Vec::with_capacity(2000);
        let mut bytes = 0usize;
        let mut allocs = 0usize;
        let n = 2000;
        for _ in 0..n {
            let region = Region::new(GLOBAL);
            let t = Instant::now();
            let m = black_box(s.index.find_matches(&s.keys));
            times.push(t.elapsed());
            let st = region.change();
            bytes = bytes.max(st.bytes_allocated);
            allocs = allocs.max(st.allocations);
            assert_eq!(m.len(), 96);
        }
        times.sort();
        println!(
            "REPORT lookup full={full}: keys={} p50={:?} p99={:?} p999={:?} max={:?}; max bytes allocated per lookup={} in {} allocations",
            s.keys.len(),
            percentile(&times, 0.5),
            percentile(&times, 0.99),
            percentile(&times, 0.999),
            times[times.len() - 1],
            bytes,
            allocs
        );
        // Lookups while another thread ingests into the same index, and (baseline) while it
        // ingests into a separate index: the difference is lock interference, the rest is CPU
        // contention.
        let other = PrefixIndex::new(IndexConfig {
            block_size: 64,
            ..IndexConfig::default()
        });
        for (label, target) in [
            ("a writer on another index (CPU contention only)", &other),
            ("a concurrent writer", &s.index),
        ] {
            let stop = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    // Steady state: store and remove 64-block runs (block 64) from a pool of
                    // 256 distinct runs, so the table neither grows nor evicts.
                    let mut rng = ChaCha8Rng::seed_from_u64(9);
                    let runs: Vec<(KvEvent, KvEvent)> = (0..256u64)
                        .map(|r| {
                            let hashes: Vec<u64> = (0..64).map(|i| (r << 32) | i).collect();
                            let rm = remove(&hashes, Medium::Gpu);
                            (
                                store(hashes, None, tokens(&mut rng, 64 * 64), 64, Medium::Gpu),
                                rm,
                            )
                        })
                        .collect();
                    let mut i = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let (st, rm) = &runs[i % runs.len()];
                        target.apply_event(EndpointId(200), st).unwrap();
                        target.apply_event(EndpointId(200), rm).unwrap();
                        i += 1;
                    }
                });
                let mut times = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    black_box(s.index.find_matches(&s.keys));
                    times.push(t.elapsed());
                }
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                times.sort();
                println!(
                    "REPORT lookup full={full} with {label}: p50={:?} p99={:?} max={:?}",
                    percentile(&times, 0.5),
                    percentile(&times, 0.99),
                    times[times.len() - 1]
                );
            });
        }
    }
}

/// Builds 10 M memberships and reports allocator-measured and self-reported bytes per membership.
/// `sharing` endpoints hold each block (1 = worst case, every block on one endpoint).
fn report_memory(sharing: usize, target: usize) {
    const BS: usize = 16;
    let region = Region::new(GLOBAL);
    let index = PrefixIndex::new(IndexConfig {
        block_size: BS,
        max_blocks: 16_000_000,
        ..IndexConfig::default()
    });
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let t = Instant::now();
    let mut events = 0usize;
    let mut prompt_id = 0u64;
    while index.stats().memberships < target as u64 {
        // One 1,000-block prompt stored (in 100-block events) on `sharing` endpoints.
        let prompt = tokens(&mut rng, 1000 * BS);
        let hashes: Vec<u64> = (0..1000).map(|i| (prompt_id << 20) | i).collect();
        prompt_id += 1;
        for _ in 0..sharing {
            let ep = EndpointId(rng.random_range(0..96));
            let mut parent = None;
            for a in (0..1000).step_by(100) {
                let ev = store(
                    hashes[a..a + 100].to_vec(),
                    parent,
                    prompt[a * BS..(a + 100) * BS].to_vec(),
                    BS as u32,
                    Medium::Gpu,
                );
                index.apply_event(ep, &ev).unwrap();
                parent = Some(hashes[a + 99]);
                events += 100;
            }
        }
    }
    let elapsed = t.elapsed();
    let st = region.change();
    let live = st.bytes_allocated as i64 - st.bytes_deallocated as i64;
    let stats = index.stats();
    println!(
        "REPORT memory sharing={sharing} target={target}: blocks={} memberships={} live bytes (allocator)={} -> {:.1} B/membership; index approx_bytes -> {:.1} B/membership; build {:.2} M block-events/s",
        stats.blocks,
        stats.memberships,
        live,
        live as f64 / stats.memberships as f64,
        stats.bytes_per_membership,
        events as f64 / elapsed.as_secs_f64() / 1e6
    );
    drop(index);
}

fn main() {
    if std::env::var_os("KVMESH_INDEX_BENCH_REPORT_ONLY").is_none() {
        let mut c = Criterion::default().configure_from_args();
        bench_ingest(&mut c);
        bench_lookup(&mut c);
        c.final_summary();
    }
    if std::env::args().any(|a| a == "--bench") {
        if std::env::var_os("KVMESH_INDEX_BENCH_SKIP_LOOKUP").is_none() {
            report_lookup();
        }
        if std::env::var_os("KVMESH_INDEX_BENCH_SKIP_MEMORY").is_none() {
            let targets = std::env::var("KVMESH_INDEX_BENCH_MEMBERSHIPS")
                .unwrap_or_else(|_| "10000000".into());
            for target in targets.split(',').filter_map(|t| t.trim().parse().ok()) {
                report_memory(4, target);
                report_memory(1, target);
            }
        }
    }
}
