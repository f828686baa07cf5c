//! P2P pull throughput against the loopback TCP limit, in one run.
//!
//! `cargo run --release -p kvmesh-transfer --example p2p_bench [-- --bytes-per-token N --block-tokens N --runs N --secret 0|1]`
//!
//! `--secret 1` authenticates both ends with a shared secret, so every frame is MACed (the cost
//! of the authenticated mesh).
//!
//! 1. limit: a plain tokio socket moves the same total bytes as a 48K-token prefix, written in
//!    block-sized `write_all`s and read into one reused buffer;
//! 2. pull: a `ProducerServer` over an in-memory source serves the 48K-token prefix (768 blocks of
//!    64 tokens × 40 KiB/token ≈ 2.6 MB; a handful of payload buffers are shared via `Bytes`
//!    clones so memory stays bounded) to a `PullClient` whose sink counts and drops the blocks;
//! 3. pull latency vs prefix length, 2K…48K tokens, on a warm (pooled) connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_core::{BlockHash, Fingerprint, HashAlgo};
use kvmesh_transfer::{
    AllowList, BlockSink, ClientConfig, MemorySource, ProducerServer, PullClient, PullOutcome,
    ServerConfig, SinkError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

struct Args {
    bytes_per_token: usize,
    block_tokens: usize,
    prefix_tokens: usize,
    runs: usize,
    secret: bool,
}

fn args() -> Args {
    let mut a = Args {
        bytes_per_token: 40 * 1024,
        block_tokens: 64,
        prefix_tokens: 48 * 1024,
        runs: 3,
        secret: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let v = pair
            .get(1)
            .and_then(|v| v.parse().ok())
            .expect("flag value");
        match pair[0].as_str() {
            "--bytes-per-token" => a.bytes_per_token = v,
            "--block-tokens" => a.block_tokens = v,
            "--prefix-tokens" => a.prefix_tokens = v,
            "--runs" => a.runs = v,
            "--secret" => a.secret = v != 0,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn fp() -> Fingerprint {
    Fingerprint {
        model_id: "bench".into(),
        kv_dtype: "sim".into(),
        block_size: 64,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 1,
        hash_algo: HashAlgo::Sha256Cbor,
        none_hash: "00".into(),
    }
}

/// Counts and drops blocks (the copy into a cache is the engine's cost, not the transfer's).
#[derive(Default)]
struct CountingSink {
    blocks: usize,
    bytes: u64,
}

impl BlockSink for CountingSink {
    fn accept(&mut self, _index: usize, _hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        self.blocks += 1;
        self.bytes += payload.len() as u64;
        Ok(())
    }
}

/// CPU seconds (user + system, all threads) this process has used, from /proc (10 ms ticks).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Plain socket: `blocks` writes of `block_bytes` each, reader drains into one reused buffer.
async fn plain_socket(blocks: usize, block_bytes: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let payload = vec![0x5au8; block_bytes];
    let writer = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.set_nodelay(true).unwrap();
        for _ in 0..blocks {
            s.write_all(&payload).await.unwrap();
        }
    });
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut buf = vec![0u8; block_bytes];
    let total = (blocks * block_bytes) as u64;
    let mut got = 0u64;
    while got < total {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "writer closed early");
        got += n as u64;
    }
    let d = start.elapsed();
    writer.await.unwrap();
    d
}

async fn timed_pull(
    client: &PullClient,
    addr: SocketAddr,
    hashes: &[BlockHash],
) -> (Duration, u64) {
    let mut sink = CountingSink::default();
    let report = client.pull(addr, "bench", hashes, &mut sink).await;
    assert_eq!(report.outcome, PullOutcome::Complete, "{report:?}");
    (report.duration, report.bytes)
}

fn main() {
    let a = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(a));
}

async fn run(a: Args) {
    let block_bytes = a.bytes_per_token * a.block_tokens;
    let blocks = a.prefix_tokens / a.block_tokens;
    let total = (blocks * block_bytes) as u64;
    let secret = a.secret.then(|| kvmesh_transfer::Secret::from("bench"));
    println!("frames MACed (shared secret): {}", a.secret);
    println!(
        "prefix {} tokens = {blocks} blocks × {block_bytes} B ({} tokens × {} B/token); total {:.3} GB",
        a.prefix_tokens,
        a.block_tokens,
        a.bytes_per_token,
        total as f64 / 1e9
    );

    // Checksum cost alone (one core), for reading the ratio below.
    let probe = vec![7u8; block_bytes];
    let t = Instant::now();
    let mut acc = 0u32;
    for _ in 0..64 {
        acc ^= crc32fast::hash(&probe);
    }
    let crc_d = t.elapsed();
    println!(
        "crc32 (one core): {:.1} GB/s [{acc:x}]",
        gbps(64 * block_bytes as u64, crc_d)
    );

    // Source: every hash maps to one of 4 shared payload buffers.
    let source = MemorySource::new(fp());
    let distinct: Vec<Bytes> = (0..4u8)
        .map(|i| Bytes::from(vec![i.wrapping_mul(37); block_bytes]))
        .collect();
    let hashes: Vec<BlockHash> = (0..blocks as u64).map(|i| BlockHash(0xb000 + i)).collect();
    for (i, h) in hashes.iter().enumerate() {
        source.insert(*h, distinct[i % distinct.len()].clone());
    }
    let cancel = CancellationToken::new();
    let (addr, server) = ProducerServer::bind(
        "127.0.0.1:0",
        Arc::new(source),
        ServerConfig {
            max_frame: block_bytes + 1024,
            secret: secret.clone(),
            ..ServerConfig::default()
        },
        cancel.clone(),
    )
    .await
    .unwrap();
    let mut allowed = AllowList::none();
    allowed.add_socket(addr);
    let client = PullClient::new(
        fp(),
        ClientConfig {
            allowed_peers: allowed,
            max_frame: block_bytes + 1024,
            timeout: Duration::from_secs(30),
            secret: secret.clone(),
            ..ClientConfig::default()
        },
    );
    // Warm the connection pool and the allocator.
    timed_pull(&client, addr, &hashes[..8]).await;

    let mut limit = Vec::new();
    let mut pull = Vec::new();
    let (mut cpu_limit, mut cpu_pull) = (0.0, 0.0);
    println!("load average before: {}", loadavg());
    for _ in 0..a.runs {
        let c0 = cpu_seconds();
        limit.push(plain_socket(blocks, block_bytes).await);
        let c1 = cpu_seconds();
        let (d, bytes) = timed_pull(&client, addr, &hashes).await;
        cpu_pull += cpu_seconds() - c1;
        cpu_limit += c1 - c0;
        assert_eq!(bytes, total);
        pull.push(d);
    }
    println!("load average after: {}", loadavg());
    // Each iteration runs the two back to back, so their ratio sees the same machine load.
    let mut paired: Vec<f64> = limit
        .iter()
        .zip(&pull)
        .map(|(l, p)| l.as_secs_f64() / p.as_secs_f64())
        .collect();
    paired.sort_by(f64::total_cmp);
    let (lim, pl) = (median(limit.clone()), median(pull.clone()));
    let best_lim = *limit.iter().min().unwrap();
    let best_pull = *pull.iter().min().unwrap();
    println!(
        "plain socket : median {:>8.1} ms  {:.2} GB/s   (best {:.2} GB/s)",
        lim.as_secs_f64() * 1e3,
        gbps(total, lim),
        gbps(total, best_lim)
    );
    println!(
        "p2p pull     : median {:>8.1} ms  {:.2} GB/s   (best {:.2} GB/s)",
        pl.as_secs_f64() * 1e3,
        gbps(total, pl),
        gbps(total, best_pull)
    );
    println!(
        "pull/limit ratio: {:.2} (median/median), {:.2} (best/best); target >= 0.8",
        lim.as_secs_f64() / pl.as_secs_f64(),
        best_lim.as_secs_f64() / best_pull.as_secs_f64()
    );
    println!(
        "pull/limit per iteration (sorted): {}; median {:.2}",
        paired
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
        paired[paired.len() / 2]
    );

    let moved = a.runs as f64 * total as f64 / 1e9;
    println!(
        "CPU cost (both ends, this process): plain {:.0} ms/GB, pull {:.0} ms/GB ({:.2}x)",
        cpu_limit / moved * 1e3,
        cpu_pull / moved * 1e3,
        cpu_pull / cpu_limit
    );

    println!(
        "\npull latency vs prefix length (warm connection, median of {} runs):",
        a.runs
    );
    println!(
        "{:>8} {:>7} {:>10} {:>10} {:>8}",
        "tokens", "blocks", "MB", "ms", "GB/s"
    );
    for tokens in [2048usize, 4096, 8192, 16384, 32768, 49152] {
        let n = (tokens / a.block_tokens).min(blocks);
        let mut ds = Vec::new();
        let mut bytes = 0;
        for _ in 0..a.runs {
            let (d, b) = timed_pull(&client, addr, &hashes[..n]).await;
            ds.push(d);
            bytes = b;
        }
        let d = median(ds);
        println!(
            "{tokens:>8} {n:>7} {:>10.1} {:>10.1} {:>8.2}",
            bytes as f64 / 1e6,
            d.as_secs_f64() * 1e3,
            gbps(bytes, d)
        );
    }
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
}
