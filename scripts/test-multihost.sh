#!/usr/bin/env bash
# Multi-host check without a cluster: every engine and the routers run in their own Linux network
# namespace with their own address on a shared bridge, so nothing can reach anything through
# 127.0.0.1. Engines bind 0.0.0.0 and are told their address with --advertise-host (as a
# Kubernetes pod is told its pod IP); a P2P pull between two aggregated engines and a P/D hand-off
# between a prefill and a decode engine must then cross distinct IPs.
#
# Asserts: every address an engine announces (P2P producer, KV-event endpoint, P/D
# kv_transfer_params) is its own namespace IP, never a loopback or wildcard one; the router named
# the holder's IP as the pull source; the pullers' and producers' P2P counters moved.
#
# Needs root and iproute2; skips (exit 0, reason printed) where namespaces cannot be created.
# Bounded: every wait has a deadline, and an EXIT trap kills the processes and deletes the
# namespaces it made (names carry this script's PID, so parallel runs do not collide).
#   bash scripts/test-multihost.sh            (uses target/debug/kvmesh, building it if needed)
#   KVMESH_BIN=target/release/kvmesh bash scripts/test-multihost.sh
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
  echo "multihost: SKIPPED: $*"
  exit 0
}
fail() {
  echo "multihost: FAILED: $*" >&2
  exit 1
}

[ "$(uname -s)" = Linux ] || skip "network namespaces are Linux-only"
[ "$(id -u)" = 0 ] || skip "creating network namespaces needs root (running as uid $(id -u))"
command -v ip >/dev/null || skip "iproute2 ('ip') is not installed"
command -v curl >/dev/null || skip "curl is not installed"
command -v jq >/dev/null || skip "jq is not installed"

TAG="kvmh$$"
WORK=$(mktemp -d "/tmp/kvmesh-multihost.XXXXXX")
NAMESPACES=()
PIDS=()

cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  if [ "$rc" != 0 ]; then
    echo "multihost: logs of the failed run:" >&2
    for f in "$WORK"/*.log; do
      [ -e "$f" ] || continue
      echo "---- $(basename "$f") (last 30 lines)" >&2
      tail -n 30 "$f" >&2
    done
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! ip netns add "$TAG-br" 2>"$WORK/netns.err"; then
  skip "cannot create a network namespace here: $(cat "$WORK/netns.err")"
fi
NAMESPACES+=("$TAG-br")

BIN=${KVMESH_BIN:-target/debug/kvmesh}
if [ -z "${KVMESH_BIN:-}" ]; then
  echo "multihost: building kvmesh (debug)"
  cargo build --quiet --locked -p kvmesh
fi
[ -x "$BIN" ] || fail "no kvmesh binary at $BIN"
BIN=$(realpath "$BIN")

# One bridge in its own namespace: the host's interfaces, routes and firewall are never touched.
SUBNET=10.231.0
ip -n "$TAG-br" link add br0 type bridge
ip -n "$TAG-br" link set br0 up

# node name -> last octet of its address
declare -A OCTET=([router]=2 [e1]=11 [e2]=12 [prefill]=13 [decode]=14)
ip_of() { echo "$SUBNET.${OCTET[$1]}"; }

for node in router e1 e2 prefill decode; do
  ns="$TAG-$node"
  ip netns add "$ns"
  NAMESPACES+=("$ns")
  ip -n "$ns" link add eth0 type veth peer name "v-$node" netns "$TAG-br"
  ip -n "$TAG-br" link set "v-$node" master br0 up
  ip -n "$ns" addr add "$(ip_of "$node")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done
in_ns() {
  local node=$1
  shift
  ip netns exec "$TAG-$node" "$@"
}
# spawn_in_ns NODE LOG CMD...: starts CMD in NODE's namespace in the background. Not through a
# function (a backgrounded function is a subshell, and killing it would leave CMD running).
spawn_in_ns() {
  local node=$1 log=$2
  shift 2
  ip netns exec "$TAG-$node" "$@" >"$log" 2>&1 &
  PIDS+=($!)
}

# Consumers may pull from the namespace network (a pod CIDR in Kubernetes), nothing else.
ENGINE_NET="$SUBNET.0/24"
printf 'multihost-shared-secret-%s\n' "$TAG" >"$WORK/p2p-secret"
chmod 600 "$WORK/p2p-secret"

start_engine() {
  local node=$1
  shift
  spawn_in_ns "$node" "$WORK/$node.log" "$BIN" engine \
    --host 0.0.0.0 --advertise-host "$(ip_of "$node")" --port 8000 \
    --p2p-port 7100 --p2p-secret-file "$WORK/p2p-secret" --p2p-allowed-peers "$ENGINE_NET" \
    --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":""}' \
    --engine-label "$node" --time-scale 20 --num-gpu-blocks 4096 --cpu-offload-bytes 64MiB \
    "$@"
}
start_engine e1
start_engine e2
start_engine prefill --role prefill --bidirectional-kv-xfer
start_engine decode --role decode --bidirectional-kv-xfer

endpoint_yaml() {
  local node=$1 role=$2
  cat <<EOF
  - name: $node
    role: $role
    url: http://$(ip_of "$node"):8000
    kv_events: {endpoint: "tcp://$(ip_of "$node"):5557", topic: ""}
    p2p: "$(ip_of "$node"):7100"
EOF
}

# Aggregated router: round robin ignores the cache, so the second request of a shared prefix lands
# on the engine that does not hold it, and the P2P plugin names the holder.
{
  echo "block_size: 16"
  echo "tokenizer: byte"
  echo "seed: 7"
  echo "metrics_scrape_interval: 200ms"
  echo "endpoints:"
  endpoint_yaml e1 both
  endpoint_yaml e2 both
  cat <<'EOF'
plugins:
  - {type: round-robin-picker, name: rr}
  - type: p2p-source-producer
    name: p2p
    parameters: {min_cached_token_delta: 256}
scheduling_profiles:
  - name: rr-p2p
    plugins:
      - {plugin_ref: rr}
      - {plugin_ref: p2p}
EOF
} >"$WORK/router-agg.yaml"

{
  echo "block_size: 16"
  echo "tokenizer: byte"
  echo "metrics_scrape_interval: 200ms"
  echo "endpoints:"
  endpoint_yaml prefill prefill
  endpoint_yaml decode decode
  cat <<'EOF'
plugins:
  - {type: queue-scorer, name: queue}
  - {type: max-score-picker, name: max}
scheduling_profiles:
  - name: prefill
    plugins:
      - {plugin_ref: queue, weight: 1}
      - {plugin_ref: max}
  - name: decode
    plugins:
      - {plugin_ref: queue, weight: 1}
      - {plugin_ref: max}
pd:
  prefill_profile: prefill
  decode_profile: decode
  decider: always
  bidirectional: true
EOF
} >"$WORK/router-pd.yaml"

ROUTER=$(ip_of router)
spawn_in_ns router "$WORK/router-agg.log" \
  "$BIN" router --host "$ROUTER" --port 8000 --config "$WORK/router-agg.yaml"
spawn_in_ns router "$WORK/router-pd.log" \
  "$BIN" router --host "$ROUTER" --port 8001 --config "$WORK/router-pd.yaml"

# Every request is made from the router's namespace: the only way to an engine is its own IP.
http() { in_ns router curl -sS --max-time 30 "$@"; }

wait_healthy() {
  local url=$1 deadline=$((SECONDS + 90))
  until http -o /dev/null -f "$url" 2>/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || fail "$url not healthy within 90 s"
    sleep 0.5
  done
}
for node in e1 e2 prefill decode; do wait_healthy "http://$(ip_of "$node"):8000/health"; done
wait_healthy "http://$ROUTER:8000/health"
wait_healthy "http://$ROUTER:8001/health"
echo "multihost: 4 engines and 2 routers up in 5 network namespaces on $SUBNET.0/24"

# What the engines announce must be their own namespace address.
for node in e1 e2 prefill decode; do
  want=$(ip_of "$node")
  grep -q "p2p advertised as $want:7100" "$WORK/$node.log" ||
    fail "$node did not advertise its P2P producer at $want:7100"
  grep -q "subscribers connect to tcp://$want:5557" "$WORK/$node.log" ||
    fail "$node did not advertise its KV events at tcp://$want:5557"
done
# Only the announced part of each line counts (the bind address is rightly 0.0.0.0).
if grep -hoE "(advertised as|subscribers connect to) [^ )]+" "$WORK"/{e1,e2,prefill,decode}.log |
  grep -E "127\.|0\.0\.0\.0|localhost|\*"; then
  fail "an engine advertised a loopback or wildcard address (lines above)"
fi

# Sum of a Prometheus counter over its series ('name' or 'name{...}'), optionally only the series
# whose labels contain FILTER (e.g. 'direction="in"').
metric_sum() {
  local url=$1 name=$2 filter=${3:-}
  http "$url/metrics" | awk -v n="$name" -v f="$filter" '
    ($1 == n && f == "") || (index($1, n "{") == 1 && index($1, f) > 0) { s += $NF }
    END { printf "%d\n", s + 0 }'
}
blocks_in() { metric_sum "http://$(ip_of "$1"):8000" kvmesh_p2p_blocks_total 'direction="in"'; }
blocks_out() { metric_sum "http://$(ip_of "$1"):8000" kvmesh_p2p_blocks_total 'direction="out"'; }
external_hits() { metric_sum "http://$(ip_of "$1"):8000" vllm:external_prefix_cache_hits_total; }

# Deterministic 4 KiB text prefix (256 blocks of 16 byte-tokens).
prefix_text() {
  local seed=$1 out="" i=0
  while [ "${#out}" -lt 4096 ]; do
    out+="multihost $seed line $i: the quick brown fox jumps over the lazy dog. "
    i=$((i + 1))
  done
  printf '%s' "${out:0:4096}"
}
# complete PORT PROMPT [SESSION [MAX_TOKENS]]: one completion through a router; prints the text.
complete() {
  local port=$1 prompt=$2 session=${3:-} max_tokens=${4:-4}
  jq -n --arg p "$prompt" --argjson n "$max_tokens" \
    '{model: "sim", prompt: $p, max_tokens: $n, temperature: 0, ignore_eos: true}' |
    http -f -H 'content-type: application/json' ${session:+-H "X-Session-ID: $session"} \
      --data-binary @- "http://$ROUTER:$port/v1/completions" | jq -r '.choices[0].text'
}

# --- P2P between two aggregated engines, through the router -------------------------------------
P=$(prefix_text agg)
complete 8000 "$P first question" >/dev/null
# Wait until the router has indexed the holder's blocks (KV events crossed namespaces).
deadline=$((SECONDS + 30))
until [ "$(metric_sum "http://$ROUTER:8000" kvmesh_index_blocks)" -gt 0 ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "the router indexed no block from the engines' KV events within 30 s"
  sleep 0.3
done
# The holder writes the blocks to its CPU tier once the request finishes; give its events a moment.
sleep 1
complete 8000 "$P second question" >/dev/null

decision=$(http "http://$ROUTER:8000/debug/decisions" |
  jq -c '[.. | objects | select(.outcome? == "pull_named")] | last // empty | {endpoint, outcome, why: .p2p.why}')
echo "multihost: router decision: ${decision:-<none>}"
[ -n "$decision" ] || fail "the router named no P2P source for the shared prefix"
puller=$(jq -r .endpoint <<<"$decision")
holder=e1
[ "$puller" = e1 ] && holder=e2
pulled=$(blocks_in "$puller")
served=$(blocks_out "$holder")
external=$(external_hits "$puller")
echo "multihost: aggregated P2P: $puller ($(ip_of "$puller")) pulled $pulled blocks, $holder ($(ip_of "$holder")) sent $served, $puller external prefix-cache hit tokens $external"
[ "$pulled" -ge 256 ] || fail "$puller pulled $pulled blocks of the 256-block shared prefix from $holder"
[ "$served" -ge 256 ] || fail "$holder sent $served blocks"
[ "$external" -ge 4096 ] || fail "$puller counted $external external prefix-cache hit tokens (want the 4096-token prefix)"

# --- P/D hand-off across IPs ---------------------------------------------------------------------
# Asked directly, the prefill engine's hand-off params must name its own namespace IP.
params=$(jq -n --arg p "$(prefix_text direct)" \
  '{model: "sim", prompt: $p, max_tokens: 1, kv_transfer_params: {do_remote_decode: true}}' |
  http -f -H 'content-type: application/json' --data-binary @- "http://$(ip_of prefill):8000/v1/completions" |
  jq -c '.kv_transfer_params | {remote_host, remote_port, remote_engine_id}')
echo "multihost: prefill hand-off params: $params"
[ "$(jq -r '.remote_host' <<<"$params")" = "$(ip_of prefill)" ] ||
  fail "the prefill engine's kv_transfer_params name $(jq -r '.remote_host' <<<"$params"), not $(ip_of prefill)"

decode_before=$(blocks_in decode)
sent_before=$(blocks_out prefill)
TURN1="$(prefix_text pd) a P/D question"
# 160 generated tokens: the decoder then holds 10 more blocks of the conversation than the
# prefill engine, above the engines' --kv-recompute-threshold (64 tokens), so reading them pays.
ANSWER1=$(complete 8001 "$TURN1" multihost-session 160)
decode_pulled=$(($(blocks_in decode) - decode_before))
prefill_sent=$(($(blocks_out prefill) - sent_before))
echo "multihost: P/D hand-off: decode pulled $decode_pulled blocks, prefill sent $prefill_sent"
[ "$decode_pulled" -ge 256 ] || fail "the decode engine ($(ip_of decode)) pulled $decode_pulled blocks from the prefill engine ($(ip_of prefill)), want the prompt's 256"
[ "$prefill_sent" -ge 256 ] || fail "the prefill engine sent $prefill_sent blocks"

# Bi-directional: the next turn's prefill leg reads the conversation's history back from the
# decode engine's CPU tier (decode IP -> prefill IP). The prefill engine still holds turn 1's
# prompt, so what it reads are the blocks the decoder filled with the generated tokens.
history_before=$(blocks_in prefill)
decode_sent_before=$(blocks_out decode)
complete 8001 "$TURN1$ANSWER1 and a follow-up question" multihost-session >/dev/null
history=$(http "http://$ROUTER:8001/debug/decisions" | jq -r '[.[] | select(.outcome == "pd_prefill")] | last | .p2p.why // "none"')
history_pulled=$(($(blocks_in prefill) - history_before))
decode_sent=$(($(blocks_out decode) - decode_sent_before))
echo "multihost: history read ($history): prefill pulled $history_pulled blocks, decode sent $decode_sent"
[[ "$history" == *"$(ip_of decode):7100"* ]] || fail "the router did not name the decoder's address for the history read"
[ "$history_pulled" -ge 8 ] || fail "the prefill engine read no history from the decode engine ($(ip_of decode))"
[ "$decode_sent" -ge 8 ] || fail "the decode engine sent no history block"

echo "multihost: OK (P2P pull, P/D hand-off and history read across 4 engine IPs; nothing advertised as loopback)"
