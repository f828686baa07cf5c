//! The `sim` backend: no arithmetic. Each step sleeps (on the compute thread) for the time the
//! named [`SimProfile`] gives, divided by `time_scale`; KV payloads are real bytes whose content
//! is a deterministic function of the block hash ([`sim_block_payload`]) so a P2P receiver can
//! verify them ([`verify_sim_block_payload`]); sampled tokens depend only on (seed, sequence,
//! position).

use std::time::Duration;

use kvmesh_core::{BlockHash, TokenId};

use super::profiles::SimProfile;
use super::sim_link::SimLink;
use super::{
    BackendCapabilities, BlockId, ComputeBackend, ComputeError, HostRestoreCost, KvArena, KvLayout,
    ModelledLink, SeqStep,
};

/// Token the sim never samples unless asked (it generates text until `max_tokens`).
const SIM_EOS: TokenId = 256;
/// What the sim "says": lowercase letters and spaces (readable, single-byte tokens).
const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz   ";

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with the sim payload of block `hash` (a splitmix64 stream seeded by the hash).
fn fill_sim_block_payload(hash: BlockHash, out: &mut [u8]) {
    let mut state = hash.0;
    for chunk in out.chunks_mut(8) {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let v = splitmix64(state).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// The `len`-byte sim payload of block `hash`.
pub fn sim_block_payload(hash: BlockHash, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_sim_block_payload(hash, &mut v);
    v
}

/// True when `payload` is exactly what the sim backend writes for `hash`.
pub fn verify_sim_block_payload(hash: BlockHash, payload: &[u8]) -> bool {
    let mut state = hash.0;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(state)
    };
    // Whole words compared as integers: a P2P receiver checks every byte it lands, and a
    // slice compare per 8 bytes (a memcmp call each) cost ~11 % of a real-size pull.
    let mut words = payload.chunks_exact(8);
    let whole = words.by_ref().all(|w| {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        u64::from_le_bytes(b) == next()
    });
    let tail = words.remainder();
    whole && (tail.is_empty() || tail == &next().to_le_bytes()[..tail.len()])
}

/// Settings of a sim backend.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub profile: &'static SimProfile,
    /// Divides every modelled duration (e.g. 100 → 100× faster than the modelled GPU).
    pub time_scale: f64,
    pub kv_bytes_per_token: usize,
    pub block_size: usize,
    /// Model id carried in the fingerprint (peers must match).
    pub model_id: String,
    /// What a P2P transfer costs (`--sim-link`).
    pub link: SimLink,
    /// How a host-to-device restore is charged (`--sim-h2d`).
    pub h2d: SimH2d,
}

/// How the sim charges a host-to-device restore from the CPU tier (`--sim-h2d`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SimH2d {
    /// On a copy engine beside compute, as vLLM's offloading connector loads on its own CUDA
    /// stream: only the requests needing the copied blocks wait; concurrent copies queue on the
    /// host link.
    #[default]
    Overlap,
    /// Added to the next step, so every request in that batch waits for the copy (the model
    /// before `overlap` existed; kept to compare against).
    Step,
}

impl std::str::FromStr for SimH2d {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "overlap" => Ok(Self::Overlap),
            "step" => Ok(Self::Step),
            other => Err(format!("unknown --sim-h2d `{other}` (overlap, step)")),
        }
    }
}

/// Time-modelled backend (see module docs).
#[derive(Debug)]
pub struct SimBackend {
    cfg: SimConfig,
    /// Sleep the modelled time (false in unit tests that only check the model).
    sleep: bool,
    last_step: Duration,
    total_modelled: Duration,
    /// Modelled host-to-device copy time of CPU-tier restores, charged to the next step.
    pending_restore_ms: f64,
}

/// Host-to-device bandwidth used to price CPU-tier restores (H200 on PCIe Gen5 x16 reaches about
/// 50 GB/s in practice).
pub const SIM_H2D_BYTES_PER_SEC: f64 = 50e9;

impl SimBackend {
    pub fn new(cfg: SimConfig) -> Self {
        Self {
            cfg,
            sleep: true,
            last_step: Duration::ZERO,
            total_modelled: Duration::ZERO,
            pending_restore_ms: 0.0,
        }
    }

    /// A backend that computes modelled times but never sleeps (tests).
    pub fn without_sleep(cfg: SimConfig) -> Self {
        Self {
            sleep: false,
            ..Self::new(cfg)
        }
    }

    pub fn profile(&self) -> &'static SimProfile {
        self.cfg.profile
    }

    /// The time scale modelled durations are divided by (1 when unset or invalid).
    fn usable_time_scale(&self) -> f64 {
        if self.cfg.time_scale > 0.0 {
            self.cfg.time_scale
        } else {
            1.0
        }
    }

    /// Modelled (unscaled) duration of the last step.
    pub fn last_step_modelled(&self) -> Duration {
        self.last_step
    }

    /// Sum of modelled (unscaled) step durations.
    pub fn total_modelled(&self) -> Duration {
        self.total_modelled
    }

    /// Modelled (unscaled) milliseconds for one batch.
    fn step_ms(&self, seqs: &[SeqStep<'_>]) -> f64 {
        let p = self.cfg.profile;
        let mut prefill = 0.0;
        let mut decodes = 0usize;
        let mut decode_ctx = 0usize;
        for s in seqs {
            if s.tokens.len() == 1 && s.num_generated > 0 {
                decodes += 1;
                decode_ctx += s.start_pos + 1;
            } else {
                prefill += p.prefill_chunk_ms(s.start_pos, s.tokens.len());
            }
        }
        prefill + p.decode_step_ms(decodes, decode_ctx)
    }

    fn sample(seq_id: u64, params_seed: Option<u64>, greedy: bool, position: usize) -> TokenId {
        // Greedy output depends only on position (same prompt → same text); seeded output on the
        // seed; otherwise on the sequence.
        let seed = match (params_seed, greedy) {
            (Some(s), _) => s,
            (None, true) => 0,
            (None, false) => seq_id,
        };
        let r = splitmix64(seed ^ splitmix64(position as u64));
        TokenId::from(ALPHABET[(r % ALPHABET.len() as u64) as usize])
    }
}

impl ComputeBackend for SimBackend {
    fn name(&self) -> &str {
        "sim"
    }

    fn capabilities(&self) -> BackendCapabilities {
        BackendCapabilities {
            models_pull_time: true,
            hash_derived_payloads: true,
            layered_blocks: false,
        }
    }

    fn kv_layout(&self) -> KvLayout {
        let p = self.cfg.profile;
        KvLayout {
            block_size: self.cfg.block_size,
            bytes_per_block: self.cfg.kv_bytes_per_token * self.cfg.block_size,
            num_layers: p.num_layers,
            num_kv_heads: p.num_kv_heads,
            head_dim: p.head_dim,
            dtype: "sim".to_owned(),
            model_id: self.cfg.model_id.clone(),
        }
    }

    fn step(
        &mut self,
        seqs: &[SeqStep<'_>],
        _kv: &mut KvArena,
    ) -> Result<Vec<Option<TokenId>>, ComputeError> {
        let ms = self.step_ms(seqs) + std::mem::take(&mut self.pending_restore_ms);
        let modelled = Duration::from_secs_f64(ms / 1000.0);
        self.last_step = modelled;
        self.total_modelled += modelled;
        if self.sleep && self.cfg.time_scale > 0.0 {
            std::thread::sleep(modelled.div_f64(self.cfg.time_scale));
        }
        Ok(seqs
            .iter()
            .map(|s| {
                s.sample.map(|params| {
                    let position = s.start_pos + s.tokens.len();
                    Self::sample(s.seq_id, params.seed, params.temperature <= 0.0, position)
                })
            })
            .collect())
    }

    fn eos_token_ids(&self) -> Vec<TokenId> {
        vec![SIM_EOS]
    }

    /// Link mode: the uncontended single pull (setup + real KV bytes ÷ bandwidth), what the
    /// router-facing predictions use; contention is applied by the pacers at transfer time.
    /// Ladder mode: the profile's published ladder.
    fn modelled_pull_time(&self, tokens: usize) -> Option<Duration> {
        let ms = match self.cfg.link.params(self.cfg.profile) {
            None => self.cfg.profile.pull_ms(tokens),
            Some(params) => {
                1000.0
                    * params.uncontended_s(
                        tokens as f64 * self.cfg.profile.real_kv_bytes_per_token as f64,
                    )
            }
        };
        Some(Duration::from_secs_f64(
            ms / 1000.0 / self.usable_time_scale(),
        ))
    }

    fn modelled_link(&self) -> Option<ModelledLink> {
        let time_scale = self.usable_time_scale();
        self.cfg
            .link
            .params(self.cfg.profile)
            .map(|params| ModelledLink {
                params,
                time_scale,
                bytes_per_block: self.cfg.profile.real_kv_bytes_per_token
                    * self.cfg.block_size as u64,
            })
    }

    fn on_host_restore(&mut self, tokens: usize) -> HostRestoreCost {
        let ms = tokens as f64 * self.cfg.profile.real_kv_bytes_per_token as f64
            / SIM_H2D_BYTES_PER_SEC
            * 1000.0;
        let modelled = Duration::from_secs_f64(ms / 1000.0);
        match self.cfg.h2d {
            SimH2d::Step => {
                self.pending_restore_ms += ms;
                HostRestoreCost::NextStep { modelled }
            }
            SimH2d::Overlap => HostRestoreCost::CopyEngine {
                modelled,
                wall: modelled.div_f64(self.usable_time_scale()),
            },
        }
    }

    fn run_pending_restore(&mut self) {
        let ms = std::mem::take(&mut self.pending_restore_ms);
        if ms <= 0.0 {
            return;
        }
        let modelled = Duration::from_secs_f64(ms / 1000.0);
        self.total_modelled += modelled;
        if self.sleep && self.cfg.time_scale > 0.0 {
            std::thread::sleep(modelled.div_f64(self.cfg.time_scale));
        }
    }

    fn finalize_block(&mut self, block: BlockId, hash: BlockHash, kv: &mut KvArena) {
        fill_sim_block_payload(hash, kv.block_mut(block));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::SamplingParams;
    use crate::compute::profiles::GPT_OSS_120B_H200;

    fn cfg() -> SimConfig {
        SimConfig {
            profile: &GPT_OSS_120B_H200,
            time_scale: 1.0,
            kv_bytes_per_token: 32,
            block_size: 16,
            model_id: "sim".into(),
            link: SimLink::Ladder,
            h2d: SimH2d::Step,
        }
    }

    #[test]
    fn payload_is_a_verifiable_function_of_the_hash() {
        let a = sim_block_payload(BlockHash(42), 512);
        assert_eq!(a, sim_block_payload(BlockHash(42), 512));
        assert_ne!(a, sim_block_payload(BlockHash(43), 512));
        assert!(verify_sim_block_payload(BlockHash(42), &a));
        assert!(!verify_sim_block_payload(BlockHash(43), &a));
        let mut bad = a.clone();
        bad[100] ^= 1;
        assert!(!verify_sim_block_payload(BlockHash(42), &bad));
        assert!(verify_sim_block_payload(
            BlockHash(7),
            &sim_block_payload(BlockHash(7), 13)
        ));
    }

    #[test]
    fn step_time_follows_the_profile_and_sampling_is_deterministic() {
        let mut b = SimBackend::without_sleep(cfg());
        let mut arena = KvArena::new(4, 512);
        let toks = vec![1u32; 2048];
        let table: Vec<BlockId> = (0..128).collect();
        let sp = SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
        };
        let step = SeqStep {
            seq_id: 1,
            tokens: &toks,
            start_pos: 0,
            block_table: &table,
            sample: Some(&sp),
            num_generated: 0,
        };
        let out = b.step(&[step], &mut arena).expect("step");
        assert!((b.last_step_modelled().as_secs_f64() * 1000.0 - 78.0).abs() < 0.01);
        let step2 = SeqStep {
            seq_id: 99,
            tokens: &toks,
            start_pos: 0,
            block_table: &table,
            sample: Some(&sp),
            num_generated: 0,
        };
        let out2 = b.step(&[step2], &mut arena).expect("step");
        assert_eq!(
            out, out2,
            "greedy output does not depend on the sequence id"
        );
        assert!(out[0].is_some_and(|t| t < 128));
        assert!(
            b.modelled_pull_time(49152)
                .is_some_and(|d| (d.as_secs_f64() - 0.235).abs() < 1e-9)
        );
        assert_eq!(b.modelled_link(), None, "ladder mode paces nothing");
    }

    /// Link mode: a pull is setup + the real KV bytes over the bandwidth, and the pacers get
    /// blocks of block size × the profile's real KV bytes per token.
    #[test]
    fn link_mode_prices_pulls_by_real_kv_bytes() {
        let b = SimBackend::without_sleep(SimConfig {
            link: "100,10".parse().expect("link"),
            time_scale: 4.0,
            ..cfg()
        });
        // 10 ms + 8192 x 73,728 B / 12.5 GB/s = 58.3 ms, / 4.
        let d = b.modelled_pull_time(8192).expect("modelled");
        let want = (0.010 + 8192.0 * 73_728.0 / 12.5e9) / 4.0;
        assert!((d.as_secs_f64() - want).abs() < 1e-9, "{d:?}");
        let link = b.modelled_link().expect("link mode");
        assert_eq!(link.bytes_per_block, 16 * 73_728);
        assert_eq!(link.time_scale, 4.0);
        assert_eq!(b.modelled_pull_time(0), Some(Duration::ZERO));
    }

    /// `step` adds a restore's copy to the next step; `overlap` leaves the step alone and hands
    /// the copy to the engine's copy engine, scaled to wall time.
    #[test]
    fn host_restores_are_charged_to_the_step_or_to_the_copy_engine() {
        // 1024 tokens x 73,728 B at 50 GB/s = 1.51 ms.
        let want = 1024.0 * 73_728.0 / SIM_H2D_BYTES_PER_SEC;
        let mut step = SimBackend::without_sleep(cfg());
        let cost = step.on_host_restore(1024);
        assert!(matches!(cost, HostRestoreCost::NextStep { .. }));
        assert!((cost.modelled().as_secs_f64() - want).abs() < 1e-9);
        let mut overlap = SimBackend::without_sleep(SimConfig {
            h2d: SimH2d::Overlap,
            time_scale: 2.0,
            ..cfg()
        });
        let HostRestoreCost::CopyEngine { modelled, wall } = overlap.on_host_restore(1024) else {
            panic!("overlap mode uses the copy engine");
        };
        assert!((modelled.as_secs_f64() - want).abs() < 1e-9);
        assert!((wall.as_secs_f64() - want / 2.0).abs() < 1e-9);

        let mut arena = KvArena::new(4, 512);
        let toks = vec![1u32; 2048];
        let table: Vec<BlockId> = (0..128).collect();
        let prefill = |b: &mut SimBackend, arena: &mut KvArena| {
            let seq = SeqStep {
                seq_id: 1,
                tokens: &toks,
                start_pos: 0,
                block_table: &table,
                sample: None,
                num_generated: 0,
            };
            b.step(&[seq], arena).expect("step");
            b.last_step_modelled().as_secs_f64()
        };
        let with_copy = prefill(&mut step, &mut arena);
        let alone = prefill(&mut step, &mut arena);
        assert!((with_copy - alone - want).abs() < 1e-9);
        assert!((prefill(&mut overlap, &mut arena) - alone).abs() < 1e-9);
        assert_eq!("overlap".parse::<SimH2d>(), Ok(SimH2d::Overlap));
        assert!("async".parse::<SimH2d>().is_err());
    }
}
