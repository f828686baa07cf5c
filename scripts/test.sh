#!/usr/bin/env bash
# The project's test command: everything a fresh machine needs, then the whole test suite.
# Slow experiment-sized tests are #[ignore]d here and run from the benchmarks (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --workspace --all-targets --locked --no-fail-fast
