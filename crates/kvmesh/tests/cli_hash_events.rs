//! The `kvmesh hash` and `kvmesh events listen` commands, run as the built binary.
//!
//! `hash` must reproduce every golden vLLM digest; `events listen` is driven by a libzmq PUB socket
//! (the library vLLM's pyzmq wraps) in both directions, with a deliberate sequence gap and garbage
//! frames.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use kvmesh_core::events::{
    BlockRemoved, BlockStored, EventBatch, EventEncoding, EventFrame, KvEvent, Medium, encode_batch,
};
use kvmesh_core::hashing::BlockHash;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::sync::mpsc;
use tokio::time::timeout;

/// A libzmq PUB socket; its sends never block (PUB drops at its high-water mark).
struct PubSocket(zmq::Socket);

impl PubSocket {
    fn new() -> PubSocket {
        let ctx = zmq::Context::new();
        let s = ctx.socket(zmq::PUB).unwrap();
        s.set_linger(0).unwrap();
        PubSocket(s)
    }

    async fn send(&mut self, parts: Vec<Vec<u8>>) -> zmq::Result<()> {
        self.0.send_multipart(parts, zmq::DONTWAIT)
    }
}

type ZmqMessage = Vec<Vec<u8>>;

const BIN: &str = env!("CARGO_BIN_EXE_kvmesh");

fn fixture(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `kvmesh hash ARGS` over `tokens` (JSON): one JSON object per block; the command must succeed.
fn hash_lines(args: &[&str], tokens: &str) -> Vec<serde_json::Value> {
    let out = run_hash(args, tokens);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn run_hash(args: &[&str], stdin: &str) -> std::process::Output {
    let mut child = Command::new(BIN)
        .arg("hash")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn hash_reproduces_every_golden_digest() {
    let mut cases = 0;
    for file in ["golden2.json", "golden2_defaultseed.json"] {
        let g = fixture(file);
        let bs = g["block_size"].to_string();
        for case in g["cases"].as_array().unwrap() {
            let algo = case["algo"].as_str().unwrap();
            if algo == "sha256" {
                continue;
            }
            let mut args = vec!["--block-size", bs.as_str(), "--algo", algo];
            let none_hash = case["none_hash"].as_str().unwrap();
            match case["seed"].as_str() {
                Some(seed) => args.extend(["--seed", seed]),
                // vLLM's unseeded xxhash_cbor NONE_HASH is random: follow the recorded one.
                None if algo == "xxhash_cbor" => args.extend(["--none-hash", none_hash]),
                None => {}
            }
            let lines = hash_lines(&args, &case["tokens"].to_string());
            let blocks = case["blocks"].as_array().unwrap();
            assert_eq!(lines.len(), blocks.len(), "{file} {algo}");
            for (i, (line, g)) in lines.iter().zip(blocks).enumerate() {
                assert_eq!(line["index"], i);
                assert_eq!(line["hex"], g["hex"], "{file} {algo} block {i}");
                assert_eq!(line["u64"], g["u64"], "{file} {algo} block {i}");
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 16);
}

/// `--cache-salt` and `--lora NAME=PATH` reproduce the digests vLLM's own hasher computed for
/// salted and LoRA requests (`hash_extra_keys.json`).
#[test]
fn hash_reproduces_salted_and_lora_digests() {
    let g = fixture("hash_extra_keys.json");
    let tokens = g["tokens"].to_string();
    let mut cases = 0;
    for case in g["cases"].as_array().unwrap() {
        let bs = case["block_size"].to_string();
        let mut args: Vec<String> = vec!["--block-size".into(), bs];
        if let Some(seed) = case["seed"].as_str() {
            args.extend(["--seed".into(), seed.into()]);
        }
        if let Some(salt) = case["cache_salt"].as_str() {
            args.extend(["--cache-salt".into(), salt.into()]);
        }
        if let Some(l) = case["lora"].as_object() {
            let spec = format!(
                "{}={}",
                l["name"].as_str().unwrap(),
                l["path"].as_str().unwrap()
            );
            args.extend(["--lora".into(), spec]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let lines = hash_lines(&args, &tokens);
        let blocks = case["blocks"].as_array().unwrap();
        assert_eq!(lines.len(), blocks.len());
        for (line, want) in lines.iter().zip(blocks) {
            assert_eq!(line["hex"], want["hex"], "{}", case["name"]);
        }
        cases += 1;
    }
    assert_eq!(cases, 24);
    let bad = run_hash(&["--lora", "no-path"], "[1]");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("NAME=PATH"));
}

#[test]
fn hash_output_shape_and_partial_blocks() {
    let out = run_hash(&["--block-size", "4", "--seed", "0"], "[1,2,3,4,5,6,7,8,9]");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "only full blocks are hashed");
    assert!(
        lines[0].starts_with(r#"{"index":0,"hex":""#),
        "{}",
        lines[0]
    );
}

#[test]
fn hash_refuses_pickle_and_bad_input_with_reasons() {
    let out = run_hash(&["--algo", "sha256"], "[1,2]");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pickle") && err.contains("sha256_cbor"),
        "{err}"
    );

    let out = run_hash(&[], "[1, -5]");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("token 1"));

    let out = run_hash(&["--algo", "xxhash_cbor"], "[1]");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("random per-process"));
}

// ------------------------------------------------------------------------------------------------
// events listen
// ------------------------------------------------------------------------------------------------

fn stored(tag: u64, parent: Option<u64>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: vec![BlockHash(u64::MAX - tag), BlockHash(tag)],
        parent_block_hash: parent.map(BlockHash),
        token_ids: (0..8).collect(),
        block_size: 4,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        kv_cache_spec_sliding_window: None,
        cache_salt: None,
    })
}

fn removed(tag: u64) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![BlockHash(tag)],
        medium: Medium::Cpu,
        group_idx: Some(0),
    })
}

fn message(seq: u64, events: Vec<KvEvent>) -> ZmqMessage {
    let batch = EventBatch {
        ts: 1700000000.5,
        events,
        data_parallel_rank: Some(0),
    };
    raw(seq, encode_batch(&batch, EventEncoding::Map))
}

fn raw(seq: u64, payload: Vec<u8>) -> ZmqMessage {
    let frame = EventFrame {
        topic: "kv-events".into(),
        seq,
        payload: payload.into(),
    };
    frame.to_parts().iter().map(|p| p.to_vec()).collect()
}

/// A running `kvmesh events listen`, its stderr lines forwarded to a channel.
struct Listener {
    child: tokio::process::Child,
    stderr: mpsc::UnboundedReceiver<String>,
    seen_stderr: Vec<String>,
}

impl Listener {
    fn start(args: &[&str]) -> Listener {
        let mut child = tokio::process::Command::new(BIN)
            .args(["events", "listen"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("KVMESH_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let err = child.stderr.take().unwrap();
        tokio::spawn(async move {
            let mut lines = BufReader::new(err).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let _ = tx.send(l);
            }
        });
        Listener {
            child,
            stderr: rx,
            seen_stderr: Vec::new(),
        }
    }

    /// Waits for a stderr line containing `needle`; returns it.
    async fn stderr_line(&mut self, needle: &str) -> String {
        let wait = async {
            while let Some(l) = self.stderr.recv().await {
                self.seen_stderr.push(l.clone());
                if l.contains(needle) {
                    return l;
                }
            }
            panic!("stderr closed before {needle:?}: {:?}", self.seen_stderr);
        };
        timeout(Duration::from_secs(15), wait)
            .await
            .expect("stderr line in time")
    }

    /// Sends empty batches until the listener reports its first batch; returns the next seq.
    async fn warm_up(&mut self, publisher: &mut PubSocket) -> u64 {
        let mut seq = 0;
        let mut wait = Box::pin(self.stderr_line("first batch seq"));
        loop {
            publisher.send(message(seq, vec![])).await.unwrap();
            seq += 1;
            tokio::select! {
                _ = &mut wait => break,
                _ = tokio::time::sleep(Duration::from_millis(30)) => {}
            }
        }
        drop(wait);
        seq
    }

    /// Waits for exit; returns (stdout lines, all stderr lines).
    async fn finish(mut self) -> (Vec<serde_json::Value>, Vec<String>) {
        let mut out = String::new();
        let mut stdout = self.child.stdout.take().unwrap();
        let status = timeout(Duration::from_secs(15), async {
            stdout.read_to_string(&mut out).await.unwrap();
            self.child.wait().await.unwrap()
        })
        .await
        .expect("listener exits after --count events");
        assert!(status.success());
        while let Ok(Some(l)) = timeout(Duration::from_secs(5), self.stderr.recv()).await {
            self.seen_stderr.push(l);
        }
        let lines = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (lines, self.seen_stderr)
    }
}

/// After warm-up at `seq`: a 2-event batch, a skipped seq, garbage frames, then 2 more events.
async fn send_script(publisher: &mut PubSocket, seq: u64) {
    publisher
        .send(message(seq, vec![stored(1, None), removed(2)]))
        .await
        .unwrap();
    // seq + 1 deliberately never sent.
    publisher
        .send(message(seq + 2, vec![KvEvent::AllBlocksCleared]))
        .await
        .unwrap();
    publisher
        .send(vec![b"kv-events but a single part".to_vec()])
        .await
        .unwrap();
    publisher
        .send(raw(seq + 3, b"\xc1\xff garbage".to_vec()))
        .await
        .unwrap();
    publisher
        .send(message(seq + 4, vec![stored(3, Some(7))]))
        .await
        .unwrap();
}

fn check_run(lines: &[serde_json::Value], stderr: &[String], seq: u64) {
    let err = stderr.join("\n");
    assert_eq!(lines.len(), 4, "--count 4; stderr:\n{err}");
    let s = &lines[0];
    assert_eq!(s["seq"], seq);
    assert_eq!(s["topic"], "kv-events");
    assert_eq!(s["ts"], 1700000000.5);
    assert_eq!(s["dp_rank"], 0);
    assert_eq!(s["type"], "BlockStored");
    assert_eq!(s["medium"], "GPU");
    assert_eq!(s["block_hashes"], serde_json::json!([u64::MAX - 1, 1u64]));
    assert!(s["parent"].is_null());
    assert_eq!(s["token_ids"], serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7]));
    assert_eq!(s["block_size"], 4);
    assert_eq!(lines[1]["type"], "BlockRemoved");
    assert_eq!(lines[1]["medium"], "CPU");
    assert_eq!(lines[2]["type"], "AllBlocksCleared");
    assert_eq!(lines[2]["seq"], seq + 2);
    assert_eq!(lines[3]["parent"], 7);
    assert_eq!(lines[3]["seq"], seq + 4);
    assert!(
        err.contains(&format!("expected seq {}, got {}", seq + 1, seq + 2)),
        "gap reported:\n{err}"
    );
    assert_eq!(err.matches("malformed message").count(), 2, "{err}");
    assert!(err.contains(&format!("(seq {})", seq + 3)), "{err}");
    assert!(
        err.contains("4 events") && err.contains("1 gaps") && err.contains("2 malformed"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[tokio::test]
async fn events_listen_connects_to_a_binding_publisher() {
    let mut publisher = PubSocket::new();
    publisher.0.bind("tcp://127.0.0.1:0").unwrap();
    let ep = publisher.0.get_last_endpoint().unwrap().unwrap();
    let mut listener = Listener::start(&[ep.as_str(), "--count", "4", "--topic", "kv"]);
    let seq = listener.warm_up(&mut publisher).await;
    send_script(&mut publisher, seq).await;
    let (lines, stderr) = listener.finish().await;
    check_run(&lines, &stderr, seq);
}

#[tokio::test]
async fn events_listen_binds_for_a_connecting_publisher() {
    let mut listener = Listener::start(&["tcp://127.0.0.1:0", "--bind", "--count", "4"]);
    let line = listener.stderr_line("events: bound ").await;
    let ep = line.rsplit(' ').next().unwrap().to_owned();
    assert!(
        ep.starts_with("tcp://127.0.0.1:") && !ep.ends_with(":0"),
        "{line}"
    );
    let mut publisher = PubSocket::new();
    publisher.0.connect(&ep).unwrap();
    let seq = listener.warm_up(&mut publisher).await;
    send_script(&mut publisher, seq).await;
    let (lines, stderr) = listener.finish().await;
    check_run(&lines, &stderr, seq);
}
