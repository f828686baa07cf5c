//! KV-event decode throughput: events/s and block-hashes/s on realistic batches.
//!
//! `cargo bench -p kvmesh-core --bench event_decode -- --quick`
//!
//! - `synthetic_map` / `synthetic_array`: one batch of 16 `BlockStored`, each 4 blocks × 16 tokens
//!   (a busy engine step), in vLLM's map form and the older array form;
//! - `capture2` / `capture3`: every payload vLLM 0.32 published in the fixtures;
//! - `rmpv_tree_map`: the same synthetic batch parsed into an `rmpv::Value` tree, as a baseline
//!   for what a generic decoder costs.

use std::hint::black_box;
use std::path::PathBuf;

use base64::Engine as _;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvmesh_core::events::{
    BlockStored, EventBatch, EventEncoding, KvEvent, Medium, decode_batch, encode_batch,
};
use kvmesh_core::hashing::BlockHash;

fn synthetic() -> EventBatch {
    let events = (0..16u64)
        .map(|i| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: (0..4)
                    .map(|b| BlockHash(0x9e37_79b9_7f4a_7c15 ^ (i * 4 + b)))
                    .collect(),
                parent_block_hash: Some(BlockHash(0xdead_beef_0000_0000 | i)),
                token_ids: (0..64).map(|t| (i as u32 * 64 + t) % 4096 + 256).collect(),
                block_size: 16,
                lora_id: None,
                medium: Medium::Gpu,
                lora_name: None,
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                kv_cache_spec_sliding_window: None,
                cache_salt: None,
            })
        })
        .collect();
    EventBatch {
        ts: 1_764_450_000.25,
        events,
        data_parallel_rank: Some(0),
    }
}

fn capture(name: &str) -> Vec<Vec<u8>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm")
        .join(name);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => panic!("read {}: {e}", path.display()),
    };
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    json["frames"]
        .as_array()
        .map(|frames| {
            frames
                .iter()
                .filter_map(|f| f["payload_b64"].as_str())
                .filter_map(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// (events, block hashes) in a set of payloads.
fn count(payloads: &[Vec<u8>]) -> (u64, u64) {
    payloads
        .iter()
        .filter_map(|p| decode_batch(p).ok())
        .fold((0, 0), |(e, h), b| {
            let hashes: usize = b
                .events
                .iter()
                .map(|ev| match ev {
                    KvEvent::BlockStored(s) => s.block_hashes.len(),
                    KvEvent::BlockRemoved(r) => r.block_hashes.len(),
                    KvEvent::AllBlocksCleared => 0,
                })
                .sum();
            (e + b.events.len() as u64, h + hashes as u64)
        })
}

fn bench_set(c: &mut Criterion, name: &str, payloads: &[Vec<u8>]) {
    let (events, hashes) = count(payloads);
    let bytes: usize = payloads.iter().map(Vec::len).sum();
    for (unit, n) in [("events", events), ("block_hashes", hashes)] {
        let mut g = c.benchmark_group(format!("decode_{unit}"));
        g.throughput(Throughput::Elements(n));
        g.bench_function(
            format!("{name} ({} payloads, {bytes} B)", payloads.len()),
            |b| {
                b.iter(|| {
                    for p in payloads {
                        let _ = black_box(decode_batch(black_box(p)));
                    }
                })
            },
        );
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    let batch = synthetic();
    bench_set(
        c,
        "synthetic_map",
        &[encode_batch(&batch, EventEncoding::Map)],
    );
    bench_set(
        c,
        "synthetic_array",
        &[encode_batch(&batch, EventEncoding::Array)],
    );
    bench_set(c, "capture2", &capture("capture2.json"));
    bench_set(c, "capture3", &capture("capture3.json"));

    let map = encode_batch(&batch, EventEncoding::Map);
    let mut g = c.benchmark_group("decode_events");
    g.throughput(Throughput::Elements(batch.events.len() as u64));
    g.bench_function("rmpv_tree_map (baseline, no typed events)", |b| {
        b.iter(|| {
            let _ = black_box(rmpv::decode::read_value(&mut black_box(map.as_slice())));
        })
    });
    g.finish();

    let mut g = c.benchmark_group("encode_events");
    g.throughput(Throughput::Elements(batch.events.len() as u64));
    let mut buf = Vec::with_capacity(map.len());
    g.bench_function("synthetic_map", |b| {
        b.iter(|| {
            buf.clear();
            kvmesh_core::events::encode_batch_into(black_box(&batch), EventEncoding::Map, &mut buf);
            black_box(buf.len())
        })
    });
    g.finish();
}

criterion_group!(event_decode, benches);
criterion_main!(event_decode);
