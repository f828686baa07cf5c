//! How many times the consumer copies a payload, observed through the allocator: a plain pull
//! into a sink that offers its own memory (`BlockSink::destination`) allocates no payload buffer
//! at all — the kernel's copy from the socket into the sink's memory is the only one, in clear,
//! authenticated and encrypted modes alike — while a sink that takes `Bytes` gets one buffer of
//! exactly the payload's size per block. Own test binary: the allocator is process-wide.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::alloc::System;
use std::sync::Arc;

use bytes::Bytes;
use common::{client_for, fp};
use kvmesh_core::BlockHash;
use kvmesh_transfer::{
    BlockSink, MemorySource, ProducerServer, PullOutcome, Secret, ServerConfig, SinkError, VecSink,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tokio_util::sync::CancellationToken;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const BLOCK: usize = 300 << 10;
const BLOCKS: usize = 24;

/// One reused slot, as a KV cache's memory would be.
struct Slot {
    memory: Vec<u8>,
    written: usize,
}

impl BlockSink for Slot {
    fn accept(&mut self, _: usize, _: BlockHash, _: Bytes) -> Result<(), SinkError> {
        panic!("a plain pull into a sink with memory never hands over a buffer")
    }

    fn destination(&mut self, _: usize, _: BlockHash, len: usize) -> Option<&mut [u8]> {
        Some(&mut self.memory[..len])
    }

    fn accept_written(&mut self, _: usize, _: BlockHash) -> Result<(), SinkError> {
        self.written += 1;
        Ok(())
    }
}

#[test]
fn a_pull_into_sink_memory_allocates_no_payload_buffers() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let hashes: Vec<BlockHash> = (0..BLOCKS as u64).map(|i| BlockHash(0x7000 + i)).collect();
        let source = MemorySource::new(fp());
        for (i, h) in hashes.iter().enumerate() {
            source.insert(*h, Bytes::from(vec![i as u8; BLOCK]));
        }
        let total = (BLOCKS * BLOCK) as u64;
        for (secret, encrypt) in [(None, false), (Some("s"), false), (Some("s"), true)] {
            let config = ServerConfig {
                secret: secret.map(Secret::from),
                encrypt,
                ..ServerConfig::default()
            };
            let cancel = CancellationToken::new();
            let (addr, _task) =
                ProducerServer::bind("127.0.0.1:0", Arc::new(source.clone()), config, cancel.clone())
                    .await
                    .unwrap();
            let client = client_for(addr, |c| {
                c.secret = secret.map(Secret::from);
                c.encrypt = encrypt;
            });
            let mut slot = Slot {
                memory: vec![0; BLOCK],
                written: 0,
            };
            // Warm up: connection pooled, buffers (and an encrypting producer's staging) grown.
            let report = client.pull(addr, "warm", &hashes[..2], &mut slot).await;
            assert_eq!(report.outcome, PullOutcome::Complete);

            let region = Region::new(GLOBAL);
            let report = client.pull(addr, "r", &hashes, &mut slot).await;
            let into_memory = region.change().bytes_allocated as u64;
            eprintln!("secret {secret:?} encrypt {encrypt}: {into_memory} B allocated for {total} B into sink memory");
            assert_eq!(report.outcome, PullOutcome::Complete);
            assert_eq!(slot.written, BLOCKS + 2);
            assert!(
                into_memory < total / 16,
                "secret {secret:?} encrypt {encrypt}: {into_memory} bytes allocated to pull \
                 {total} bytes into the sink's memory"
            );

            let region = Region::new(GLOBAL);
            let mut taker = VecSink::default();
            let report = client.pull(addr, "r", &hashes, &mut taker).await;
            let handed_over = region.change().bytes_allocated as u64;
            assert_eq!(report.outcome, PullOutcome::Complete);
            assert!(
                handed_over >= total,
                "one buffer per block handed to `accept`: {handed_over} < {total}"
            );
            assert!(handed_over < total + total / 16, "and nothing more: {handed_over}");
            cancel.cancel();
        }
    });
}
