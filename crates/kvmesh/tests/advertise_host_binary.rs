//! `kvmesh engine --advertise-host` as the built binary: bound on 0.0.0.0 with a P2P producer that
//! serves peers beyond loopback and no advertised host, it exits non-zero naming the flag; with
//! one, it starts and announces the producer at that host.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::timeout;

const BIN: &str = env!("CARGO_BIN_EXE_kvmesh");

/// A protected producer on all interfaces (the secret satisfies the earlier
/// `--p2p-secret-file`/`--p2p-allowed-consumers` rule, so only the address is missing).
fn args(secret: &std::path::Path) -> Vec<std::ffi::OsString> {
    let mut a: Vec<std::ffi::OsString> = [
        "engine",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--p2p-port",
        "0",
        "--role",
        "prefill",
        "--num-gpu-blocks",
        "64",
        "--cpu-offload-bytes",
        "16MiB",
        "--p2p-secret-file",
    ]
    .map(Into::into)
    .to_vec();
    a.push(secret.into());
    a
}

fn secret_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let path = dir.path().join("p2p-secret");
    std::fs::write(&path, "s3cret\n").unwrap();
    path
}

#[tokio::test]
async fn an_engine_on_all_interfaces_without_an_advertised_host_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(BIN)
            .args(args(&secret_file(&dir)))
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the engine must refuse, not start")
    .unwrap();
    assert!(!out.status.success(), "{:?}", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--advertise-host") && stderr.contains("0.0.0.0"),
        "{stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("listening"),
        "nothing was bound"
    );
}

#[tokio::test]
async fn an_engine_with_an_advertised_host_announces_its_producer_there() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd_args = args(&secret_file(&dir));
    cmd_args.extend(["--advertise-host", "127.0.0.2"].map(Into::into));
    let mut child = tokio::process::Command::new(BIN)
        .args(cmd_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut bound, mut advertised) = (None, None);
    timeout(Duration::from_secs(30), async {
        while advertised.is_none() {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("engine exited before announcing its producer");
            if let Some(rest) = line.strip_prefix("kvmesh engine p2p listening on ") {
                bound = Some(rest.trim().parse::<std::net::SocketAddr>().unwrap());
            } else if let Some(rest) = line.strip_prefix("kvmesh engine p2p advertised as ") {
                advertised = Some(rest.trim().to_owned());
            }
        }
    })
    .await
    .unwrap();
    let bound = bound.expect("the bound address comes first");
    assert!(bound.ip().is_unspecified(), "{bound}");
    assert_eq!(advertised.unwrap(), format!("127.0.0.2:{}", bound.port()));
    child.kill().await.unwrap();
}
