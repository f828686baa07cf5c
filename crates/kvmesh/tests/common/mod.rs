//! Shared by the binary tests: `kvmesh engine` started as a child process on loopback.
#![allow(dead_code)] // each test binary uses a subset

use std::ffi::OsString;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;

pub const BIN: &str = env!("CARGO_BIN_EXE_kvmesh");

/// A running `kvmesh engine` (killed when dropped) and where it listens.
pub struct EngineProcess {
    pub child: Child,
    /// Base URL of its OpenAI API, e.g. `http://127.0.0.1:41234`.
    pub http: String,
    /// Its P2P producer's port, when started with `--p2p-port`.
    pub p2p_port: Option<u16>,
}

/// Starts `kvmesh engine --port 0 ARGS` and waits for its startup lines: the HTTP address, and
/// the P2P address too when ARGS has `--p2p-port`. Its stdout keeps being drained (a closed pipe
/// would fail the engine's later prints).
pub async fn spawn_engine<I, S>(args: I) -> EngineProcess
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let wants_p2p = args.iter().any(|a| a == "--p2p-port");
    let mut child = tokio::process::Command::new(BIN)
        .args(["engine", "--port", "0"])
        .args(&args)
        .env("PYTHONHASHSEED", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut http, mut p2p_port) = (None, None);
    while http.is_none() || (wants_p2p && p2p_port.is_none()) {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("engine exited before listening");
        if let Some(rest) = line.strip_prefix("kvmesh engine listening on ") {
            http = Some(rest.trim().to_owned());
        } else if let Some(rest) = line.strip_prefix("kvmesh engine p2p listening on ") {
            let addr: std::net::SocketAddr = rest.trim().parse().unwrap();
            p2p_port = Some(addr.port());
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    EngineProcess {
        child,
        http: http.unwrap(),
        p2p_port,
    }
}
