//! Calibrated GPU profiles for the `sim` backend: how long a prefill, a decode step and a peer pull
//! take on the modelled hardware. Each profile names its source.
//!
//! Prefill uses a *cumulative* cost curve `C(n)` = measured time to prefill an `n`-token prompt
//! from scratch, piecewise-linear through the measured points (and the origin), extrapolated
//! with the last segment's slope. A chunk of `k` new tokens after `c` cached/computed ones costs
//! `C(c + k) − C(c)`, so chunking and prefix hits are priced consistently with the ladder.

/// A named, documented GPU profile.
#[derive(Debug, Clone, PartialEq)]
pub struct SimProfile {
    pub name: &'static str,
    pub description: &'static str,
    /// Where the numbers come from.
    pub source: &'static str,
    /// `(prompt tokens, ms)` to prefill a prompt from scratch, ascending.
    pub prefill_ms: &'static [(f64, f64)],
    /// `(prefix tokens, ms)` to pull that prefix's KV from a peer's CPU tier, ascending: the
    /// input of the default modelled link's fit (`--sim-link llmd-h200`, see
    /// [`super::sim_link`]) and, in `--sim-link ladder` mode only, replayed as is.
    pub pull_ms: &'static [(f64, f64)],
    /// Decode step cost: `base + per_seq × batch + per_ktok × (context tokens in the batch / 1000)`.
    pub decode_base_ms: f64,
    pub decode_per_seq_ms: f64,
    pub decode_per_ktok_ms: f64,
    /// The real model's KV bytes per token (from the model config, see `source`): the modelled
    /// link moves blocks × block size × this many bytes, while the wire carries the scaled-down
    /// `--sim-kv-bytes-per-token`.
    pub real_kv_bytes_per_token: u64,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

/// gpt-oss-120b on H200.
pub const GPT_OSS_120B_H200: SimProfile = SimProfile {
    name: "gpt-oss-120b-h200",
    description: "openai/gpt-oss-120b on one H200 (aggregated)",
    source: "llm-d blog 'Move the KV, Not the Work' transfer-pricing table \
             (docs/architecture.md#reference-experiments): recompute \
             78/250/510/1173/1988 ms and pull 35/57/86/165/235 ms at 2048/8192/16384/32768/49152 tokens. \
             Decode step cost is an estimate (~4.5 ms ITL at batch 1; MoE with ~5B active params), not measured. \
             KV size from the model config (36 layers x 8 KV heads x 64 dim x K,V x bf16 = 72 KiB/token).",
    prefill_ms: &[
        (2048.0, 78.0),
        (8192.0, 250.0),
        (16384.0, 510.0),
        (32768.0, 1173.0),
        (49152.0, 1988.0),
    ],
    pull_ms: &[
        (2048.0, 35.0),
        (8192.0, 57.0),
        (16384.0, 86.0),
        (32768.0, 165.0),
        (49152.0, 235.0),
    ],
    decode_base_ms: 4.5,
    decode_per_seq_ms: 0.06,
    decode_per_ktok_ms: 0.004,
    real_kv_bytes_per_token: 73_728,
    num_layers: 36,
    num_kv_heads: 8,
    head_dim: 64,
};

/// Llama-3.1-8B on H200.
pub const LLAMA_31_8B_H200: SimProfile = SimProfile {
    name: "llama-3.1-8b-h200",
    description: "meta-llama/Llama-3.1-8B-Instruct on one H200",
    source: "Derived estimate, not a published ladder (the llm-d blog reports only pool-level latencies for \
             this model): prefill FLOPs = 2 x 8.0e9 x n + attention 4 x n^2/2 x 4096 x 32, at an effective \
             500 TFLOP/s (about 50% of H200 dense bf16) gives 68/297/665/1600/2840 ms at 2K/8K/16K/32K/48K. \
             Pull scales the gpt-oss ladder by KV size (128 KiB/token: 32 layers x 8 KV heads x 128 dim x K,V x bf16) \
             at the ~15 GB/s the gpt-oss ladder implies, plus its ~28 ms floor. Decode ~6 ms ITL at batch 1.",
    prefill_ms: &[
        (2048.0, 68.0),
        (8192.0, 297.0),
        (16384.0, 665.0),
        (32768.0, 1600.0),
        (49152.0, 2840.0),
    ],
    pull_ms: &[
        (2048.0, 45.0),
        (8192.0, 95.0),
        (16384.0, 165.0),
        (32768.0, 300.0),
        (49152.0, 440.0),
    ],
    decode_base_ms: 6.0,
    decode_per_seq_ms: 0.08,
    decode_per_ktok_ms: 0.01,
    real_kv_bytes_per_token: 131_072,
    num_layers: 32,
    num_kv_heads: 8,
    head_dim: 128,
};

/// GLM-5.2 (753B MoE) on a wide-EP H200 deployment.
pub const GLM_52_WIDE_EP: SimProfile = SimProfile {
    name: "glm-5.2-wide-ep",
    description: "GLM-5.2-FP8 (753B MoE) wide expert parallel on H200, ~93 KB KV per token",
    source: "llm-d blog (docs/architecture.md#reference-experiments): KV ~93 KB/token; \
             pull floor 1.2-1.3 s; pull and recompute tied near \
             8.7K tokens; pull 27% faster at 12K and 61% faster at 24K; a 75K-token cold prefill took 13.9 s. \
             Recompute points: 8704 -> 1250 ms (tie), 12288 -> 1780 ms, 24576 -> 3590 ms, 76800 -> 13900 ms. \
             Pull points: 1250/1300/1400 ms at 8.7K/12K/24K, extrapolated beyond (the separately reported 790 ms \
             pull of a 75K fork start used a different path and is not used here). Decode ~30 ms ITL (estimate).",
    prefill_ms: &[
        (8704.0, 1250.0),
        (12288.0, 1780.0),
        (24576.0, 3590.0),
        (76800.0, 13900.0),
    ],
    pull_ms: &[
        (2048.0, 1200.0),
        (8704.0, 1250.0),
        (12288.0, 1300.0),
        (24576.0, 1400.0),
    ],
    decode_base_ms: 30.0,
    decode_per_seq_ms: 0.2,
    decode_per_ktok_ms: 0.02,
    real_kv_bytes_per_token: 93_000,
    num_layers: 78,
    num_kv_heads: 1,
    head_dim: 576,
};

/// Every built-in profile.
pub const PROFILES: &[SimProfile] = &[GPT_OSS_120B_H200, LLAMA_31_8B_H200, GLM_52_WIDE_EP];

/// Looks a profile up by name.
pub fn profile(name: &str) -> Option<&'static SimProfile> {
    PROFILES.iter().find(|p| p.name == name)
}

/// Piecewise-linear interpolation over ascending points, extrapolating both ends with the
/// nearest segment's slope; never negative.
fn interpolate(points: &[(f64, f64)], x: f64, through_origin: bool) -> f64 {
    let mut pts: Vec<(f64, f64)> = Vec::with_capacity(points.len() + 1);
    if through_origin {
        pts.push((0.0, 0.0));
    }
    pts.extend_from_slice(points);
    match pts.len() {
        0 => 0.0,
        1 => pts[0].1 * if pts[0].0 > 0.0 { x / pts[0].0 } else { 1.0 },
        n => {
            let i = pts
                .iter()
                .position(|p| p.0 >= x)
                .unwrap_or(n - 1)
                .clamp(1, n - 1);
            let (x0, y0) = pts[i - 1];
            let (x1, y1) = pts[i];
            let slope = if x1 > x0 { (y1 - y0) / (x1 - x0) } else { 0.0 };
            (y0 + slope * (x - x0)).max(0.0)
        }
    }
}

impl SimProfile {
    /// Modelled ms to prefill a prompt of `tokens` from scratch.
    pub fn prefill_total_ms(&self, tokens: usize) -> f64 {
        interpolate(self.prefill_ms, tokens as f64, true)
    }

    /// Modelled ms to compute `new_tokens` after `context` tokens whose KV is already valid.
    pub fn prefill_chunk_ms(&self, context: usize, new_tokens: usize) -> f64 {
        (self.prefill_total_ms(context + new_tokens) - self.prefill_total_ms(context)).max(0.0)
    }

    /// Modelled ms of one decode step for `batch` sequences holding `context_tokens` in total.
    pub fn decode_step_ms(&self, batch: usize, context_tokens: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        self.decode_base_ms
            + self.decode_per_seq_ms * batch as f64
            + self.decode_per_ktok_ms * context_tokens as f64 / 1000.0
    }

    /// Modelled ms to pull `tokens` of prefix KV from a peer (0 for 0 tokens).
    pub fn pull_ms(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        interpolate(self.pull_ms, tokens as f64, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_profile_reproduces_the_published_ladder() {
        let p = profile("gpt-oss-120b-h200").expect("profile");
        for &(t, ms) in p.prefill_ms {
            assert!((p.prefill_total_ms(t as usize) - ms).abs() < 1e-6);
        }
        for &(t, ms) in p.pull_ms {
            assert!((p.pull_ms(t as usize) - ms).abs() < 1e-6);
        }
        // Chunked prefill costs the same as one shot.
        let whole = p.prefill_chunk_ms(0, 32768);
        let chunked: f64 = (0..4).map(|i| p.prefill_chunk_ms(i * 8192, 8192)).sum();
        assert!((whole - chunked).abs() < 1e-6);
        // A suffix after a cached prefix is cheaper than the full prompt.
        assert!(p.prefill_chunk_ms(16384, 512) < p.prefill_total_ms(512 + 16384));
        assert!(p.pull_ms(512) > 0.0 && p.pull_ms(512) < 35.0);
        assert!(p.prefill_total_ms(60_000) > 1988.0);
    }

    #[test]
    fn glm_ties_near_8k_and_pull_wins_at_24k() {
        let p = profile("glm-5.2-wide-ep").expect("profile");
        assert!(p.prefill_total_ms(4096) < p.pull_ms(4096));
        let t = 24576;
        assert!(p.pull_ms(t) < 0.5 * p.prefill_total_ms(t));
        assert!((p.prefill_total_ms(76800) - 13900.0).abs() < 1e-6);
    }

    #[test]
    fn every_profile_is_monotone() {
        for p in PROFILES {
            let mut last = 0.0;
            for n in (0..80_000).step_by(1000) {
                let v = p.prefill_total_ms(n);
                assert!(v >= last, "{} not monotone at {n}", p.name);
                last = v;
            }
            assert!(p.decode_step_ms(8, 8000) > p.decode_step_ms(1, 100));
        }
    }
}
