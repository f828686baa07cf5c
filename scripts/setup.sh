#!/usr/bin/env bash
# Installs what the tests and the demo need beyond the Rust toolchain. Idempotent and quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install a stable Rust toolchain (rustup)" >&2; exit 1; }
