//! Length bombs against a real producer, with this test process's peak virtual memory
//! measured: a frame header claiming 2^62 bytes (read as its first 4 bytes, 1 GiB), `u32::MAX`
//! bytes, or just over the 4 KiB pre-authentication bound must be refused from the header alone,
//! before and after the handshake, without the producer reserving the claimed size. A reserve of
//! 1 GiB maps 1 GiB of address space even if never touched, so `VmPeak` (Linux) shows it where
//! resident memory would not. Own test binary, one test: the peak is process-wide.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bounded, eventually, handshake_raw, hashes, start_producer};
use kvmesh_transfer::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Peak virtual memory of this process in bytes (`None` off Linux).
fn vm_peak() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmPeak:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Send `bytes` on a fresh connection (optionally after the handshake) and wait until the
/// producer closes it.
async fn bomb(addr: std::net::SocketAddr, bytes: &[u8], after_handshake: bool) {
    if after_handshake {
        let mut conn = handshake_raw(addr).await;
        conn.write_raw(bytes).await.unwrap();
        // The producer answers with an Error frame (or nothing) and closes.
        while let Ok(Some(_)) = bounded(conn.read_message()).await {}
    } else {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(bytes).await.unwrap();
        let mut rest = Vec::new();
        let _ = bounded(s.read_to_end(&mut rest)).await;
    }
}

#[tokio::test]
async fn length_headers_claiming_huge_frames_never_allocate_them() {
    let p = start_producer(&hashes(1), ServerConfig::default()).await;
    let two_to_62 = (1u64 << 62).to_be_bytes();
    let mut just_over_preauth = (4097u32).to_be_bytes().to_vec();
    just_over_preauth.extend_from_slice(&[1; 64]);
    let bombs: [(&[u8], bool); 5] = [
        (&two_to_62, false),
        (&[0xff, 0xff, 0xff, 0xff, 1], false),
        (&just_over_preauth, false),
        // After the handshake the configured 64 MiB bound applies: 1 GiB and 4 GiB still fail.
        (&two_to_62, true),
        (&[0xff, 0xff, 0xff, 0xff, 9], true),
    ];
    // Warm up the paths (runtime, buffers, allocator arenas) before taking the baseline.
    let _ = handshake_raw(p.addr).await;
    let before = vm_peak();
    for (bytes, after) in bombs {
        bomb(p.addr, bytes, after).await;
    }
    eventually("every bomb counted as a protocol error", || {
        p.metrics.protocol_errors(kvmesh_transfer::Direction::Out) == 5
    })
    .await;
    assert_eq!(p.metrics.refused("oversized_frame"), 3, "the pre-auth ones");
    if let (Some(before), Some(after)) = (before, vm_peak()) {
        // Read buffers are 64 KiB plus read-ahead; the smallest bomb claims 1 GiB.
        let grew = after.saturating_sub(before);
        assert!(
            grew < 256 << 20,
            "peak virtual memory grew by {grew} bytes while refusing length bombs"
        );
    }
    // Still serving.
    let _conn = handshake_raw(p.addr).await;
}
