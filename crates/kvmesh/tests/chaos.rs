//! Chaos run (issue 15): three `kvmesh engine --backend sim` processes (P2P producers, KV events
//! with a replay ring) behind `kvmesh router` with its default placement (predicted TTFT, pulls
//! named when they pay), under a steady open-loop load of streamed requests that share long
//! document prefixes. While the load runs:
//!
//! 1. one engine is killed with SIGKILL at a moment a request whose P2P pull involves it has not
//!    received its first token yet (mid-pull), and restarted on the same ports 3 s later;
//! 2. later the router is stopped (SIGTERM: it drains) and started again on the same port; the
//!    client treats a refused connection to the router as retryable and retries (counted
//!    separately: `router-down connect retries`).
//!
//! Asserted: every client-visible failure was in flight on the killed engine at the kill (a request
//! not yet placed there is retried by the router, which ejects the dead endpoint); no request
//! started after the kill fails; after the load stops, the router's index (`POST /debug/prefix`)
//! agrees with what every engine actually holds for every document; no P2P pull took longer than
//! its deadline allows (engine histogram `kvmesh_p2p_pull_duration_seconds`). A summary table is
//! printed (`cargo test -p kvmesh --test chaos -- --nocapture`); its numbers are in
//! `docs/reliability.md`.
//!
//! Ground truth for "what an engine holds": the probe prompt (a document plus a suffix no request
//! used) is sent to the engine itself with `max_tokens: 1`; the engine's answer reports in
//! `usage.prompt_tokens_details.cached_tokens` how many leading tokens it found in its GPU tier or
//! restored from its CPU tier, i.e. exactly the longest cached prefix the router's index claims to
//! know (`any_tokens`). The engines have no debug endpoint listing their blocks; the hit counters
//! in `/metrics` are fleet totals and cannot be attributed to one prompt. The router is asked
//! first, for every document, so the probes' own computation cannot influence its answer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::BIN;
use kvmesh_bench::fleet::{EngineGroup, engine_args};
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

const MODEL: &str = "sim-chaos";
const ENGINES: usize = 3;
/// Documents generated; the run uses about `run seconds / SLIDE_S + WINDOW` of them.
const DOCS: usize = 64;
/// 4096 tokens: ~135 ms to prefill on the modelled H200, ~45 ms to pull.
const DOC_TOKENS: usize = 4096;
/// Requests ask about one of `WINDOW` documents; every `SLIDE_S` the window moves one document
/// on. A new document is computed cold once (its engine is busy meanwhile), then read by ~20
/// requests: the router pulls it to another engine when its holder is busy.
const WINDOW: usize = 4;
const SLIDE_S: f64 = 1.0;
/// Requests per second, open loop (each starts on schedule, whatever the others do).
const RATE: f64 = 30.0;
const MAX_TOKENS: u32 = 24;
/// Warm-up before the kill is armed; the pre-kill window gives the steady TTFT.
const ARM_KILL_AT: Duration = Duration::from_secs(10);
/// How long to wait for a mid-pull moment before killing anyway.
const MID_PULL_WAIT: Duration = Duration::from_secs(6);
const RESTART_ENGINE_AFTER: Duration = Duration::from_secs(3);
const RESTART_ROUTER_AFTER_KILL: Duration = Duration::from_secs(11);
const LOAD_AFTER_ROUTER_UP: Duration = Duration::from_secs(8);
/// How long the client keeps retrying a refused connection to the router.
const ROUTER_RETRY_BUDGET: Duration = Duration::from_secs(20);
/// P2P step timeout and pending deadline given to the engines: a pull's deadline is their sum.
const P2P_TIMEOUT_MS: u64 = 1000;
const P2P_PENDING_MS: u64 = 500;

fn since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

// ---------------------------------------------------------------- processes

/// One engine: its command line (same ports on every start), its log and its current process.
struct EngineSlot {
    name: String,
    args: Vec<String>,
    url: String,
    log: PathBuf,
    child: Option<Child>,
}

struct RouterSlot {
    port: u16,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// Every child process of the run; dropping it (test end or panic) kills them all.
struct Procs {
    engines: Vec<EngineSlot>,
    router: RouterSlot,
}

impl Drop for Procs {
    fn drop(&mut self) {
        let children = self
            .engines
            .iter_mut()
            .map(|e| &mut e.child)
            .chain(std::iter::once(&mut self.router.child));
        for c in children.flatten() {
            let _ = c.start_kill();
        }
    }
}

fn spawn(args: &[String], log: &Path) -> Child {
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let err = out.try_clone().unwrap();
    Command::new(BIN)
        .args(args)
        .env("KVMESH_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn wait_healthy(http: &reqwest::Client, url: &str, child: &mut Child, log: &Path) {
    if let Err(e) = healthy_or_exited(http, url, child, log).await {
        panic!("{e}");
    }
}

/// Waits for `url/health`; Err (with the log) if the process exited during start-up.
async fn healthy_or_exited(
    http: &reqwest::Client,
    url: &str,
    child: &mut Child,
    log: &Path,
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!(
                "{url} exited with {st} during start-up; log {}:\n{}",
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
        let probe = http
            .get(format!("{url}/health"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if probe.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        assert!(Instant::now() < deadline, "{url} not healthy within 60 s");
        sleep(Duration::from_millis(50)).await;
    }
}

/// `n` distinct free loopback ports: all are held open until every one is chosen, so two services
/// never get the same port (`free_port` called in a row can hand the same one out twice).
fn distinct_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

fn engine_slot(dir: &Path, i: usize, ports: &[u16]) -> (EngineSlot, String) {
    let group = EngineGroup {
        profile: Some("gpt-oss-120b-h200".into()),
        num_gpu_blocks: Some(4096),
        cpu_offload_bytes: Some("256MiB".into()),
        // 4 MiB per document: a pull moves real bytes for a while (not only the modelled wait),
        // so the kill can land mid-transfer.
        sim_kv_bytes_per_token: Some(1024),
        time_scale: Some(1.0),
        max_model_len: Some(8192),
        extra_args: vec![
            "--p2p-timeout-ms".into(),
            P2P_TIMEOUT_MS.to_string(),
            "--p2p-pending-deadline-ms".into(),
            P2P_PENDING_MS.to_string(),
        ],
        ..EngineGroup::default()
    };
    let [port, events, replay, p2p] = [ports[0], ports[1], ports[2], ports[3]];
    let args = engine_args(&group, MODEL, i, port, events, Some(replay), Some(p2p));
    let name = format!("engine-{i}");
    let endpoint_yaml = format!(
        "  - name: {name}\n    url: \"http://127.0.0.1:{port}\"\n    kv_events: {{endpoint: \"tcp://127.0.0.1:{events}\", topic: \"\", replay_endpoint: \"tcp://127.0.0.1:{replay}\"}}\n    p2p: \"127.0.0.1:{p2p}\"\n"
    );
    let slot = EngineSlot {
        log: dir.join(format!("{name}.log")),
        name,
        args,
        url: format!("http://127.0.0.1:{port}"),
        child: None,
    };
    (slot, endpoint_yaml)
}

/// The router's config: no `scheduling_profiles`, so the default placement (predicted TTFT,
/// `p2p-source-producer` in `mode: predicted`); fast health checks so a dead engine found by
/// the health loop (rather than by a refused request) is ejected within ~1 s.
fn router_yaml(endpoints: &str) -> String {
    format!(
        "block_size: 16\ntokenizer: byte\nmetrics_scrape_interval: 200ms\ndecisions_capacity: 4096\n\
         seed: 7\nhealth_check: {{interval: 500ms, timeout: 2s, unhealthy_threshold: 2, healthy_threshold: 1}}\n\
         endpoints:\n{endpoints}"
    )
}

fn router_args(r: &RouterSlot) -> Vec<String> {
    [
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        &r.port.to_string(),
        "--config",
        &r.config.display().to_string(),
        "--drain-timeout",
        "10s",
    ]
    .map(String::from)
    .to_vec()
}

/// Starts the fleet. A port chosen free can be taken by another process before the service binds
/// it; that start-up failure (and only that one) is retried with fresh ports.
async fn launch(dir: &Path, http: &reqwest::Client) -> Procs {
    for attempt in 1.. {
        match try_launch(dir, http).await {
            Ok(procs) => return procs,
            Err(e) if attempt < 3 && e.contains("Address already in use") => {
                println!("launch attempt {attempt}: a port was taken meanwhile; retrying");
            }
            Err(e) => panic!("{e}"),
        }
    }
    unreachable!("the loop returns or panics")
}

async fn try_launch(dir: &Path, http: &reqwest::Client) -> Result<Procs, String> {
    let mut engines = Vec::new();
    let mut yaml = String::new();
    let ports = distinct_ports(4 * ENGINES + 1);
    for i in 0..ENGINES {
        let (slot, ep) = engine_slot(dir, i, &ports[4 * i..4 * i + 4]);
        engines.push(slot);
        yaml.push_str(&ep);
    }
    let config = dir.join("router.yaml");
    std::fs::write(&config, router_yaml(&yaml)).unwrap();
    let mut procs = Procs {
        engines,
        router: RouterSlot {
            port: ports[4 * ENGINES],
            config,
            log: dir.join("router.log"),
            child: None,
        },
    };
    for e in &mut procs.engines {
        e.child = Some(spawn(&e.args, &e.log));
    }
    for e in &mut procs.engines {
        healthy_or_exited(http, &e.url, e.child.as_mut().unwrap(), &e.log).await?;
    }
    let r = &mut procs.router;
    let mut child = spawn(&router_args(r), &r.log);
    let url = format!("http://127.0.0.1:{}", r.port);
    let up = healthy_or_exited(http, &url, &mut child, &r.log).await;
    r.child = Some(child);
    up.map(|()| procs)
}

async fn start_router(r: &mut RouterSlot, http: &reqwest::Client) {
    let mut child = spawn(&router_args(r), &r.log);
    let url = format!("http://127.0.0.1:{}", r.port);
    wait_healthy(http, &url, &mut child, &r.log).await;
    r.child = Some(child);
}

// ---------------------------------------------------------------- workload and client

/// Document `d`: `DOC_TOKENS` printable ASCII bytes (the byte tokenizer maps each to one token).
fn document(d: usize) -> String {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ (d as u64 + 1).wrapping_mul(0x1000_0000_01b3);
    (0..DOC_TOKENS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

/// What the client saw for one request (times in seconds since the run started).
#[derive(Debug, Clone, Default)]
struct Rec {
    id: String,
    doc: usize,
    start: f64,
    ttft: Option<f64>,
    end: Option<f64>,
    ok: bool,
    error: Option<String>,
    endpoint: Option<String>,
    /// Connections to the router refused (router down) before this request got in.
    router_retries: u32,
}

type Log = Arc<Mutex<Vec<Rec>>>;

fn update(log: &Log, idx: usize, f: impl FnOnce(&mut Rec)) {
    f(&mut log.lock().unwrap()[idx]);
}

/// Sends one streamed completion through the router, retrying only a refused connection to the
/// router itself; records everything in `log[idx]`.
async fn one_request(
    http: reqwest::Client,
    url: String,
    body: Value,
    log: Log,
    idx: usize,
    t0: Instant,
) {
    let id = log.lock().unwrap()[idx].id.clone();
    let first_try = Instant::now();
    let resp = loop {
        let sent = http
            .post(format!("{url}/v1/completions"))
            .header("x-request-id", &id)
            .json(&body)
            .send()
            .await;
        match sent {
            Err(e) if e.is_connect() && first_try.elapsed() < ROUTER_RETRY_BUDGET => {
                update(&log, idx, |r| r.router_retries += 1);
                sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                let msg = format!("send: {}", chain(&e));
                return update(&log, idx, |r| finish(r, t0, Err(msg)));
            }
            Ok(resp) => break resp,
        }
    };
    let status = resp.status();
    let endpoint = resp
        .headers()
        .get("x-kvmesh-endpoint")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    update(&log, idx, |r| r.endpoint = endpoint);
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let msg = format!(
            "HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        );
        return update(&log, idx, |r| finish(r, t0, Err(msg)));
    }
    let result = read_stream(resp, &log, idx, t0).await;
    update(&log, idx, |r| finish(r, t0, result));
}

async fn read_stream(
    mut resp: reqwest::Response,
    log: &Log,
    idx: usize,
    t0: Instant,
) -> Result<(), String> {
    let mut tail = String::new();
    let mut first = true;
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => {
                if first {
                    first = false;
                    update(log, idx, |r| r.ttft = Some(since(t0) - r.start));
                }
                tail.push_str(&String::from_utf8_lossy(&bytes));
                if tail.len() > 4096 {
                    tail.drain(..tail.len() - 2048);
                }
            }
            Ok(None) if tail.trim_end().ends_with("data: [DONE]") => return Ok(()),
            Ok(None) => return Err(format!("stream ended without [DONE]: ...{}", last(&tail))),
            Err(e) => return Err(format!("stream: {} after ...{}", chain(&e), last(&tail))),
        }
    }
}

fn last(s: &str) -> String {
    let v: Vec<char> = s.chars().collect();
    v[v.len().saturating_sub(160)..].iter().collect()
}

fn finish(r: &mut Rec, t0: Instant, result: Result<(), String>) {
    r.end = Some(since(t0));
    match result {
        Ok(()) => r.ok = true,
        Err(e) => r.error = Some(e),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// The open-loop generator: request `n` starts at `n / RATE` s, on a random document, until
/// `stop` is set. Returns the request tasks.
async fn generate(
    http: reqwest::Client,
    url: String,
    docs: Arc<Vec<String>>,
    log: Log,
    stop: Arc<std::sync::atomic::AtomicBool>,
    t0: Instant,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for n in 0usize.. {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        let at = Duration::from_secs_f64(n as f64 / RATE);
        if let Some(wait) = at.checked_sub(t0.elapsed()) {
            sleep(wait).await;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let base = (since(t0) / SLIDE_S) as usize;
        let doc = (base + (x % WINDOW as u64) as usize).min(DOCS - 1);
        let prompt = format!(
            "{}\nQuestion {n}: what does part {} say?",
            docs[doc],
            n % 97
        );
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                          "ignore_eos": true, "stream": true, "temperature": 0});
        let idx = {
            let mut l = log.lock().unwrap();
            l.push(Rec {
                id: format!("chaos-{n}"),
                doc,
                start: since(t0),
                ..Rec::default()
            });
            l.len() - 1
        };
        tasks.push(tokio::spawn(one_request(
            http.clone(),
            url.clone(),
            body,
            Arc::clone(&log),
            idx,
            t0,
        )));
    }
    tasks
}

// ---------------------------------------------------------------- metrics

async fn get_text(http: &reqwest::Client, url: &str) -> Option<String> {
    let r = http
        .get(url)
        .timeout(Duration::from_secs(3))
        .send()
        .await
        .ok()?;
    r.text().await.ok()
}

async fn get_json(http: &reqwest::Client, url: &str) -> Option<Value> {
    let r = http
        .get(url)
        .timeout(Duration::from_secs(3))
        .send()
        .await
        .ok()?;
    r.json().await.ok()
}

/// Samples of metric `name` (exact name, before `{` or space) whose label text contains every
/// one of `labels`, summed.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// P2P pulls as one engine process counted them.
#[derive(Debug, Default, Clone)]
struct Pulls {
    /// (outcome, reason) → count.
    by_outcome: BTreeMap<(String, String), f64>,
    count: f64,
    /// Observations above `le`.
    above: BTreeMap<String, f64>,
}

fn pulls_of(text: &str) -> Pulls {
    let mut p = Pulls::default();
    for l in text
        .lines()
        .filter(|l| l.starts_with("kvmesh_p2p_pulls_total{"))
    {
        let label = |k: &str| {
            let at = l.find(&format!("{k}=\""))? + k.len() + 2;
            Some(l[at..].split('"').next()?.to_owned())
        };
        let v: f64 = l
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        if let (Some(o), Some(r)) = (label("outcome"), label("reason"))
            && v > 0.0
        {
            *p.by_outcome.entry((o, r)).or_default() += v;
        }
    }
    p.count = metric(text, "kvmesh_p2p_pull_duration_seconds_count", &[]);
    for le in ["1.024", "2.048", "4.096"] {
        let within = metric(
            text,
            "kvmesh_p2p_pull_duration_seconds_bucket",
            &[&format!("le=\"{le}\"")],
        );
        p.above.insert(le.to_owned(), p.count - within);
    }
    p
}

fn merge(into: &mut Pulls, p: &Pulls) {
    for (k, v) in &p.by_outcome {
        *into.by_outcome.entry(k.clone()).or_default() += v;
    }
    into.count += p.count;
    for (k, v) in &p.above {
        *into.above.entry(k.clone()).or_default() += v;
    }
}

// ---------------------------------------------------------------- the run

/// What happened when, in seconds since the run started.
#[derive(Debug, Default)]
struct Timeline {
    kill: f64,
    kill_unix: f64,
    victim: usize,
    mid_pull: Option<String>,
    engine_up: f64,
    readmitted: Option<f64>,
    stale_tokens_at_readmit: usize,
    stale_cleared: Option<f64>,
    router_term: f64,
    router_exited: f64,
    router_up: f64,
    load_stop: f64,
}

struct Run {
    http: reqwest::Client,
    router_url: String,
    docs: Arc<Vec<String>>,
    log: Log,
    t0: Instant,
    /// The victim's last `/metrics` before the kill (its pulls die with it otherwise).
    victim_metrics: HashMap<usize, String>,
}

impl Run {
    /// Documents some request asked about so far, ascending.
    fn used_docs(&self) -> Vec<usize> {
        let l = self.log.lock().unwrap();
        let set: std::collections::BTreeSet<usize> = l.iter().map(|r| r.doc).collect();
        set.into_iter().collect()
    }

    fn in_flight_without_first_token(&self) -> HashSet<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.end.is_none() && r.ttft.is_none())
            .map(|r| r.id.clone())
            .collect()
    }

    /// Waits (at most `MID_PULL_WAIT`) for a placed request with a named pull that has not
    /// produced its first token: returns the pull's source engine and a description.
    async fn find_mid_pull(&self) -> Option<(usize, String)> {
        let deadline = Instant::now() + MID_PULL_WAIT;
        while Instant::now() < deadline {
            let waiting = self.in_flight_without_first_token();
            let url = format!("{}/debug/decisions?last=64", self.router_url);
            if let Some(Value::Array(ds)) = get_json(&self.http, &url).await {
                for d in ds.iter().rev() {
                    let id = d["request_id"].as_str().unwrap_or_default();
                    if let Some(src) = d["p2p"]["source_endpoint"].as_str()
                        && d["outcome"] == "pull_named"
                        && waiting.contains(id)
                    {
                        let victim = src.trim_start_matches("engine-").parse().ok()?;
                        let why = format!("{id} placed on {} pulling from {src}", d["endpoint"]);
                        return Some((victim, why));
                    }
                }
            }
            sleep(Duration::from_millis(15)).await;
        }
        None
    }

    async fn scrape_engines(&mut self, procs: &Procs) {
        for (i, e) in procs.engines.iter().enumerate() {
            if let Some(t) = get_text(&self.http, &format!("{}/metrics", e.url)).await {
                self.victim_metrics.insert(i, t);
            }
        }
    }

    fn progress(&self, what: &str) {
        let l = self.log.lock().unwrap();
        let done = l.iter().filter(|r| r.end.is_some()).count();
        let ok = l.iter().filter(|r| r.ok).count();
        let failed = l.iter().filter(|r| r.end.is_some() && !r.ok).count();
        let retries: u32 = l.iter().map(|r| r.router_retries).sum();
        println!(
            "[{:6.2}s] {what:<34} started {:4}  done {:4}  ok {:4}  failed {:3}  in flight {:3}  router-down retries {retries}",
            since(self.t0),
            l.len(),
            done,
            ok,
            failed,
            l.len() - done
        );
    }

    /// Sleeps until `at` (seconds since start), printing progress every 2 s and keeping the
    /// engines' last metrics.
    async fn run_until(&mut self, procs: &Procs, at: f64) {
        let mut next_print = since(self.t0);
        while since(self.t0) < at {
            if since(self.t0) >= next_print {
                self.progress("load");
                self.scrape_engines(procs).await;
                next_print += 2.0;
            }
            sleep(
                Duration::from_millis(100)
                    .min(Duration::from_secs_f64((at - since(self.t0)).max(0.0))),
            )
            .await;
        }
    }

    /// The router's cached tokens per (endpoint, document), for the probe prompts.
    async fn router_view(&self, docs: &[usize]) -> HashMap<(String, usize), u64> {
        let mut out = HashMap::new();
        for &d in docs {
            let body = json!({"prompt": probe_prompt(&self.docs, d, "view")});
            let v: Value = self
                .http
                .post(format!("{}/debug/prefix", self.router_url))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            for (ep, m) in v["endpoints"].as_object().unwrap() {
                out.insert((ep.clone(), d), m["any_tokens"].as_u64().unwrap());
            }
        }
        out
    }
}

/// A document plus a suffix no load request used (its first byte differs from a question's).
fn probe_prompt(docs: &[String], d: usize, tag: &str) -> String {
    format!("{}#probe-{tag}", docs[d])
}

/// Tokens of document `d`'s prefix engine `url` holds: its own answer to the probe prompt.
async fn engine_holds(
    http: &reqwest::Client,
    url: &str,
    docs: &[String],
    d: usize,
    tag: &str,
) -> u64 {
    let body = json!({"model": MODEL, "prompt": probe_prompt(docs, d, tag), "max_tokens": 1, "temperature": 0});
    let v: Value = http
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

async fn kill_engine(run: &mut Run, procs: &mut Procs, tl: &mut Timeline) {
    let found = run.find_mid_pull().await;
    let (victim, why) = match found {
        Some((v, why)) => (v, Some(why)),
        None => (1, None),
    };
    let e = &mut procs.engines[victim];
    let mut child = e.child.take().unwrap();
    child.start_kill().unwrap(); // SIGKILL
    tl.kill = since(run.t0);
    tl.kill_unix = unix_now();
    tl.victim = victim;
    tl.mid_pull = why;
    let _ = child.wait().await;
    run.progress(&format!("SIGKILL {}", e.name));
    if let Some(w) = &tl.mid_pull {
        println!("          mid-pull: {w}");
    } else {
        println!("          no pull in flight was found within {MID_PULL_WAIT:?}; killed engine-1");
    }
}

async fn restart_engine(run: &mut Run, procs: &mut Procs, tl: &mut Timeline) {
    let e = &mut procs.engines[tl.victim];
    let mut child = spawn(&e.args, &e.log);
    wait_healthy(&run.http, &e.url, &mut child, &e.log).await;
    e.child = Some(child);
    tl.engine_up = since(run.t0);
    run.progress(&format!("{} back on its ports", e.name));
    let name = e.name.clone();
    watch_readmission(run, &name, tl).await;
}

/// After the restart: when the router readmits the engine, how many tokens its index still
/// attributes to it (stale: the new process started empty, and has not computed anything yet
/// when nothing was placed on it), and when the router drops them (the new process's first
/// event batch has a lower sequence number: `kvmesh_indexer_restarts_total`).
async fn watch_readmission(run: &Run, name: &str, tl: &mut Timeline) {
    let deadline = Instant::now() + Duration::from_secs(8);
    let restarts = |t: &str| {
        metric(
            t,
            "kvmesh_indexer_restarts_total",
            &[&format!("endpoint=\"{name}\"")],
        )
    };
    let before = get_text(&run.http, &format!("{}/metrics", run.router_url))
        .await
        .map_or(0.0, |t| restarts(&t));
    while Instant::now() < deadline {
        let eps = get_json(&run.http, &format!("{}/debug/endpoints", run.router_url)).await;
        let healthy = eps
            .as_ref()
            .and_then(|v| v.as_array()?.iter().find(|e| e["name"] == name).cloned())
            .is_some_and(|e| e["healthy"] == true);
        if tl.readmitted.is_none() && healthy {
            tl.readmitted = Some(since(run.t0));
            let docs = run.used_docs();
            let view = run.router_view(&docs).await;
            tl.stale_tokens_at_readmit = docs
                .iter()
                .map(|&d| view.get(&(name.to_owned(), d)).copied().unwrap_or(0) as usize)
                .sum();
        }
        let now = get_text(&run.http, &format!("{}/metrics", run.router_url))
            .await
            .map_or(before, |t| restarts(&t));
        if now > before {
            tl.stale_cleared = Some(since(run.t0));
            return;
        }
        sleep(Duration::from_millis(50)).await;
    }
}

async fn restart_router(run: &mut Run, procs: &mut Procs, tl: &mut Timeline) {
    let mut child = procs.router.child.take().unwrap();
    let pid = child.id().unwrap();
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    tl.router_term = since(run.t0);
    run.progress("SIGTERM router");
    let exited = timeout(Duration::from_secs(15), child.wait()).await;
    assert!(exited.is_ok(), "router did not exit within 15 s of SIGTERM");
    tl.router_exited = since(run.t0);
    start_router(&mut procs.router, &run.http).await;
    tl.router_up = since(run.t0);
    run.progress("router back on its port");
}

/// Router counters of the second router process (the first one's died with it: the numbers of
/// the first are read just before its SIGTERM).
#[derive(Debug, Default, Clone)]
struct RouterCounters {
    retries: f64,
    ejected: f64,
    readmitted: f64,
    upstream_connect: f64,
}

fn router_counters(t: &str) -> RouterCounters {
    RouterCounters {
        retries: metric(t, "kvmesh_router_retries_total", &[]),
        ejected: metric(
            t,
            "kvmesh_router_endpoint_changes_total",
            &["kind=\"ejected\""],
        ),
        readmitted: metric(
            t,
            "kvmesh_router_endpoint_changes_total",
            &["kind=\"readmitted\""],
        ),
        upstream_connect: metric(
            t,
            "kvmesh_router_errors_total",
            &["kind=\"upstream_connect\""],
        ),
    }
}

// ---------------------------------------------------------------- analysis

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn ttfts(recs: &[Rec], from: f64, to: f64) -> Vec<f64> {
    recs.iter()
        .filter(|r| r.ok && r.start >= from && r.start < to)
        .filter_map(|r| r.ttft)
        .collect()
}

/// Seconds from `event` until the first 1-s window of request starts whose median TTFT is within
/// 2x the steady median (at least 3 requests in the window); None if it never is before `until`.
fn recovery(recs: &[Rec], event: f64, until: f64, steady: f64) -> Option<f64> {
    let mut w = event;
    while w + 1.0 <= until {
        let v = ttfts(recs, w, w + 1.0);
        if v.len() >= 3 && median(v).is_some_and(|m| m <= 2.0 * steady) {
            return Some(w - event);
        }
        w += 0.25;
    }
    None
}

/// Whether `r` was placed on the victim at the kill: its response named the victim, or (no
/// response headers) the router's last decision for it before the kill did.
fn on_victim_at_kill(
    r: &Rec,
    tl: &Timeline,
    victim: &str,
    decided: &HashMap<String, String>,
) -> bool {
    let in_flight = r.start <= tl.kill && r.end.is_none_or(|e| e >= tl.kill);
    let ep = r
        .endpoint
        .as_deref()
        .or(decided.get(&r.id).map(String::as_str));
    in_flight && ep == Some(victim)
}

/// Request id → endpoint of the router's last decision for it before the kill.
fn decided_before(decisions: &Value, kill_unix: f64) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for d in decisions.as_array().into_iter().flatten() {
        if d["at"].as_f64().is_some_and(|at| at <= kill_unix)
            && let (Some(id), Some(ep)) = (d["request_id"].as_str(), d["endpoint"].as_str())
        {
            out.insert(id.to_owned(), ep.to_owned());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_engine_mid_pull_restart_router_under_load() {
    timeout(Duration::from_secs(240), chaos())
        .await
        .expect("chaos run timed out");
}

async fn chaos() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut procs = launch(dir.path(), &http).await;
    let router_url = format!("http://127.0.0.1:{}", procs.router.port);
    let docs: Arc<Vec<String>> = Arc::new((0..DOCS).map(document).collect());
    let t0 = Instant::now();
    let mut run = Run {
        http: http.clone(),
        router_url: router_url.clone(),
        docs: Arc::clone(&docs),
        log: Arc::new(Mutex::new(Vec::new())),
        t0,
        victim_metrics: HashMap::new(),
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let generator = tokio::spawn(generate(
        http.clone(),
        router_url.clone(),
        Arc::clone(&docs),
        Arc::clone(&run.log),
        Arc::clone(&stop),
        t0,
    ));
    let mut tl = Timeline::default();

    run.run_until(&procs, ARM_KILL_AT.as_secs_f64()).await;
    run.scrape_engines(&procs).await;
    kill_engine(&mut run, &mut procs, &mut tl).await;
    let victim = procs.engines[tl.victim].name.clone();
    let victim_last_metrics = run
        .victim_metrics
        .get(&tl.victim)
        .cloned()
        .unwrap_or_default();
    sleep(Duration::from_millis(500)).await;
    let decisions = get_json(&http, &format!("{router_url}/debug/decisions?last=4096"))
        .await
        .unwrap_or(Value::Null);
    run.run_until(&procs, tl.kill + RESTART_ENGINE_AFTER.as_secs_f64())
        .await;
    restart_engine(&mut run, &mut procs, &mut tl).await;
    run.run_until(&procs, tl.kill + RESTART_ROUTER_AFTER_KILL.as_secs_f64())
        .await;
    let first_router = get_text(&http, &format!("{router_url}/metrics"))
        .await
        .unwrap_or_default();
    restart_router(&mut run, &mut procs, &mut tl).await;
    run.run_until(&procs, tl.router_up + LOAD_AFTER_ROUTER_UP.as_secs_f64())
        .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    tl.load_stop = since(t0);
    let tasks = generator.await.unwrap();
    for t in tasks {
        timeout(Duration::from_secs(60), t)
            .await
            .expect("a request never ended")
            .unwrap();
    }
    run.progress("load stopped, every request ended");
    let second_router = get_text(&http, &format!("{router_url}/metrics"))
        .await
        .unwrap_or_default();

    // Let the last events arrive, then compare the index with the engines.
    sleep(Duration::from_millis(1500)).await;
    let agreement = index_agreement(&run, &procs).await;

    let mut pulls = Pulls::default();
    merge(&mut pulls, &pulls_of(&victim_last_metrics));
    for e in &procs.engines {
        merge(
            &mut pulls,
            &pulls_of(
                &get_text(&http, &format!("{}/metrics", e.url))
                    .await
                    .unwrap_or_default(),
            ),
        );
    }
    let recs = run.log.lock().unwrap().clone();
    let decided = decided_before(&decisions, tl.kill_unix);
    let report = Report {
        recs: &recs,
        tl: &tl,
        victim: &victim,
        decided: &decided,
        routers: [
            router_counters(&first_router),
            router_counters(&second_router),
        ],
        pulls: &pulls,
        agreement: &agreement,
    };
    report.print();
    report.check();
    drop(procs);
}

/// (endpoint, document, router's tokens, engine's tokens) for every pair.
async fn index_agreement(run: &Run, procs: &Procs) -> Vec<(String, usize, u64, u64)> {
    let docs = run.used_docs();
    let view = run.router_view(&docs).await;
    // One task per engine (each probes its documents in turn), so the engines work in parallel.
    let probes: Vec<_> = procs
        .engines
        .iter()
        .map(|e| {
            let (http, url, all, docs) = (
                run.http.clone(),
                e.url.clone(),
                Arc::clone(&run.docs),
                docs.clone(),
            );
            tokio::spawn(async move {
                let mut held = Vec::new();
                for d in docs {
                    held.push((d, engine_holds(&http, &url, &all, d, "truth").await));
                }
                held
            })
        })
        .collect();
    let mut out = Vec::new();
    for (e, probe) in procs.engines.iter().zip(probes) {
        for (d, truth) in probe.await.unwrap() {
            let claimed = view.get(&(e.name.clone(), d)).copied().unwrap_or(0);
            out.push((e.name.clone(), d, claimed, truth));
        }
    }
    out
}

struct Report<'a> {
    recs: &'a [Rec],
    tl: &'a Timeline,
    victim: &'a str,
    decided: &'a HashMap<String, String>,
    routers: [RouterCounters; 2],
    pulls: &'a Pulls,
    agreement: &'a [(String, usize, u64, u64)],
}

impl Report<'_> {
    fn failed(&self) -> Vec<&Rec> {
        self.recs.iter().filter(|r| !r.ok).collect()
    }

    fn print(&self) {
        let (tl, recs) = (self.tl, self.recs);
        let failed = self.failed();
        let on_victim = failed
            .iter()
            .filter(|r| on_victim_at_kill(r, tl, self.victim, self.decided))
            .count();
        let in_flight_on_victim = recs
            .iter()
            .filter(|r| on_victim_at_kill(r, tl, self.victim, self.decided))
            .count();
        let steady = median(ttfts(recs, 3.0, tl.kill)).unwrap_or(f64::NAN);
        let router_down: u32 = recs.iter().map(|r| r.router_retries).sum();
        let waited_router = recs.iter().filter(|r| r.router_retries > 0).count();
        let agree = self.agreement.iter().filter(|a| a.2 == a.3).count();
        let ms = |s: Option<f64>| s.map_or("never".to_owned(), |s| format!("{:.0} ms", s * 1000.0));
        println!("\n== chaos run summary ==");
        println!(
            "timeline (s): kill {} {:.2} | back on ports {:.2} | readmitted {} | stale entries dropped {} | router SIGTERM {:.2}, exited {:.2}, up {:.2} | load stop {:.2}",
            self.victim,
            tl.kill,
            tl.engine_up,
            opt(tl.readmitted),
            opt(tl.stale_cleared),
            tl.router_term,
            tl.router_exited,
            tl.router_up,
            tl.load_stop
        );
        println!(
            "killed mid-pull: {}",
            tl.mid_pull.as_deref().unwrap_or("no (none found in time)")
        );
        println!(
            "| requests | ok | failed, in flight on {} at the kill | failed, other | in flight on {} at the kill |",
            self.victim, self.victim
        );
        println!(
            "| {} | {} | {on_victim} | {} | {in_flight_on_victim} |",
            recs.len(),
            recs.iter().filter(|r| r.ok).count(),
            failed.len() - on_victim
        );
        for (i, r) in self.routers.iter().enumerate() {
            println!(
                "router process {}: retries {} | ejected {} | readmitted {} | upstream connect errors {}",
                i + 1,
                r.retries,
                r.ejected,
                r.readmitted,
                r.upstream_connect
            );
        }
        println!(
            "router down: {router_down} refused connects retried by the client, {waited_router} requests waited ({:.0} ms without a router)",
            (tl.router_up - tl.router_term) * 1000.0
        );
        println!(
            "stale tokens attributed to the restarted engine when readmitted: {} (over the documents used so far)",
            tl.stale_tokens_at_readmit
        );
        println!(
            "TTFT: steady median {:.0} ms (requests started 3 s..kill)",
            steady * 1000.0
        );
        for (what, at, until) in [
            ("engine kill", tl.kill, tl.engine_up),
            ("engine restart", tl.engine_up, tl.router_term),
            ("router restart", tl.router_term, tl.load_stop),
        ] {
            let v = ttfts(recs, at, at + 2.0);
            println!(
                "  after {what:<15} back within 2x steady after {:>8} | first 2 s: median {:.0} ms, max {:.0} ms, n {}",
                ms(recovery(recs, at, until, steady)),
                median(v.clone()).unwrap_or(f64::NAN) * 1000.0,
                v.iter().copied().fold(0.0, f64::max) * 1000.0,
                v.len()
            );
        }
        println!(
            "P2P pulls: {} (deadline {} ms); above 1.024 s: {}, above 2.048 s: {}, above 4.096 s: {}",
            self.pulls.count,
            P2P_TIMEOUT_MS + P2P_PENDING_MS,
            self.pulls.above["1.024"],
            self.pulls.above["2.048"],
            self.pulls.above["4.096"]
        );
        for ((o, r), v) in &self.pulls.by_outcome {
            println!("  pulls {o:<8} reason {r:<14} {v}");
        }
        println!(
            "index agreement: {agree} of {} (endpoint, document) pairs",
            self.agreement.len()
        );
        for (ep, d, claimed, truth) in self.agreement {
            if claimed != truth {
                println!(
                    "  MISMATCH {ep} doc {d}: router says {claimed} tokens, engine holds {truth}"
                );
            }
        }
        for r in &failed {
            println!(
                "  failed {} (doc {}) start {:.2} endpoint {:?}: {}",
                r.id,
                r.doc,
                r.start,
                r.endpoint.as_ref().or(self.decided.get(&r.id)),
                r.error.as_deref().unwrap_or("")
            );
        }
    }

    fn check(&self) {
        let tl = self.tl;
        for r in self.failed() {
            assert!(
                on_victim_at_kill(r, tl, self.victim, self.decided),
                "{} failed but was not in flight on {} at the kill: {r:?}",
                r.id,
                self.victim
            );
            assert!(
                r.start <= tl.kill,
                "{} started after the kill and failed: {r:?}",
                r.id
            );
        }
        assert!(
            self.recs.iter().filter(|r| r.ok).count() > self.recs.len() / 2,
            "most requests must succeed"
        );
        let total_ejected = self.routers[0].ejected;
        assert!(total_ejected >= 1.0, "the dead engine was never ejected");
        for (ep, d, claimed, truth) in self.agreement {
            assert_eq!(claimed, truth, "index disagrees with {ep} on document {d}");
        }
        // A pull stops at its deadline (P2P_TIMEOUT_MS + P2P_PENDING_MS = 1.5 s); the bound
        // allows 2.6 s more for a loaded 2-core machine's scheduling (one histogram bucket up).
        assert_eq!(
            self.pulls.above["4.096"], 0.0,
            "a pull outlived its deadline"
        );
        assert!(
            self.pulls.count > 0.0,
            "no P2P pull happened: the run tested nothing"
        );
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or("-".to_owned(), |v| format!("{v:.2}"))
}
