//! P/D disaggregation and bi-directional KV transfer, layered on the P2P request hook
//! (`docs/architecture.md#pd-disaggregation`; the exact keys are in
//! `docs/protocols.md#pd-and-bi-directional-transfer`).
//!
//! [`PdHook`] wraps [`P2pHook`]: every call runs the P2P hook first (a `remote_kv_source` pull,
//! the sim's wait for pulls in flight, releasing pull pins), then adds P/D's own behaviour from
//! `kv_transfer_params` (classified by [`classify`]):
//!
//! - **Decode leg** (`do_remote_prefill: true` + `remote_host`/`remote_port`): pull the prompt KV
//!   from the prefiller's P2P producer (allow-list applies) so only the last partial block / last
//!   token is computed here. Any failure → recompute, never an error.
//! - **History read** (`do_remote_decode: true` + `remote_host`/`remote_port`, i.e. a decoder's
//!   bi-directional params attached to the next turn's prefill leg; needs
//!   `--bidirectional-kv-xfer` here): load `min(remote_num_tokens, prompt) − local` tokens from the
//!   decoder unless fewer than `--kv-recompute-threshold`; an expired entry is declined ("Declining
//!   expired remote read", `vllm:nixl_num_kv_expired_reqs`). Prefix equality is by block hash: our
//!   prompt's block hashes are compared with the `remote_block_ids` the decoder returned, and only
//!   the leading run that matches is read (a template that dropped earlier generated text
//!   mismatches at the first differing block; the rest is computed).
//! - A `remote_kv_source` that accompanies P/D keys (a prefill leg whose router named a decoder's
//!   CPU tier as source) is the P2P hook's pull; the P/D read then finds those blocks local.
//!
//! On finish:
//! - a **prefill leg** (`do_remote_decode: true`, not itself a decode leg) pins its full prompt
//!   blocks in the CPU tier for `--decoder-kv-blocks-ttl` and returns the decoder's params
//!   (`do_remote_prefill: true`, `remote_block_ids`, `remote_host`/`remote_port` = this engine's
//!   P2P producer, `remote_request_id`, `remote_num_tokens`, `tp_size`, `remote_blocks_expiry_time`);
//! - with `--bidirectional-kv-xfer`, a **decode leg** (or any request on a `--role decode`
//!   engine) pins every computed full block — prompt and generated tokens — for the TTL and
//!   returns `do_remote_decode: true` with their ids, `remote_num_tokens`, expiry and address.
//!
//! `remote_block_ids` are the engine's block hashes (`BlockHash`, the KV-event value, as JSON
//! integers): peers identify blocks by hash, never by slot id. Blocks were already offloaded to
//! the CPU tier (write-through) and published as `BlockStored` CPU when computed; the pin keeps
//! them there. The pins are *retentions* ([`crate::cpu_tier::PinKind::Retain`]): a read of a
//! retained block by the request it was kept for (its `remote_request_id` as the `Lookup`'s
//! `kv_request_id`, recorded in [`Handoffs`]) releases one (the reader came, as vLLM frees a
//! request's blocks once its decoder read them), reads by anyone else release nothing, the rest
//! expire; under pressure retained blocks are evicted after unprotected ones, so a prefiller
//! pinning every prompt never makes its own pulls (history reads) fail for want of room — a
//! reader that comes too late recomputes.

use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, KvTransferParams};

use crate::config::{AdvertisedAddr, Role};
use crate::cpu_tier::PinKind;
use crate::engine::{EngineHandle, EngineRequest, FinishInfo};
use crate::metrics::{PdReadLabel, PdRetainLabel};
use crate::p2p::{Handoffs, P2pHook, ReadOptions, ReadOutcome, RemoteRead, unix_now};
use crate::request_hook::RequestHook;

/// What kind of P/D request the params describe.
#[derive(Debug, Clone, PartialEq)]
enum PdLeg {
    /// Not a P/D request (or nothing we act on).
    None,
    /// Prefill leg: compute, keep the prompt blocks for the decoder, return its params.
    /// `history` is the previous turn's decoder params when the router attached them.
    Prefill { history: Option<RemoteRead> },
    /// Decode leg: read the prompt KV from the prefiller first.
    Decode { read: Option<RemoteRead> },
}

/// Classifies a request's params (pure; unit-tested).
fn classify(p: &KvTransferParams) -> PdLeg {
    if p.do_remote_prefill == Some(true) {
        PdLeg::Decode {
            read: RemoteRead::from_pd_params(p),
        }
    } else if p.do_remote_decode == Some(true) {
        PdLeg::Prefill {
            history: RemoteRead::from_pd_params(p),
        }
    } else {
        PdLeg::None
    }
}

/// The P/D request hook, around the P2P one: see the module docs.
#[derive(Debug, Clone)]
pub struct PdHook {
    p2p: P2pHook,
    /// Which reader each retention is for (shared with the producer, which releases them).
    handoffs: Arc<Handoffs>,
    /// This engine's P2P producer address as advertised in returned params (None: no producer,
    /// nothing can be served, so no params are returned).
    advertised: Option<AdvertisedAddr>,
    engine_id: String,
}

impl PdHook {
    /// P/D around `p2p`. `handoffs` is the ledger the producer reads; `advertised` is the
    /// producer's address as peers reach it (`--advertise-host` and the bound port; see
    /// [`crate::config::resolve_advertise_host`]), never a wildcard bind address.
    pub fn new(p2p: P2pHook, handoffs: Arc<Handoffs>, advertised: Option<AdvertisedAddr>) -> Self {
        let engine_id = advertised
            .as_ref()
            .map_or_else(|| "kvmesh".to_owned(), |a| format!("kvmesh-{a}"));
        Self {
            p2p,
            handoffs,
            advertised,
            engine_id,
        }
    }

    /// Reads blocks of `req.prompt` from `read.source` through the one remote-read path
    /// ([`P2pConsumer::read`]), not at all if fewer than `threshold` tokens would be read, and
    /// counts it. Returns the outcome label.
    async fn read_remote(
        &self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        read: &RemoteRead,
        leg: &'static str,
        threshold: usize,
    ) -> &'static str {
        let m = &engine.metrics().pd;
        let opts = ReadOptions {
            threshold_tokens: threshold,
            // A P/D read names this request's blocks on one peer: no sharing with other pulls.
            share_inflight: false,
            background: false,
        };
        match self.p2p.consumer.read(engine, req, read, opts).await {
            ReadOutcome::Expired => {
                m.expired_reqs.inc();
                "expired"
            }
            ReadOutcome::NothingMissing { mismatch: true } => "mismatch",
            ReadOutcome::NothingMissing { mismatch: false } | ReadOutcome::WaitedOut => {
                "nothing_missing"
            }
            ReadOutcome::BelowThreshold => "below_threshold",
            ReadOutcome::Pulled {
                pull,
                wanted,
                mismatch,
            } => {
                let bs = engine.kv_layout().block_size.max(1);
                m.remote_read_tokens
                    .get_or_create(&PdReadLabel {
                        leg,
                        outcome: "pulled",
                    })
                    .inc_by((pull.report.blocks * bs) as u64);
                if pull.report.blocks == 0 {
                    "failed"
                } else if pull.report.blocks < wanted {
                    "partial"
                } else if mismatch {
                    "mismatch_partial_read"
                } else {
                    "pulled"
                }
            }
        }
    }

    /// Pins `hashes` (leading stored run) for the TTL and builds the params naming them.
    fn retain(
        &self,
        engine: &EngineHandle,
        req: &EngineRequest,
        hashes: &[BlockHash],
        num_tokens: usize,
        role: &'static str,
    ) -> Option<KvTransferParams> {
        let addr = self.advertised.as_ref()?;
        let ttl = engine.config().p2p.decoder_kv_blocks_ttl;
        let until = Instant::now() + ttl;
        let n = engine.cpu_tier().pin(PinKind::Retain, hashes, until);
        // Only this request's reader may release these retentions (a peer's read of the same
        // blocks under another request id leaves them held): see `p2p::Handoffs`.
        self.handoffs.record(&req.request_id, &hashes[..n], until);
        let m = &engine.metrics().pd;
        m.retained.get_or_create(&PdRetainLabel { role }).inc();
        m.retained_blocks
            .get_or_create(&PdRetainLabel { role })
            .inc_by(n as u64);
        let ids: Vec<serde_json::Value> = hashes[..n].iter().map(|h| h.0.into()).collect();
        Some(KvTransferParams {
            remote_engine_id: Some(self.engine_id.clone().into()),
            remote_block_ids: Some(ids.into()),
            remote_request_id: Some(req.request_id.clone()),
            // Bare host (no IPv6 brackets): vLLM's NIXL params carry host and port apart.
            remote_host: Some(addr.host.clone().into()),
            remote_port: Some(addr.port.into()),
            tp_size: Some(1),
            remote_num_tokens: Some(num_tokens as u64),
            remote_blocks_expiry_time: Some(unix_now() + ttl.as_secs_f64()),
            ..Default::default()
        })
    }
}

impl RequestHook for PdHook {
    fn before_submit<'a>(
        &'a self,
        engine: &'a EngineHandle,
        req: &'a mut EngineRequest,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // P2P first (e.g. a router naming a decoder's CPU tier as source for a prefill leg):
            // the P/D read below then finds those blocks local.
            self.p2p.before_submit(engine, req).await;
            let Some(params) = req.kv_transfer_params.clone() else {
                return;
            };
            let cfg = &engine.config().p2p;
            let (leg, read, threshold) = match classify(&params) {
                PdLeg::None => return,
                // P→D: the decoder computes nothing it was given (no threshold).
                PdLeg::Decode { read } => ("decode", read, 0),
                PdLeg::Prefill { history: None } => return,
                PdLeg::Prefill { history: Some(_) } if !cfg.bidirectional_kv_xfer => {
                    engine.metrics().pd.read("history", "bidirectional_off");
                    return;
                }
                PdLeg::Prefill { history } => ("history", history, cfg.kv_recompute_threshold),
            };
            let outcome = match read {
                Some(read) => self.read_remote(engine, req, &read, leg, threshold).await,
                None => "no_address",
            };
            engine.metrics().pd.read(leg, outcome);
        })
    }

    fn on_not_submitted(&self, engine: &EngineHandle, req: &EngineRequest) {
        self.p2p.on_not_submitted(engine, req);
    }

    fn on_finish(&self, engine: &EngineHandle, req: &EngineRequest, info: &mut FinishInfo) {
        self.p2p.on_finish(engine, req, info);
        let cfg = &engine.config().p2p;
        let bs = engine.kv_layout().block_size.max(1);
        // No params: a decode-only request (a `--role decode` engine still retains it).
        let leg = req
            .kv_transfer_params
            .as_ref()
            .map_or(PdLeg::None, classify);
        if matches!(leg, PdLeg::Prefill { .. }) && cfg.role != Role::Decode {
            let mut hashes = engine.salted_block_hashes(&req.prompt, req.cache_salt.as_deref());
            hashes.truncate(req.prompt.len() / bs);
            if let Some(mut p) = self.retain(engine, req, &hashes, req.prompt.len(), "prefill") {
                p.do_remote_prefill = Some(true);
                p.do_remote_decode = Some(false);
                info.kv_transfer_params = Some(p);
            }
        } else if cfg.bidirectional_kv_xfer
            && (matches!(leg, PdLeg::Decode { .. }) || cfg.role == Role::Decode)
        {
            // Prompt and generated tokens: every full block this request computed.
            let hashes = if info.block_hashes.is_empty() {
                let mut h = engine.salted_block_hashes(&req.prompt, req.cache_salt.as_deref());
                h.truncate(req.prompt.len() / bs);
                h
            } else {
                info.block_hashes.clone()
            };
            let tokens = info.prompt_tokens.max(req.prompt.len()) + info.completion_tokens;
            if let Some(mut p) = self.retain(engine, req, &hashes, tokens, "decode") {
                p.do_remote_decode = Some(true);
                p.do_remote_prefill = Some(false);
                info.kv_transfer_params = Some(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn params(v: serde_json::Value) -> KvTransferParams {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn prefill_leg_without_history_is_a_plain_prefill() {
        let p = KvTransferParams::prefill_leg();
        assert_eq!(classify(&p), PdLeg::Prefill { history: None });
        assert_eq!(classify(&KvTransferParams::default()), PdLeg::None);
    }

    #[test]
    fn decode_leg_names_the_prefiller() {
        let p = params(json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_host": "127.0.0.1", "remote_port": 7000, "remote_request_id": "r1",
            "remote_block_ids": [5, 6], "remote_num_tokens": 40, "remote_blocks_expiry_time": 9.0}));
        let PdLeg::Decode { read: Some(r) } = classify(&p) else {
            panic!("not a decode leg");
        };
        assert_eq!(r.source.remote_port, 7000);
        assert_eq!(r.source.kv_request_id, "r1");
        assert_eq!(r.block_ids, Some(vec![BlockHash(5), BlockHash(6)]));
        assert_eq!(r.num_tokens, Some(40));
    }

    #[test]
    fn prefill_leg_merged_with_decoder_history_reads_it() {
        let mut p = KvTransferParams::prefill_leg();
        p.remote_host = Some(json!("10.0.0.2"));
        p.remote_port = Some(json!(7777));
        assert!(matches!(
            classify(&p),
            PdLeg::Prefill {
                history: Some(RemoteRead { .. })
            }
        ));
        // A bad port is no address: nothing is read.
        p.remote_port = Some(json!(70000));
        assert_eq!(classify(&p), PdLeg::Prefill { history: None });
    }
}
