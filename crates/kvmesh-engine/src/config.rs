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
    /// Optional ROUTER socket answering replay requests.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    #[serde(default)]
    pub topic: String,
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
    /// Share (0..=1) of the CPU tier that blocks landed by pulls for requests not yet scheduled
    /// may hold pinned; beyond it pulled blocks land evictable (`--p2p-pull-pin-fraction`).
    pub pull_pin_fraction: f64,
    /// Optional shared secret peers must prove (`--p2p-secret-file`; never on the command line).
    /// With it every P2P frame after the handshake is MACed.
    pub secret: Option<kvmesh_transfer::Secret>,
    /// Addresses or networks (`10.0.0.7`, `10.0.0.0/8`) our producer serves; empty = any, which
    /// is allowed only on loopback or with a secret (`--p2p-allowed-consumers`).
    pub allowed_consumers: Vec<String>,
    /// Connections one peer address may hold on our producer (`--p2p-max-connections-per-ip`).
    pub max_connections_per_ip: usize,
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
}

impl Default for P2pConfig {
    fn default() -> Self {
        Self {
            port: None,
            allowed_peers: Vec::new(),
            timeout: Duration::from_millis(5_000),
            pending_deadline: Duration::from_millis(2_000),
            pull_pin_fraction: crate::cpu_tier::DEFAULT_PULL_PIN_FRACTION,
            secret: None,
            allowed_consumers: Vec::new(),
            max_connections_per_ip: kvmesh_transfer::server::DEFAULT_MAX_CONNECTIONS_PER_IP,
            max_pins_per_lookup: kvmesh_transfer::server::DEFAULT_MAX_PINS_PER_LOOKUP,
            max_pinned_per_peer: kvmesh_transfer::server::DEFAULT_MAX_PINNED_PER_PEER,
            role: Role::Both,
            bidirectional_kv_xfer: false,
            decoder_kv_blocks_ttl: Duration::from_secs(480),
            kv_recompute_threshold: 64,
        }
    }
}

/// Everything an engine needs besides its backend and tokenizer.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub host: String,
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
        self.validate_producer()
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

/// Whether `host` names only this machine (`localhost`, `127.0.0.0/8`, `::1`).
pub fn is_loopback_host(host: &str) -> bool {
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
    fn a_pull_pin_share_outside_zero_to_one_is_refused_with_the_flag_named() {
        let mut c = EngineConfig::default();
        c.p2p.pull_pin_fraction = 1.5;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("--p2p-pull-pin-fraction"), "{err}");
        c.p2p.pull_pin_fraction = 0.0;
        assert!(c.validate().is_ok());
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
