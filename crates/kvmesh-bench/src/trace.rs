//! Mooncake conversation-trace replay (`trace:<file>`).
//!
//! Each row is `{"timestamp": ms, "input_length", "output_length", "hash_ids": [..]}` with one id per
//! 512-token block, prefix-chained. Every distinct id becomes a deterministic 512-token segment (the
//! last block of a row cut to the input length), so equal ids give equal tokens and shared prefixes
//! survive token-for-token.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::tokens::{Segment, TokenSpace, mix};
use crate::workload::{
    FleetShape, Scale, Session, Start, Step, StepKind, Workload, WorkloadError, WorkloadOptions,
};

/// Tokens per trace hash id.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One trace row.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceRow {
    /// Milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// Summary statistics (to check a loader against the published numbers).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceStats {
    pub requests: usize,
    pub blocks: usize,
    pub distinct_blocks: usize,
    pub mean_input: f64,
    pub median_input: usize,
    pub mean_output: f64,
    pub duration_s: f64,
}

/// Parses a JSONL trace; a bad line is an error naming the line.
pub fn parse(text: &str, path: &str) -> Result<Vec<TraceRow>, WorkloadError> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: TraceRow = serde_json::from_str(line).map_err(|e| WorkloadError::Trace {
            path: path.into(),
            reason: format!("line {}: {e}", i + 1),
        })?;
        if row.hash_ids.len() != row.input_length.div_ceil(TRACE_BLOCK_TOKENS) {
            return Err(WorkloadError::Trace {
                path: path.into(),
                reason: format!(
                    "line {}: {} hash ids for {} input tokens (expected ceil(len/512))",
                    i + 1,
                    row.hash_ids.len(),
                    row.input_length
                ),
            });
        }
        rows.push(row);
    }
    Ok(rows)
}

pub fn load(path: &Path) -> Result<Vec<TraceRow>, WorkloadError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| WorkloadError::Trace {
        path: shown.clone(),
        reason: e.to_string(),
    })?;
    parse(&text, &shown)
}

pub fn stats(rows: &[TraceRow]) -> TraceStats {
    let mut ids: Vec<u64> = rows
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect();
    let blocks = ids.len();
    ids.sort_unstable();
    ids.dedup();
    let mut inputs: Vec<usize> = rows.iter().map(|r| r.input_length).collect();
    inputs.sort_unstable();
    let n = rows.len().max(1) as f64;
    TraceStats {
        requests: rows.len(),
        blocks,
        distinct_blocks: ids.len(),
        mean_input: inputs.iter().sum::<usize>() as f64 / n,
        median_input: inputs.get(inputs.len() / 2).copied().unwrap_or(0),
        mean_output: rows.iter().map(|r| r.output_length).sum::<usize>() as f64 / n,
        duration_s: rows.iter().map(|r| r.timestamp).max().unwrap_or(0) as f64 / 1000.0,
    }
}

/// The prompt of a row: one seeded 512-token segment per hash id, the last cut to the input length.
fn row_segments(row: &TraceRow, seed: u64) -> Vec<Segment> {
    let mut left = row.input_length;
    row.hash_ids
        .iter()
        .map(|&id| {
            let len = left.min(TRACE_BLOCK_TOKENS);
            left -= len;
            Segment::seeded(mix(mix(seed, 0x0074_7261_6365), id), len)
        })
        .collect()
}

/// Builds the replay workload: rows inside the window, timestamps divided by `speed`.
pub fn workload(
    path: &str,
    scale: Scale,
    seed: u64,
    opts: &WorkloadOptions,
) -> Result<Workload, WorkloadError> {
    let rows = load(Path::new(path))?;
    let speed = opts
        .speed
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(1.0);
    let (start_s, len_s) = opts.window.unwrap_or(match scale {
        Scale::Quick => (0.0, 30.0),
        Scale::Full => (0.0, f64::INFINITY),
    });
    let (max_input, max_output) = match scale {
        Scale::Quick => (16_384usize, 64usize),
        Scale::Full => (usize::MAX, usize::MAX),
    };
    let mut sessions = Vec::new();
    let mut longest = 0;
    for row in &rows {
        let t = row.timestamp as f64 / 1000.0;
        if t < start_s || t >= start_s + len_s {
            continue;
        }
        let mut row = row.clone();
        if row.input_length > max_input {
            // Quick scale keeps the leading blocks (the shared part) and drops the tail.
            row.input_length = max_input;
            row.hash_ids
                .truncate(max_input.div_ceil(TRACE_BLOCK_TOKENS));
        }
        longest = longest.max(row.input_length + row.output_length.min(max_output));
        sessions.push(Session {
            start: Start::At(Duration::from_secs_f64(((t - start_s) / speed).max(0.0))),
            steps: vec![Step {
                gap: Duration::ZERO,
                history: false,
                segments: row_segments(&row, seed),
                max_tokens: row.output_length.clamp(1, max_output) as u32,
                kind: StepKind::Request,
            }],
        });
    }
    let span = sessions
        .iter()
        .filter_map(|s| match s.start {
            Start::At(t) => Some(t.as_secs_f64()),
            Start::After { .. } => None,
        })
        .fold(0.0f64, f64::max);
    let engines = match scale {
        Scale::Quick => 4,
        Scale::Full => 8,
    };
    Ok(Workload {
        name: "trace".into(),
        description: format!(
            "Mooncake trace {path}: {} requests, window {start_s}+{len_s} s, speed {speed}×",
            sessions.len()
        ),
        seed,
        token_space: TokenSpace::default(),
        offered_rate: (span > 0.0).then(|| sessions.len() as f64 / span),
        sessions,
        max_active_sessions: None,
        request_timeout: Duration::from_secs(600),
        fleet: FleetShape {
            engines,
            prefill: 0,
            decode: 0,
            num_gpu_blocks: 32_768,
            max_model_len: longest + 1024,
            cpu_tier_ratio: 2,
        },
        min_cached_token_delta: 2048,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::TokenGen;

    const TRACE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/traces/mooncake_conversation_trace.jsonl"
    );

    #[test]
    fn loader_matches_the_published_statistics() {
        let rows = load(Path::new(TRACE)).unwrap();
        let s = stats(&rows);
        assert_eq!(s.requests, 12_031);
        assert_eq!(s.blocks, 288_500);
        assert_eq!(s.distinct_blocks, 182_790);
        assert_eq!(s.mean_input.round() as u64, 12_035);
        assert!((s.mean_output - 343.0).abs() < 1.0, "{}", s.mean_output);
        assert!((3_500.0..3_600.0).contains(&s.duration_s));
        // 36.64% of blocks reusable with an infinite cache = 1 - distinct/blocks.
        let reusable = 1.0 - s.distinct_blocks as f64 / s.blocks as f64;
        assert!((reusable - 0.3664).abs() < 0.0005, "{reusable}");
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens() {
        let rows = parse(
            "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [0, 1, 2]}\n\
             {\"timestamp\": 5, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 3]}\n",
            "inline",
        )
        .unwrap();
        let g = TokenGen::new(1, TokenSpace::default());
        let a = g.render(&row_segments(&rows[0], 1));
        let b = g.render(&row_segments(&rows[1], 1));
        assert_eq!(a.len(), 1100);
        assert_eq!(b.len(), 600);
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..600], b[512..600]);
    }

    #[test]
    fn bad_rows_are_errors_naming_the_line() {
        let e = parse(
            "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [0]}",
            "x",
        )
        .unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        assert!(parse("not json", "x").is_err());
    }

    #[test]
    fn window_and_speed() {
        let opts = WorkloadOptions {
            speed: Some(2.0),
            window: Some((10.0, 20.0)),
            ..Default::default()
        };
        let w = workload(TRACE, Scale::Full, 1, &opts).unwrap();
        assert!(!w.sessions.is_empty());
        for s in &w.sessions {
            match s.start {
                Start::At(t) => assert!(t <= Duration::from_secs(10)),
                Start::After { .. } => unreachable!(),
            }
        }
    }
}
