//! Shared by `hostile_http.rs` and `hostile_events.rs` (issue 37): real `kvmesh` processes with
//! their stderr captured, their addresses read from their startup lines, their peak RSS read from
//! `/proc`; loopback connections from a chosen source address (Linux routes all of 127.0.0.0/8
//! to loopback, so 127.0.0.2 is "another host" to a per-address limit); a raw ZMTP peer.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // each test binary uses a subset

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpSocket, TcpStream};
use tokio::process::Child;
use tokio::time::timeout;

pub const BIN: &str = env!("CARGO_BIN_EXE_kvmesh");

/// One child process with its stderr in a file (shown if it dies).
pub struct Proc {
    pub name: &'static str,
    pub child: Child,
    pub pid: u32,
    pub stderr: std::path::PathBuf,
}

impl Proc {
    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// Peak RSS so far (`VmHWM`).
    pub fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    /// Resets `VmHWM` to the current RSS (`/proc/PID/clear_refs`, value 5), so the next peak is
    /// measured from here.
    pub fn reset_peak(&self) {
        let _ = std::fs::write(format!("/proc/{}/clear_refs", self.pid), "5");
    }

    fn status_kib(&self, field: &str) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Panics with the tail of its stderr if it exited.
    pub fn assert_running(&mut self, after: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(&self.stderr).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(30)..].join("\n");
            panic!(
                "{} exited ({status}) after {after}; stderr tail:\n{tail}",
                self.name
            );
        }
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

/// Starts `kvmesh ARGS` and returns the rest of each stdout line that starts with one of
/// `wanted` (stdout keeps being drained afterwards).
pub async fn spawn(
    name: &'static str,
    args: &[String],
    wanted: &[&str],
    dir: &Path,
) -> (Proc, Vec<String>) {
    let stderr = dir.join(format!("{name}.stderr"));
    let mut child = tokio::process::Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut found: Vec<Option<String>> = vec![None; wanted.len()];
    let waited = timeout(Duration::from_secs(30), async {
        while found.iter().any(Option::is_none) {
            let Some(line) = lines.next_line().await.unwrap() else {
                break;
            };
            for (i, prefix) in wanted.iter().enumerate() {
                if let Some(rest) = line.strip_prefix(prefix) {
                    found[i] = Some(rest.trim().to_owned());
                }
            }
        }
    })
    .await;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let mut proc = Proc {
        name,
        child,
        pid,
        stderr,
    };
    if waited.is_err() || found.iter().any(Option::is_none) {
        proc.assert_running("starting");
        panic!("{name} did not print {wanted:?}");
    }
    (proc, found.into_iter().map(Option::unwrap).collect())
}

/// The arguments of a sim engine on port 0 with 16-token blocks at `time_scale` (`1` = the
/// modelled speed, so a long completion streams for tens of seconds).
pub fn sim_engine_args(time_scale: &str) -> Vec<String> {
    [
        "engine",
        "--port",
        "0",
        "--backend",
        "sim",
        "--served-model-name",
        "sim",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "4096",
        "--time-scale",
        time_scale,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A sim engine (`--time-scale 100`, 16-token blocks) with `extra` arguments; returns it and its
/// HTTP base URL.
pub async fn sim_engine(extra: &[&str], dir: &Path) -> (Proc, String) {
    let mut args = sim_engine_args("100");
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let (proc, found) = spawn("engine", &args, &["kvmesh engine listening on "], dir).await;
    (proc, found[0].clone())
}

/// A sim engine publishing KV events on loopback (bound PUB and replay sockets) with `events`
/// merged into its `--kv-events-config`; returns it, its HTTP URL, PUB and replay endpoints.
pub async fn sim_engine_with_events(
    events: serde_json::Value,
    dir: &Path,
) -> (Proc, String, String, String) {
    sim_engine_with_events_at("100", events, dir).await
}

/// [`sim_engine_with_events`] at `time_scale` (`1`: the modelled speed).
pub async fn sim_engine_with_events_at(
    time_scale: &str,
    events: serde_json::Value,
    dir: &Path,
) -> (Proc, String, String, String) {
    let mut config = serde_json::json!({
        "enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events",
        "endpoint": "tcp://127.0.0.1:0", "bind": true, "replay_endpoint": "tcp://127.0.0.1:0",
    });
    if let (Some(c), Some(e)) = (config.as_object_mut(), events.as_object()) {
        c.extend(e.clone());
    }
    let mut args = sim_engine_args(time_scale);
    args.extend(["--kv-events-config".to_owned(), config.to_string()]);
    let (proc, found) = spawn(
        "engine",
        &args,
        &[
            "kvmesh engine listening on ",
            "kvmesh engine kv events bound on ",
            "kvmesh engine kv events replay bound on ",
        ],
        dir,
    )
    .await;
    let strip = |s: &str| s.split_whitespace().next().unwrap_or(s).to_owned();
    (proc, found[0].clone(), strip(&found[1]), strip(&found[2]))
}

/// `kvmesh router` with `yaml` as its config; returns it and its base URL.
pub async fn router(yaml: &str, dir: &Path) -> (Proc, String) {
    let path = dir.join("router.yaml");
    std::fs::write(&path, yaml).unwrap();
    let args: Vec<String> = vec![
        "router".into(),
        "--port".into(),
        "0".into(),
        "--config".into(),
        path.display().to_string(),
    ];
    let (proc, found) = spawn("router", &args, &["listening on "], dir).await;
    (proc, found[0].clone())
}

/// A TCP connection to `addr` from `source` (an address of this host; on Linux any 127.x.y.z).
pub async fn connect_from(source: &str, addr: &str) -> std::io::Result<TcpStream> {
    let addr: SocketAddr = tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))?;
    let socket = TcpSocket::new_v4()?;
    socket.bind(
        format!("{source}:0")
            .parse()
            .map_err(std::io::Error::other)?,
    )?;
    socket.connect(addr).await
}

/// `host:port` of `http://host:port` or `tcp://host:port`.
pub fn host_port(url: &str) -> String {
    url.split_once("://")
        .map_or(url, |(_, r)| r)
        .trim_end_matches('/')
        .to_owned()
}

/// Reads until the peer closes (true) or `limit` passes (false); what was read is returned too.
pub async fn closed_within(stream: &mut TcpStream, limit: Duration) -> (bool, Vec<u8>) {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    let closed = timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (closed, got)
}

/// The status code of an HTTP response's first line.
pub fn status_code(got: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(got.get(..got.len().min(64))?).ok()?;
    let mut parts = text.split(' ');
    parts.next().filter(|v| v.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

/// One sample of a Prometheus text exposition: the value of the first line that starts with
/// `name` and contains `label` (0 if none).
pub fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

// ---------------------------------------------------------------------------------------------
// Raw ZMTP (3.0, NULL): just enough to be a peer that misbehaves.

/// A ZMTP 3.0 greeting (NULL) followed by a READY naming `socket_type`.
pub fn greeting_and_ready(socket_type: &str) -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    let mut mechanism = b"NULL".to_vec();
    mechanism.resize(20, 0);
    g.extend(mechanism);
    g.push(0);
    g.extend([0u8; 31]);
    let mut body = b"\x05READY".to_vec();
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend((socket_type.len() as u32).to_be_bytes());
    body.extend(socket_type.as_bytes());
    g.extend([0x04, body.len() as u8]);
    g.extend(body);
    g
}

/// Frames of one ZMTP message.
pub fn zmtp_message(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        let more = u8::from(i + 1 < parts.len());
        if p.len() > 255 {
            out.push(more | 0x02);
            out.extend((p.len() as u64).to_be_bytes());
        } else {
            out.push(more);
            out.push(p.len() as u8);
        }
        out.extend_from_slice(p);
    }
    out
}

/// Connects from `source` and completes a ZMTP handshake as `socket_type` (our greeting and
/// READY, then the server's 64-byte greeting and its READY command). `None` if the server closed
/// the connection instead.
pub async fn zmtp_peer(source: &str, addr: &str, socket_type: &str) -> Option<TcpStream> {
    let mut s = connect_from(source, addr).await.ok()?;
    s.write_all(&greeting_and_ready(socket_type)).await.ok()?;
    let mut greeting = [0u8; 64];
    timeout(Duration::from_secs(5), s.read_exact(&mut greeting))
        .await
        .ok()?
        .ok()?;
    // READY: flags, size, body.
    let mut head = [0u8; 2];
    timeout(Duration::from_secs(5), s.read_exact(&mut head))
        .await
        .ok()?
        .ok()?;
    let mut ready = vec![0u8; head[1] as usize];
    timeout(Duration::from_secs(5), s.read_exact(&mut ready))
        .await
        .ok()?
        .ok()?;
    Some(s)
}
