#!/usr/bin/env bash
# Installs the peer routers that `kvmesh bench` can run as arms (`vllm-router:<policy>`,
# `smg:<policy>`) into a cached project virtual environment, `.venv-peers/` at the repository root.
# Idempotent: when the pinned versions are already installed it only prints where the binaries are.
#
#   bash scripts/peer-routers.sh            # install or verify; prints the binaries' paths
#   KVMESH_PEER_VENV=/some/dir bash scripts/peer-routers.sh   # another location
#
# `kvmesh bench` looks for the binaries in `--peer-venv DIR`, else $KVMESH_PEER_VENV, else
# `.venv-peers/` in the current directory or above it.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the issue-13 comparison was measured with these; bump both here and in docs together.
VLLM_ROUTER_VERSION=0.1.17
SGLANG_ROUTER_VERSION=0.3.2

VENV="${KVMESH_PEER_VENV:-$PWD/.venv-peers}"
PY="$VENV/bin/python"
STAMP="$VENV/.kvmesh-peers"
WANT="vllm-router==$VLLM_ROUTER_VERSION sglang-router==$SGLANG_ROUTER_VERSION"

have_all() {
  [[ -x "$VENV/bin/vllm-router" && -x "$VENV/bin/smg" && -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$WANT" ]]
}

if ! have_all; then
  command -v python3 >/dev/null || { echo "peer-routers: python3 not found" >&2; exit 1; }
  if [[ ! -x "$PY" ]]; then
    echo "peer-routers: creating $VENV"
    python3 -m venv "$VENV"
  fi
  echo "peer-routers: installing $WANT (pip)"
  # shellcheck disable=SC2086
  "$PY" -m pip install --quiet --disable-pip-version-check $WANT
  for bin in vllm-router smg; do
    [[ -x "$VENV/bin/$bin" ]] || { echo "peer-routers: $bin missing from $VENV/bin after install" >&2; exit 1; }
  done
  echo "$WANT" > "$STAMP"
fi

echo "vllm-router $VLLM_ROUTER_VERSION: $VENV/bin/vllm-router"
echo "smg (sglang-router $SGLANG_ROUTER_VERSION): $VENV/bin/smg"
