//! Engine configuration: what `kvmesh engine` flags map to, plus parsers for vLLM-style values
//! (`--kv-events-config` JSON, byte sizes like `2GiB`).
//!
//! The struct is plain data so tests and the bench launcher can build engines without a CLI.

use std::time::Duration;

use kvmesh_core::HashAlgo;
use serde::Deserialize;
use thiserror::Error;

/// Why a configuration value was refused.
#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("invalid byte size `{0}` (examples: 1048576, 512MiB, 2GiB, 1.5GB)")]
    ByteSize(String),
    #[error("invalid --kv-events-config: {0}")]
    KvEvents(String),
    #[error("invalid engine config: {0}")]
    Invalid(String),
}

/// vLLM's `--kv-events-config` JSON (`KVEventsConfig`); unknown keys are ignored as vLLM does not
/// know ours either.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct KvEventsConfig {
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// Only `"zmq"` publishes; `"null"` disables.
    #[serde(default = "default_publisher")]
    pub publisher: String,
    /// `tcp://*:5557` binds on all interfaces; any other host connects (the subscriber then binds),
    /// unless `bind` is set. Without the key: bind `tcp://127.0.0.1:5557` (loopback; vLLM's own
    /// default is `tcp://*:5557`, all interfaces).
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// kvmesh extension: bind `endpoint` even though its host is concrete (e.g. loopback only).
    #[serde(default)]
    pub bind: bool,
    /// kvmesh extension: the networks subscribers and replay clients may connect from
    /// (`["10.0.0.0/8", "127.0.0.1"]`); absent, any address within the connection caps.
    #[serde(default)]
    pub allowed_peers: Option<Vec<String>>,
    /// Optional ROUTER socket answering replay requests.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    #[serde(default)]
    pub topic: String,
    /// kvmesh extension: also publish the engine's load (topic `kvmesh.load`, see
    /// `kvmesh_core::load_report`) so router replicas share one view of it. Off for a socket
    /// whose other subscribers take every topic (`""`) and cannot skip one they do not know.
    #[serde(default = "yes")]
    pub load_reports: bool,
}

fn yes() -> bool {
    true
}

fn default_publisher() -> String {
    "null".to_owned()
}
/// Where events go when the JSON names no endpoint: bound, on loopback only.
pub const DEFAULT_KV_EVENTS_ENDPOINT: &str = "tcp://127.0.0.1:5557";

fn default_endpoint() -> String {
    DEFAULT_KV_EVENTS_ENDPOINT.to_owned()
}
fn default_buffer_steps() -> usize {
    10_000
}

impl KvEventsConfig {
    /// Parses the JSON given to `--kv-events-config`.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let raw: serde_json::Value =
            serde_json::from_str(json).map_err(|e| ConfigError::KvEvents(e.to_string()))?;
        let defaulted = raw.get("endpoint").is_none();
        let mut cfg: KvEventsConfig =
            serde_json::from_value(raw).map_err(|e| ConfigError::KvEvents(e.to_string()))?;
        // The default must not listen beyond this host; an explicit `*` still means all interfaces.
        cfg.bind |= defaulted;
        if cfg.enabled() && !cfg.endpoint.contains("://") {
            return Err(ConfigError::KvEvents(format!(
                "endpoint `{}` has no transport (e.g. tcp://*:5557)",
                cfg.endpoint
            )));
        }
        Ok(cfg)
    }

    /// Events are published only with `enable_kv_cache_events` and the `zmq` publisher (vLLM's rule).
    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher == "zmq"
    }
}

/// Parses `2GiB`, `512MiB`, `1.5GB`, `4096` (bytes) and the like.
pub fn parse_byte_size(s: &str) -> Result<u64, ConfigError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| ConfigError::ByteSize(s.to_owned()))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1024.0 * 1024.0,
        "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "ti" | "tib" => 1024.0f64.powi(4),
        _ => return Err(ConfigError::ByteSize(s.to_owned())),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(ConfigError::ByteSize(s.to_owned()));
    }
    Ok(bytes.round() as u64)
}

/// Serving role for P/D disaggregation (`docs/architecture.md#pd-disaggregation`); stored for the
/// P2P/PD work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl std::str::FromStr for Role {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "both" | "aggregated" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(ConfigError::Invalid(format!(
                "unknown role `{other}` (both, prefill, decode)"
            ))),
        }
    }
}

/// Default `--p2p-deadline-factor`: a priced pull gets 4× its predicted time. The prediction is
/// the router's, link sharing included; 4× leaves room for a learned rate that is still wrong by
/// half and for a busy host, while a stall costs a few predictions instead of seconds.
pub const DEFAULT_P2P_DEADLINE_FACTOR: f64 = 4.0;

/// Default `--p2p-deadline-floor-ms`.
pub const DEFAULT_P2P_DEADLINE_FLOOR_MS: u64 = 200;

/// Settings reserved for the P2P transfer service and P/D roles; the engine stores them, the
/// P2P integrator reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct P2pConfig {
    /// TCP port of the P2P producer service; `None` = no producer.
    pub port: Option<u16>,
    /// Peers (host or host:port patterns) this engine may pull from.
    pub allowed_peers: Vec<String>,
    /// Budget for one pull before falling back to compute (also bounds each protocol step).
    pub timeout: Duration,
    /// How long a pull may wait, beyond `timeout`, for blocks the producer is computing right
    /// now (`PENDING`) before the consumer computes them itself.
    pub pending_deadline: Duration,
    /// A pull the router priced (`kv_transfer_params.kvmesh_predicted_pull_ms`) gets this many
    /// times the prediction, at least `deadline_floor` and at most `timeout + pending_deadline`:
    /// a stalling source then costs about the prediction, not the flat budget
    /// (`--p2p-deadline-factor`).
    pub deadline_factor: f64,
    /// The least a priced pull gets, whatever the prediction (`--p2p-deadline-floor-ms`): room
    /// for scheduling noise on a busy host.
    pub deadline_floor: Duration,
    /// Share (0..=1) of the CPU tier that blocks landed by pulls for requests not yet scheduled
    /// may hold pinned; beyond it pulled blocks land evictable (`--p2p-pull-pin-fraction`).
    pub pull_pin_fraction: f64,
    /// Optional shared secret peers must prove (`--p2p-secret-file`; never on the command line).
    /// With it every P2P frame after the handshake is authenticated.
    pub secret: Option<kvmesh_transfer::Secret>,
    /// Encrypt P2P transfers, both as producer and as consumer (`--p2p-encrypt`; needs the
    /// secret; every peer must be configured alike, or it is refused).
    pub encrypt: bool,
    /// Connections one pull may stripe its blocks over (`--p2p-stripes`).
    pub stripes: usize,
    /// Addresses or networks (`10.0.0.7`, `10.0.0.0/8`) our producer serves; empty = any, which
    /// is allowed only on loopback or with a secret (`--p2p-allowed-consumers`).
    pub allowed_consumers: Vec<String>,
    /// Connections one peer address may hold on our producer (`--p2p-max-connections-per-ip`).
    pub max_connections_per_ip: usize,
    /// Fetch streams one peer address may run at once on our producer; more wait their turn
    /// (`--p2p-max-fetches-per-peer`). Engines sharing one address (a one-host fleet on loopback)
    /// share it.
    pub max_fetches_per_peer: usize,
    /// Blocks one peer lookup may pin on our producer (`--p2p-max-pins-per-lookup`).
    pub max_pins_per_lookup: usize,
    /// Blocks one peer address may hold pinned on our producer (`--p2p-max-pinned-per-peer`).
    pub max_pinned_per_peer: usize,
    pub role: Role,
    pub bidirectional_kv_xfer: bool,
    /// How long a decode engine retains a finished request's blocks (vLLM default 480 s).
    pub decoder_kv_blocks_ttl: Duration,
    /// Minimum reusable tokens before a remote read is worth it (vLLM default 64).
    pub kv_recompute_threshold: usize,
    /// How a request's pulled prefix reaches compute (`--p2p-load-mode`).
    pub load_mode: P2pLoadMode,
}

/// How a pulled prefix reaches compute (`--p2p-load-mode`, like the vLLM connector's
/// `load_mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum P2pLoadMode {
    /// The whole prefix lands in the CPU tier before the request is scheduled: a slow peer
    /// delays that request only.
    #[default]
    Async,
    /// The request is scheduled at once and its first step waits for each layer as it
    /// computes (backends with layered blocks; others pull whole): the pull overlaps the
    /// suffix's compute, but a slow peer stalls that step for the whole batch, up to the pull's
    /// deadline.
    Layerwise,
}

impl std::str::FromStr for P2pLoadMode {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "async" => Ok(Self::Async),
            "layerwise" => Ok(Self::Layerwise),
            other => Err(ConfigError::Invalid(format!(
                "--p2p-load-mode must be async or layerwise, got {other:?}"
            ))),
        }
    }
}

impl Default for P2pConfig {
    fn default() -> Self {
        Self {
            port: None,
            allowed_peers: Vec::new(),
            timeout: Duration::from_millis(5_000),
            pending_deadline: Duration::from_millis(2_000),
            deadline_factor: DEFAULT_P2P_DEADLINE_FACTOR,
            deadline_floor: Duration::from_millis(DEFAULT_P2P_DEADLINE_FLOOR_MS),
            pull_pin_fraction: crate::cpu_tier::DEFAULT_PULL_PIN_FRACTION,
            secret: None,
            encrypt: false,
            stripes: kvmesh_transfer::DEFAULT_STRIPES,
            allowed_consumers: Vec::new(),
            max_connections_per_ip: kvmesh_transfer::server::DEFAULT_MAX_CONNECTIONS_PER_IP,
            max_fetches_per_peer: kvmesh_transfer::server::DEFAULT_MAX_TRANSFERS_PER_PEER,
            max_pins_per_lookup: kvmesh_transfer::server::DEFAULT_MAX_PINS_PER_LOOKUP,
            max_pinned_per_peer: kvmesh_transfer::server::DEFAULT_MAX_PINNED_PER_PEER,
            role: Role::Both,
            bidirectional_kv_xfer: false,
            decoder_kv_blocks_ttl: Duration::from_secs(480),
            kv_recompute_threshold: 64,
            load_mode: P2pLoadMode::Async,
        }
    }
}

/// Everything an engine needs besides its backend and tokenizer.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub host: String,
    /// The host every address this engine tells others uses (`--advertise-host`): the P2P
    /// producer named in P/D hand-off params, the engine id, the KV-event endpoint announced at
    /// startup. `None` = derived from `host` ([`EngineConfig::advertised_host`]).
    pub advertise_host: Option<String>,
    /// 0 = pick a free port (the bound address is reported by the server).
    pub port: u16,
    pub served_model_name: String,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub cpu_offload_bytes: u64,
    pub kv_events: Option<KvEventsConfig>,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    /// Requests queued (admitted, not yet running) beyond which new ones get 429.
    pub max_waiting: usize,
    pub hash_algo: HashAlgo,
    /// `PYTHONHASHSEED`, as vLLM seeds NONE_HASH with it.
    pub hash_seed: Option<String>,
    /// The `engine` label of metrics (vLLM uses the data-parallel rank, "0").
    pub engine_label: String,
    pub p2p: P2pConfig,
}

/// Checks that a GPU tier of `num_blocks` blocks of `bytes_per_block` KV bytes (plus the pool's
/// bookkeeping per block) fits in `available` bytes of memory (`None`: unknown, not checked).
/// Returns the tier's size in bytes. Without the check, a typo in `--num-gpu-blocks` aborts the
/// engine with an allocation failure (SIGABRT) instead of naming the flag.
pub fn check_gpu_tier_fits(
    num_blocks: usize,
    bytes_per_block: usize,
    available: Option<u64>,
) -> Result<u64, ConfigError> {
    let per_block =
        (bytes_per_block.div_ceil(16) * 16 + crate::pool::BOOKKEEPING_BYTES_PER_BLOCK) as u64;
    let needed = (num_blocks as u64).checked_mul(per_block);
    match (needed, available) {
        (Some(n), Some(a)) if n <= a => Ok(n),
        (Some(n), None) => Ok(n),
        (needed, available) => Err(ConfigError::Invalid(format!(
            "--num-gpu-blocks {num_blocks} needs {} for the GPU tier ({per_block} bytes per block), \
             but {} of memory is available: lower --num-gpu-blocks",
            needed.map_or_else(|| "more than 2^64 bytes".to_owned(), format_bytes),
            available.map_or_else(|| "less".to_owned(), format_bytes),
        ))),
    }
}

fn format_bytes(b: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    format!("{:.1} GiB", b as f64 / GIB)
}

/// Memory this process can still take: the kernel's `MemAvailable` plus free swap, capped by the
/// cgroup's `memory.max` less its current use when one is set (a container's limit). `None`
/// where neither can be read (not Linux).
pub fn available_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let field = |name: &str| {
        meminfo.as_deref()?.lines().find_map(|l| {
            let kib = l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim();
            kib.parse::<u64>().ok().map(|k| k.saturating_mul(1024))
        })
    };
    let host = field("MemAvailable:").map(|m| m.saturating_add(field("SwapFree:").unwrap_or(0)));
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    let cgroup = read("/sys/fs/cgroup/memory.max")
        .map(|max| max.saturating_sub(read("/sys/fs/cgroup/memory.current").unwrap_or(0)));
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `--max-model-len` when not given: a real model's context length, else this.
pub const DEFAULT_MAX_MODEL_LEN: usize = 131_072;

/// The engine's `max_model_len`, as vLLM settles it: an explicit value must fit the model's
/// context and the GPU KV pool (one sequence of that length must be servable); without one,
/// the largest length that does.
pub fn resolve_max_model_len(
    explicit: Option<usize>,
    model_context: Option<usize>,
    num_gpu_blocks: usize,
    block_size: usize,
) -> Result<usize, ConfigError> {
    let capacity = num_gpu_blocks.saturating_mul(block_size);
    let Some(len) = explicit else {
        return Ok(model_context.unwrap_or(DEFAULT_MAX_MODEL_LEN).min(capacity));
    };
    if let Some(context) = model_context
        && len > context
    {
        return Err(ConfigError::Invalid(format!(
            "--max-model-len {len} exceeds the model's context length {context}"
        )));
    }
    if len > capacity {
        return Err(ConfigError::Invalid(format!(
            "--max-model-len {len} needs {} KV blocks of {block_size} tokens for one sequence, but \
             --num-gpu-blocks is {num_gpu_blocks} ({capacity} tokens): raise --num-gpu-blocks or \
             lower --max-model-len",
            len.div_ceil(block_size.max(1))
        )));
    }
    Ok(len)
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            advertise_host: None,
            port: 8000,
            served_model_name: "sim".to_owned(),
            block_size: 16,
            num_gpu_blocks: 4096,
            cpu_offload_bytes: 1 << 30,
            kv_events: None,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            max_model_len: 131_072,
            max_waiting: 4096,
            hash_algo: HashAlgo::Sha256Cbor,
            hash_seed: std::env::var("PYTHONHASHSEED").ok(),
            engine_label: "0".to_owned(),
            p2p: P2pConfig::default(),
        }
    }
}

impl EngineConfig {
    /// Checks the values that would otherwise make the scheduler stall or divide by zero.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Invalid("--block-size must be > 0".into()));
        }
        if self.num_gpu_blocks < 2 {
            return Err(ConfigError::Invalid("--num-gpu-blocks must be >= 2".into()));
        }
        let max_blocks = crate::compute::BlockId::MAX as usize;
        if self.num_gpu_blocks > max_blocks {
            return Err(ConfigError::Invalid(format!(
                "--num-gpu-blocks {} is more blocks than the engine can address (at most {max_blocks})",
                self.num_gpu_blocks
            )));
        }
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 {
            return Err(ConfigError::Invalid(
                "--max-num-batched-tokens and --max-num-seqs must be > 0".into(),
            ));
        }
        if self.max_model_len == 0 {
            return Err(ConfigError::Invalid("--max-model-len must be > 0".into()));
        }
        if !(0.0..=1.0).contains(&self.p2p.pull_pin_fraction) {
            return Err(ConfigError::Invalid(format!(
                "--p2p-pull-pin-fraction must be between 0 and 1, got {}",
                self.p2p.pull_pin_fraction
            )));
        }
        if self.p2p.encrypt && self.p2p.secret.is_none() {
            return Err(ConfigError::Invalid(
                "--p2p-encrypt derives its keys from the shared secret: set --p2p-secret-file"
                    .into(),
            ));
        }
        if self.p2p.stripes == 0 {
            return Err(ConfigError::Invalid("--p2p-stripes must be > 0".into()));
        }
        if !(self.p2p.deadline_factor.is_finite() && self.p2p.deadline_factor >= 1.0) {
            return Err(ConfigError::Invalid(format!(
                "--p2p-deadline-factor must be a finite number >= 1, got {}",
                self.p2p.deadline_factor
            )));
        }
        self.validate_producer()?;
        self.advertised_host().map(drop)
    }

    /// The host this engine names to peers (see [`resolve_advertise_host`]): what the P2P
    /// producer's address, the P/D hand-off params and the announced KV-event endpoint use.
    pub fn advertised_host(&self) -> Result<Option<String>, ConfigError> {
        resolve_advertise_host(
            &self.host,
            self.advertise_host.as_deref(),
            self.peer_reach(),
        )
    }

    /// Who must reach this engine at an address it hands out. Only the P2P producer is ever
    /// named to peers (P2P sources, P/D prefill and bi-directional params all point at it);
    /// without it P/D roles return no params and so tell nobody an address.
    fn peer_reach(&self) -> PeerReach {
        if self.p2p.port.is_none() {
            return PeerReach::Nobody;
        }
        let mut listed = self
            .p2p
            .allowed_consumers
            .iter()
            .filter(|s| !s.trim().is_empty())
            .peekable();
        // An empty allow-list admits anyone (with a secret), so peers may be anywhere.
        if listed.peek().is_some() && listed.all(|s| is_loopback_net(s)) {
            PeerReach::LoopbackOnly
        } else {
            PeerReach::Beyond
        }
    }

    /// A P2P producer beyond loopback must authenticate its consumers or list them: otherwise
    /// any host that reaches the port reads this engine's KV and pins its CPU tier.
    fn validate_producer(&self) -> Result<(), ConfigError> {
        if self.p2p.port.is_none() {
            return Ok(());
        }
        let p2p = &self.p2p;
        let consumers = parse_allowed_consumers(&p2p.allowed_consumers)
            .map_err(|e| ConfigError::Invalid(format!("--p2p-allowed-consumers: {e}")))?;
        if p2p.max_fetches_per_peer == 0 {
            return Err(ConfigError::Invalid(
                "--p2p-max-fetches-per-peer must be > 0".into(),
            ));
        }
        if p2p.max_connections_per_ip == 0 {
            return Err(ConfigError::Invalid(
                "--p2p-max-connections-per-ip must be > 0".into(),
            ));
        }
        if !is_loopback_host(&self.host) && p2p.secret.is_none() && consumers.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "--p2p-port with --host {} would serve this engine's KV cache to any host that \
                 can reach it: set --p2p-secret-file (peers authenticate, every frame is MACed) \
                 and/or --p2p-allowed-consumers (addresses or networks, e.g. 10.0.0.0/8), or bind \
                 --host 127.0.0.1",
                self.host
            )));
        }
        Ok(())
    }
}

/// Who must connect to an address the engine hands out ([`EngineConfig::peer_reach`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerReach {
    /// No service peers connect to is on: no address is handed out.
    Nobody,
    /// Peers exist but `--p2p-allowed-consumers` admits only loopback: they share this host.
    LoopbackOnly,
    /// Peers may be on other hosts.
    Beyond,
}

/// Whether `host` binds every interface (`0.0.0.0`, `::`, `[::]`, ZeroMQ's `*`, or empty):
/// such an address means nothing to a peer that should connect to it.
pub fn is_wildcard_host(host: &str) -> bool {
    let bare = strip_brackets(host);
    bare.is_empty()
        || bare == "*"
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified())
}

fn strip_brackets(host: &str) -> &str {
    let t = host.trim();
    t.strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(t)
}

/// The host an engine bound on `bind_host` tells others, given `--advertise-host` and who must
/// reach it. Returned bare (an IPv6 address without brackets; [`host_port`] adds them).
///
/// - `--advertise-host` wins (it must be a host a peer can dial: not a wildcard).
/// - Otherwise a concrete bind host is itself the address.
/// - A wildcard bind with peers beyond this host is refused: no address we could pick is known
///   to be reachable from them (loopback would send a peer to itself), so the operator names it.
/// - A wildcard bind whose peers are all on loopback advertises loopback (of the bind's family).
/// - A wildcard bind nobody needs to reach advertises nothing.
pub fn resolve_advertise_host(
    bind_host: &str,
    advertise: Option<&str>,
    reach: PeerReach,
) -> Result<Option<String>, ConfigError> {
    if let Some(adv) = advertise {
        let bare = strip_brackets(adv);
        if is_wildcard_host(bare) || bare.contains(|c: char| c.is_whitespace() || c == '/') {
            return Err(ConfigError::Invalid(format!(
                "--advertise-host `{adv}` is not an address peers can connect to (give this \
                 engine's IP or DNS name, e.g. 10.0.0.7)"
            )));
        }
        return Ok(Some(bare.to_owned()));
    }
    if !is_wildcard_host(bind_host) {
        return Ok(Some(strip_brackets(bind_host).to_owned()));
    }
    match reach {
        PeerReach::Nobody => Ok(None),
        PeerReach::LoopbackOnly => {
            let v6 = strip_brackets(bind_host).contains(':');
            Ok(Some(if v6 { "::1" } else { "127.0.0.1" }.to_owned()))
        }
        PeerReach::Beyond => Err(ConfigError::Invalid(format!(
            "--host {bind_host} binds all interfaces, but peers on other hosts must be told \
             where to reach this engine's P2P producer (P2P sources, P/D hand-off params): set \
             --advertise-host to the address they connect to (e.g. this machine's IP or the pod \
             IP), or bind --host to that address"
        ))),
    }
}

/// An address this engine tells others: a host (IP or DNS name, bare) and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertisedAddr {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for AdvertisedAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&host_port(&self.host, self.port))
    }
}

/// `host:port`, with an IPv6 host in brackets (`[fd00::7]:7100`).
pub fn host_port(host: &str, port: u16) -> String {
    let bare = strip_brackets(host);
    if bare.contains(':') {
        format!("[{bare}]:{port}")
    } else {
        format!("{bare}:{port}")
    }
}

/// Whether a `--p2p-allowed-consumers` entry admits only loopback addresses (`127.0.0.1`,
/// `127.0.0.0/8`, `::1`); a wider or unparsable network does not.
fn is_loopback_net(entry: &str) -> bool {
    let (addr, prefix) = match entry.trim().split_once('/') {
        Some((a, p)) => (a, p.parse::<u8>().ok()),
        None => (entry.trim(), None),
    };
    let Ok(ip) = strip_brackets(addr).parse::<std::net::IpAddr>() else {
        return false;
    };
    match ip.to_canonical() {
        std::net::IpAddr::V4(v4) => {
            v4.is_loopback() && prefix.is_none_or(|p| (8..=32).contains(&p))
        }
        std::net::IpAddr::V6(v6) => v6.is_loopback() && prefix.is_none_or(|p| p == 128),
    }
}

/// Whether `host` names only this machine (`localhost`, `127.0.0.0/8`, `::1`).
fn is_loopback_host(host: &str) -> bool {
    let bare = host.trim().trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// `--p2p-allowed-consumers` entries (blank ones skipped) as networks.
pub fn parse_allowed_consumers(
    items: &[String],
) -> Result<Vec<kvmesh_transfer::IpNet>, kvmesh_transfer::IpNetError> {
    items
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_accept_binary_and_decimal_units() {
        assert_eq!(parse_byte_size("2GiB").unwrap(), 2 * 1024 * 1024 * 1024);
        assert_eq!(parse_byte_size("512MiB").unwrap(), 512 * 1024 * 1024);
        assert_eq!(parse_byte_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_byte_size("4096").unwrap(), 4096);
        assert!(parse_byte_size("2 parsecs").is_err());
        assert!(parse_byte_size("").is_err());
    }

    #[test]
    fn a_gpu_tier_that_cannot_be_addressed_or_allocated_is_refused_naming_the_flag() {
        let mut c = EngineConfig {
            num_gpu_blocks: 100_000_000_000,
            ..EngineConfig::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("--num-gpu-blocks 100000000000"), "{err}");
        c.num_gpu_blocks = 4096;
        assert!(c.validate().is_ok());
        // 4096 blocks of 512 KV bytes fit in 1 GiB; 4 M of them do not.
        let gib = Some(1u64 << 30);
        let bytes = check_gpu_tier_fits(4096, 512, gib).unwrap();
        assert!((4096 * 512..4096 * 600).contains(&bytes), "{bytes}");
        let err = check_gpu_tier_fits(4 << 20, 512, gib)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--num-gpu-blocks 4194304") && err.contains("1.0 GiB of memory"),
            "{err}"
        );
        // A size past 2^64 bytes is refused too, and unknown memory is not checked.
        assert!(check_gpu_tier_fits(usize::MAX, 1 << 20, gib).is_err());
        assert!(check_gpu_tier_fits(1 << 30, 512, None).is_ok());
    }

    #[test]
    fn a_pull_pin_share_outside_zero_to_one_is_refused_with_the_flag_named() {
        let mut c = EngineConfig::default();
        c.p2p.pull_pin_fraction = 1.5;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("--p2p-pull-pin-fraction"), "{err}");
        c.p2p.pull_pin_fraction = 0.0;
        assert!(c.validate().is_ok());
    }

    #[test]
    fn encryption_needs_the_secret_and_stripes_must_be_positive() {
        let mut c = EngineConfig::default();
        c.p2p.encrypt = true;
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("--p2p-encrypt") && err.contains("--p2p-secret-file"),
            "{err}"
        );
        c.p2p.secret = Some(kvmesh_transfer::Secret::from("s"));
        assert!(c.validate().is_ok());
        c.p2p.stripes = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("--p2p-stripes"), "{err}");
    }

    #[test]
    fn a_p2p_producer_beyond_loopback_needs_a_secret_or_an_allow_list() {
        let mut c = EngineConfig::default();
        c.p2p.port = Some(0);
        assert!(
            c.validate().is_ok(),
            "loopback stays open (tests, the demo)"
        );
        for host in ["0.0.0.0", "::", "10.1.2.3", "engine-a"] {
            c.host = host.into();
            let err = c.validate().unwrap_err().to_string();
            assert!(
                err.contains("--p2p-secret-file") && err.contains("--p2p-allowed-consumers"),
                "{host}: {err}"
            );
        }
        c.host = "0.0.0.0".into();
        c.advertise_host = Some("10.0.0.7".into());
        c.p2p.allowed_consumers = vec!["10.0.0.0/8".into()];
        assert!(c.validate().is_ok());
        c.p2p.allowed_consumers = vec!["not-an-ip".into()];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("--p2p-allowed-consumers"), "{err}");
        c.p2p.allowed_consumers.clear();
        c.p2p.secret = Some(kvmesh_transfer::Secret::from("s"));
        assert!(c.validate().is_ok());
        // Without a producer there is nothing to protect.
        c.p2p.secret = None;
        c.p2p.port = None;
        assert!(c.validate().is_ok());
        for host in ["127.0.0.1", "127.9.9.9", "localhost", "::1", "[::1]"] {
            assert!(is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn the_advertised_host_follows_the_flag_then_a_concrete_bind_else_refuses() {
        use PeerReach::{Beyond, LoopbackOnly, Nobody};
        let ok = |bind: &str, adv: Option<&str>, reach| {
            resolve_advertise_host(bind, adv, reach).unwrap()
        };
        let some = |h: &str| Some(h.to_owned());
        // The flag wins over any bind host, whoever the peers are.
        for bind in ["0.0.0.0", "::", "[::]", "127.0.0.1", "10.0.0.5", "*"] {
            for reach in [Nobody, LoopbackOnly, Beyond] {
                assert_eq!(
                    ok(bind, Some("10.0.0.7"), reach),
                    some("10.0.0.7"),
                    "{bind}"
                );
            }
        }
        assert_eq!(ok("::", Some("[fd00::7]"), Beyond), some("fd00::7"));
        assert_eq!(
            ok("0.0.0.0", Some("engine-0.kv"), Beyond),
            some("engine-0.kv")
        );
        // A concrete bind host is its own address.
        for reach in [Nobody, LoopbackOnly, Beyond] {
            assert_eq!(ok("10.0.0.5", None, reach), some("10.0.0.5"));
            assert_eq!(ok("[fd00::5]", None, reach), some("fd00::5"));
            assert_eq!(ok("engine-a", None, reach), some("engine-a"));
            assert_eq!(ok("127.0.0.1", None, reach), some("127.0.0.1"));
        }
        // A wildcard bind: nothing to tell, loopback peers, or refused naming the flag.
        for bind in ["0.0.0.0", "::", "[::]", "*", ""] {
            assert_eq!(ok(bind, None, Nobody), None, "{bind}");
            let err = resolve_advertise_host(bind, None, Beyond)
                .unwrap_err()
                .to_string();
            assert!(err.contains("--advertise-host"), "{bind}: {err}");
        }
        assert_eq!(ok("0.0.0.0", None, LoopbackOnly), some("127.0.0.1"));
        assert_eq!(ok("::", None, LoopbackOnly), some("::1"));
        // A wildcard is no address to hand out.
        for adv in ["0.0.0.0", "::", "[::]", "*", "", " ", "10.0.0.7/8"] {
            let err = resolve_advertise_host("10.0.0.5", Some(adv), Beyond)
                .unwrap_err()
                .to_string();
            assert!(err.contains("--advertise-host"), "{adv:?}: {err}");
        }
    }

    #[test]
    fn peers_must_be_told_an_address_only_when_the_producer_serves_beyond_loopback() {
        let mut c = EngineConfig {
            host: "0.0.0.0".into(),
            ..EngineConfig::default()
        };
        // No producer: P/D roles and bi-directional transfer hand out no address either.
        c.p2p.role = Role::Prefill;
        c.p2p.bidirectional_kv_xfer = true;
        assert_eq!(c.peer_reach(), PeerReach::Nobody);
        assert!(c.validate().is_ok());
        c.p2p.port = Some(0);
        c.p2p.allowed_consumers = vec!["127.0.0.0/8".into(), "::1".into(), " ".into()];
        assert_eq!(c.peer_reach(), PeerReach::LoopbackOnly);
        assert_eq!(c.advertised_host().unwrap().as_deref(), Some("127.0.0.1"));
        for wider in ["10.0.0.0/8", "127.0.0.0/7", "0.0.0.0/0", "::/0", "bogus"] {
            c.p2p.allowed_consumers = vec!["127.0.0.1".into(), wider.into()];
            assert_eq!(c.peer_reach(), PeerReach::Beyond, "{wider}");
        }
        c.p2p.allowed_consumers = vec!["10.0.0.0/8".into()];
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("--advertise-host") && err.contains("0.0.0.0"),
            "{err}"
        );
        c.p2p.allowed_consumers.clear();
        c.p2p.secret = Some(kvmesh_transfer::Secret::from("s"));
        assert_eq!(c.peer_reach(), PeerReach::Beyond);
        assert!(c.validate().is_err());
        c.advertise_host = Some("10.0.0.7".into());
        assert!(c.validate().is_ok());
        assert_eq!(c.advertised_host().unwrap().as_deref(), Some("10.0.0.7"));
    }

    #[test]
    fn host_port_brackets_ipv6() {
        assert_eq!(host_port("10.0.0.7", 7100), "10.0.0.7:7100");
        assert_eq!(host_port("fd00::7", 7100), "[fd00::7]:7100");
        assert_eq!(host_port("[::1]", 1), "[::1]:1");
        assert_eq!(host_port("engine-a", 80), "engine-a:80");
    }

    #[test]
    fn max_model_len_fits_the_model_and_the_kv_pool_as_in_vllm() {
        // Defaults: the model's context, else 128K — never more than the pool holds.
        assert_eq!(
            resolve_max_model_len(None, Some(8192), 4096, 16).unwrap(),
            8192
        );
        assert_eq!(resolve_max_model_len(None, None, 4096, 16).unwrap(), 65_536);
        assert_eq!(
            resolve_max_model_len(None, None, 1 << 20, 16).unwrap(),
            131_072
        );
        assert_eq!(
            resolve_max_model_len(Some(4096), Some(8192), 4096, 16).unwrap(),
            4096
        );
        let too_long = resolve_max_model_len(Some(16_384), Some(8192), 4096, 16)
            .unwrap_err()
            .to_string();
        assert!(too_long.contains("context length 8192"), "{too_long}");
        let no_room = resolve_max_model_len(Some(131_072), None, 4096, 16)
            .unwrap_err()
            .to_string();
        assert!(
            no_room.contains("8192 KV blocks") && no_room.contains("--num-gpu-blocks"),
            "{no_room}"
        );
    }

    #[test]
    fn kv_events_config_parses_vllm_json() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events","replay_endpoint":"tcp://*:5558"}"#,
        )
        .unwrap();
        assert!(c.enabled());
        assert_eq!(c.topic, "kv-events");
        assert_eq!(c.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        assert!(KvEventsConfig::parse("{not json").is_err());
        let off = KvEventsConfig::parse(r#"{"enable_kv_cache_events":false}"#).unwrap();
        assert!(!off.enabled());
        // An explicit `*` keeps vLLM's meaning (all interfaces, bound by the engine)...
        assert!(!c.bind);
        // ...while no endpoint at all binds loopback only.
        let d =
            KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"zmq"}"#).unwrap();
        assert_eq!(
            (d.endpoint.as_str(), d.bind),
            (DEFAULT_KV_EVENTS_ENDPOINT, true)
        );
        let b = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:6000","bind":true}"#,
        )
        .unwrap();
        assert!(b.bind);
    }
}
