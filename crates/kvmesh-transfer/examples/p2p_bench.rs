//! P2P pull throughput and CPU cost, every mode back to back against the best a plain socket does
//! on this machine (the numbers of `docs/protocols.md#throughput-and-cpu-cost`).
//!
//! `cargo run --release -p kvmesh-transfer --example p2p_bench [-- --runs N --bytes-per-token N
//! --block-tokens N --prefix-tokens N --latency 0|1]`
//!
//! The producer and the consumer each run on a tokio runtime of their own (two worker threads
//! each), so the CPU time of each end is the sum over its threads (`/proc/self/task/*/schedstat`,
//! nanoseconds; the kernel's TCP work is charged to the thread that makes the system call). Each
//! iteration runs, back to back on the same machine load:
//! 1. `limit`: a plain tokio socket moves the same bytes as the prefix: the writer hands the
//!    kernel every block's buffer in `writev`s of 64 blocks, the reader reads into one reused
//!    1 MiB buffer — what a socket does with no protocol at all;
//! 2. `clear`: a `PullClient` pulls the 48K-token prefix (768 blocks of 64 tokens × 40 KiB =
//!    2.6 MB; four payload buffers shared through `Bytes` clones, so memory stays bounded) from a
//!    `ProducerServer` with no secret, into a sink that hands out its own memory
//!    (`BlockSink::destination`: a ring of four block buffers, as a KV cache's slots would be);
//! 3. `authenticated`: the same with a shared secret (AES-256-GMAC tags, the default beyond
//!    loopback); 4. `encrypted`: with a secret and `encrypt` on both ends (AES-256-GCM);
//! 5. `auth ×2`, `auth ×4`: the authenticated pull striped over 2 and 4 connections.
//!
//! Reported per mode: median wall time and GB/s, ratios against the limit and the clear pull
//! (median of the per-iteration ratios, so both sides of a ratio saw the same load), CPU per GB
//! (both ends), core-seconds per GB of each end, and the cores one end would need to fill 100 GbE
//! (12.5 GB/s) and 400 GbE (50 GB/s) at that cost. Then the targets, met or not.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_core::{BlockHash, Fingerprint, HashAlgo};
use kvmesh_transfer::{
    AllowList, BlockSink, ClientConfig, MemorySource, ProducerServer, PullClient, PullOutcome,
    Secret, ServerConfig, SinkError,
};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

struct Args {
    bytes_per_token: usize,
    block_tokens: usize,
    prefix_tokens: usize,
    runs: usize,
    latency: bool,
}

fn args() -> Args {
    let mut a = Args {
        bytes_per_token: 40 * 1024,
        block_tokens: 64,
        prefix_tokens: 48 * 1024,
        runs: 5,
        latency: true,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let v: usize = pair
            .get(1)
            .and_then(|v| v.parse().ok())
            .expect("flag value");
        match pair[0].as_str() {
            "--bytes-per-token" => a.bytes_per_token = v,
            "--block-tokens" => a.block_tokens = v,
            "--prefix-tokens" => a.prefix_tokens = v,
            "--runs" => a.runs = v.max(1),
            "--latency" => a.latency = v != 0,
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

/// Lands blocks in a ring of reused block-sized buffers (a KV cache's slots, without the cache):
/// a plain pull reads payloads straight into them; a striped pull hands over its own buffers.
struct SlotSink {
    slots: Vec<Vec<u8>>,
    next: usize,
    blocks: usize,
    bytes: u64,
}

impl SlotSink {
    fn new(block_bytes: usize) -> Self {
        Self {
            slots: (0..4).map(|_| vec![0u8; block_bytes]).collect(),
            next: 0,
            blocks: 0,
            bytes: 0,
        }
    }
}

impl BlockSink for SlotSink {
    fn accept(&mut self, _index: usize, _hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        self.blocks += 1;
        self.bytes += payload.len() as u64;
        Ok(())
    }

    fn destination(&mut self, _index: usize, _hash: BlockHash, len: usize) -> Option<&mut [u8]> {
        self.next = (self.next + 1) % self.slots.len();
        let slot = &mut self.slots[self.next];
        slot.resize(len, 0);
        Some(slot)
    }

    fn accept_written(&mut self, _index: usize, _hash: BlockHash) -> Result<(), SinkError> {
        self.blocks += 1;
        self.bytes += self.slots[self.next].len() as u64;
        Ok(())
    }
}

/// One end of the transfer: a runtime whose threads' CPU time can be read.
struct End {
    rt: Runtime,
    tids: Arc<Mutex<Vec<u32>>>,
}

/// This thread's id, from `/proc/thread-self/stat`.
fn thread_id() -> u32 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    stat.split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0)
}

impl End {
    fn new(name: &str) -> Self {
        let tids = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&tids);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(name)
            .on_thread_start(move || seen.lock().push(thread_id()))
            .enable_all()
            .build()
            .unwrap();
        Self { rt, tids }
    }

    /// CPU seconds (user + system) of this end's threads so far.
    fn cpu_seconds(&self) -> f64 {
        let ns: u64 = self
            .tids
            .lock()
            .iter()
            .map(|tid| {
                std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
                    .ok()
                    .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum();
        ns as f64 / 1e9
    }
}

/// CPU seconds (user + system, all threads) this process has used (10 ms ticks).
fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn first_line_of(path: &str, key: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_once(':'))
        .map_or(String::new(), |(_, v)| v.trim().to_string())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What one mode costs in one iteration.
#[derive(Clone, Copy, Default)]
struct Sample {
    secs: f64,
    producer_cpu: f64,
    consumer_cpu: f64,
    process_cpu: f64,
}

struct Bench {
    producer: End,
    consumer: End,
    payloads: Vec<Bytes>,
    hashes: Arc<Vec<BlockHash>>,
    block_bytes: usize,
}

impl Bench {
    /// Runs `work` and charges each end the CPU its threads used meanwhile.
    fn sample(&self, work: impl FnOnce() -> f64) -> Sample {
        let (p0, c0, t0) = (
            self.producer.cpu_seconds(),
            self.consumer.cpu_seconds(),
            process_cpu_seconds(),
        );
        let secs = work();
        Sample {
            secs,
            producer_cpu: self.producer.cpu_seconds() - p0,
            consumer_cpu: self.consumer.cpu_seconds() - c0,
            process_cpu: process_cpu_seconds() - t0,
        }
    }

    /// The plain-socket limit: every block's buffer handed to `writev` 64 at a time, read into
    /// one reused 1 MiB buffer.
    fn limit(&self) -> Sample {
        let blocks = self.hashes.len();
        let total = (blocks * self.block_bytes) as u64;
        let payloads = self.payloads.clone();
        let listener = self
            .producer
            .rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        self.sample(|| {
            let writer = self.producer.rt.spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                let order: Vec<&Bytes> =
                    (0..blocks).map(|i| &payloads[i % payloads.len()]).collect();
                for batch in order.chunks(64) {
                    let mut slices: Vec<IoSlice<'_>> =
                        batch.iter().map(|b| IoSlice::new(b)).collect();
                    let mut rest = &mut slices[..];
                    while !rest.is_empty() {
                        let n = s.write_vectored(rest).await.unwrap();
                        IoSlice::advance_slices(&mut rest, n);
                    }
                }
                s.flush().await.unwrap();
            });
            let reader = self.consumer.rt.spawn(async move {
                let start = Instant::now();
                let mut s = TcpStream::connect(addr).await.unwrap();
                let mut buf = vec![0u8; 1 << 20];
                let mut got = 0u64;
                while got < total {
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0, "writer closed early");
                    got += n as u64;
                }
                start.elapsed().as_secs_f64()
            });
            let secs = self.consumer.rt.block_on(reader).unwrap();
            self.producer.rt.block_on(writer).unwrap();
            secs
        })
    }

    /// One pull of `n` leading blocks into a slot sink.
    fn pull(&self, client: &Arc<PullClient>, addr: SocketAddr, n: usize) -> Sample {
        let (client, hashes, bytes) = (
            Arc::clone(client),
            Arc::clone(&self.hashes),
            self.block_bytes,
        );
        self.sample(|| {
            let task = self.consumer.rt.spawn(async move {
                let mut sink = SlotSink::new(bytes);
                let start = Instant::now();
                let report = client.pull(addr, "bench", &hashes[..n], &mut sink).await;
                let secs = start.elapsed().as_secs_f64();
                assert_eq!(report.outcome, PullOutcome::Complete, "{report:?}");
                assert_eq!((sink.blocks, sink.bytes), (n, (n * bytes) as u64));
                secs
            });
            self.consumer.rt.block_on(task).unwrap()
        })
    }
}

/// A pull mode: which producer it talks to and how its client is configured.
struct Mode {
    name: &'static str,
    addr: SocketAddr,
    client: Arc<PullClient>,
}

fn main() {
    let a = args();
    let block_bytes = a.bytes_per_token * a.block_tokens;
    let blocks = a.prefix_tokens / a.block_tokens;
    let total = (blocks * block_bytes) as f64;
    println!(
        "cpu: {} ({} cores); load average before: {}",
        first_line_of("/proc/cpuinfo", "model name"),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg()
    );
    println!(
        "prefix {} tokens = {blocks} blocks x {block_bytes} B ({} tokens x {} B/token); {:.3} GB per pull; {} runs",
        a.prefix_tokens,
        a.block_tokens,
        a.bytes_per_token,
        total / 1e9,
        a.runs
    );
    let bench = Bench {
        producer: End::new("producer"),
        consumer: End::new("consumer"),
        payloads: (0..4u8)
            .map(|i| Bytes::from(vec![i.wrapping_mul(37); block_bytes]))
            .collect(),
        hashes: Arc::new((0..blocks as u64).map(|i| BlockHash(0xb000 + i)).collect()),
        block_bytes,
    };
    let source = MemorySource::new(fp());
    for (i, h) in bench.hashes.iter().enumerate() {
        source.insert(*h, bench.payloads[i % bench.payloads.len()].clone());
    }
    let cancel = CancellationToken::new();
    let max_frame = block_bytes + (64 << 10);
    let secret = Some(Secret::from("bench"));
    let serve = |secret: Option<Secret>, encrypt: bool| {
        let config = ServerConfig {
            max_frame,
            secret,
            encrypt,
            ..ServerConfig::default()
        };
        let src = Arc::new(source.clone());
        let (addr, _task) = bench
            .producer
            .rt
            .block_on(ProducerServer::bind(
                "127.0.0.1:0",
                src,
                config,
                cancel.clone(),
            ))
            .unwrap();
        addr
    };
    let (clear, auth, enc) = (
        serve(None, false),
        serve(secret.clone(), false),
        serve(secret.clone(), true),
    );
    let client = |addr: SocketAddr, secret: Option<Secret>, encrypt: bool, stripes: usize| {
        let mut allowed = AllowList::none();
        allowed.add_socket(addr);
        Arc::new(PullClient::new(
            fp(),
            ClientConfig {
                allowed_peers: allowed,
                max_frame,
                timeout: Duration::from_secs(30),
                secret,
                encrypt,
                stripes,
                ..ClientConfig::default()
            },
        ))
    };
    let modes = [
        Mode {
            name: "clear",
            addr: clear,
            client: client(clear, None, false, 1),
        },
        Mode {
            name: "authenticated",
            addr: auth,
            client: client(auth, secret.clone(), false, 1),
        },
        Mode {
            name: "encrypted",
            addr: enc,
            client: client(enc, secret.clone(), true, 1),
        },
        Mode {
            name: "auth x2 stripes",
            addr: auth,
            client: client(auth, secret.clone(), false, 2),
        },
        Mode {
            name: "auth x4 stripes",
            addr: auth,
            client: client(auth, secret.clone(), false, 4),
        },
    ];
    // Warm the connection pools (every stripe's connection) and the allocator.
    for m in &modes {
        bench.pull(&m.client, m.addr, 16.min(blocks));
    }
    let _ = bench.limit();

    let names: Vec<&str> = std::iter::once("limit (socket)")
        .chain(modes.iter().map(|m| m.name))
        .collect();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); names.len()];
    for _ in 0..a.runs {
        samples[0].push(bench.limit());
        for (i, m) in modes.iter().enumerate() {
            samples[i + 1].push(bench.pull(&m.client, m.addr, blocks));
        }
    }
    println!("load average after: {}", loadavg());
    report(&names, &samples, total);

    if a.latency {
        let m = &modes[1];
        println!(
            "\n{} pull latency vs prefix length (warm connection, median of {} runs):",
            m.name, a.runs
        );
        println!(
            "{:>8} {:>7} {:>10} {:>10} {:>8}",
            "tokens", "blocks", "MB", "ms", "GB/s"
        );
        for tokens in [2048usize, 4096, 8192, 16384, 32768, 49152] {
            let n = (tokens / a.block_tokens).min(blocks);
            let secs = median(
                (0..a.runs)
                    .map(|_| bench.pull(&m.client, m.addr, n).secs)
                    .collect(),
            );
            let bytes = (n * block_bytes) as f64;
            println!(
                "{tokens:>8} {n:>7} {:>10.1} {:>10.1} {:>8.2}",
                bytes / 1e6,
                secs * 1e3,
                bytes / secs / 1e9
            );
        }
    }
    cancel.cancel();
}

/// The table of every mode, then the targets.
fn report(names: &[&str], samples: &[Vec<Sample>], total: f64) {
    let gb = total / 1e9;
    let paired = |i: usize, j: usize| {
        median(
            samples[i]
                .iter()
                .zip(&samples[j])
                .map(|(x, y)| y.secs / x.secs)
                .collect(),
        )
    };
    // Per GB of payload, summed over the runs.
    let per_gb = |i: usize, f: fn(&Sample) -> f64| {
        samples[i].iter().map(f).sum::<f64>() / (gb * samples[i].len() as f64)
    };
    println!(
        "\n{:<17} {:>8} {:>6} {:>6} {:>6} {:>7} {:>9} {:>9} {:>15} {:>15}",
        "mode",
        "ms",
        "GB/s",
        "÷limit",
        "÷clear",
        "CPU/GB",
        "prod s/GB",
        "cons s/GB",
        "cores@100GbE",
        "cores@400GbE"
    );
    println!(
        "{:<17} {:>8} {:>6} {:>6} {:>6} {:>7} {:>9} {:>9} {:>15} {:>15}",
        "", "median", "", "", "", "ms", "", "", "prod/cons", "prod/cons"
    );
    for (i, name) in names.iter().enumerate() {
        let secs = median(samples[i].iter().map(|s| s.secs).collect());
        let (prod, cons) = (per_gb(i, |s| s.producer_cpu), per_gb(i, |s| s.consumer_cpu));
        println!(
            "{name:<17} {:>8.1} {:>6.2} {:>6.2} {:>6.2} {:>7.0} {:>9.3} {:>9.3} {:>7.1}/{:<7.1} {:>7.1}/{:<7.1}",
            secs * 1e3,
            gb / secs,
            paired(i, 0),
            paired(i, 1),
            per_gb(i, |s| s.process_cpu) * 1e3,
            prod,
            cons,
            12.5 * prod,
            12.5 * cons,
            50.0 * prod,
            50.0 * cons,
        );
    }
    // Rows: 0 limit, 1 clear, 2 authenticated, 3 encrypted, 4 auth x2, 5 auth x4.
    let cpu = |i: usize| per_gb(i, |s| s.process_cpu);
    let ends = |i: usize| per_gb(i, |s| s.producer_cpu + s.consumer_cpu);
    println!("\ntargets (issue 33), medians of per-iteration ratios:");
    let rate = paired(2, 1);
    println!(
        "  authenticated bytes/s = {rate:.2}x clear (target >= 0.8): {}",
        if rate >= 0.8 { "met" } else { "NOT met" }
    );
    let cost = ends(2) / ends(1);
    println!(
        "  authenticated CPU/GB = {cost:.2}x clear (target <= 1.5): {}",
        if cost <= 1.5 { "met" } else { "NOT met" }
    );
    println!(
        "  encrypted bytes/s = {:.2}x clear, CPU/GB = {:.2}x clear; vs authenticated: CPU {:+.0}% (offered when <= +10%)",
        paired(3, 1),
        ends(3) / ends(1),
        (ends(3) / ends(2) - 1.0) * 100.0
    );
    println!(
        "  process CPU/GB (10 ms ticks): clear {:.0} ms, authenticated {:.0} ms, encrypted {:.0} ms",
        cpu(1) * 1e3,
        cpu(2) * 1e3,
        cpu(3) * 1e3
    );
    println!(
        "  stripes (authenticated): x2 = {:.2}x, x4 = {:.2}x the bytes/s of one connection",
        paired(4, 2),
        paired(5, 2)
    );
}
