//! Router configuration (YAML), in the spirit of llm-d's `EndpointPickerConfig`: the top-level
//! shape — where endpoints come from, how prompts are cut, placement (plugins, profiles, cost
//! model, admission queue), health, bounds — and the features' sections, each typed in its own
//! folder (`prefetch::config`, `replication::config`, `pd::config`).
//!
//! ```yaml
//! block_size: 16
//! endpoints:
//!   - {name: e0, url: "http://127.0.0.1:8100", p2p: "127.0.0.1:7100", role: both,
//!      kv_events: {endpoint: "tcp://127.0.0.1:5557", topic: kv-events}}
//!   # Endpoints whose KV blocks are not interchangeable (e.g. a vLLM server beside kvmesh
//!   # engines) get their own `kv_group`: pulls and P/D hand-offs stay inside a group.
//!   - {name: v0, url: "http://127.0.0.1:8200", p2p: "127.0.0.1:7200", kv_group: vllm-llama}
//! # or: endpoints_file: fleet.yaml
//! # Either list is watched (`kvmesh router --config` watches this file): endpoint changes apply
//! # without a restart; other settings need one.
//! plugins:
//!   - {type: prefix-cache-scorer, name: prefix}
//! scheduling_profiles:
//!   - {name: affinity, plugins: [{plugin_ref: prefix, weight: 3}]}
//! # LoRA adapters the engines serve (vLLM's `--lora-modules name=path`): a request whose
//! # `model` is one of these names, or that carries a `cache_salt`, only matches blocks of its
//! # own adapter and salt.
//! lora_adapters:
//!   - {name: sql-lora, path: /models/adapters/sql-lora}
//! ```
//! Durations are strings like `500ms`, `2s`, `1m`.

pub mod error;
mod keys;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvmesh_core::TenantKeys;
use kvmesh_sched::admission_queue::AdmissionQueueConfig;
use kvmesh_sched::config::duration_str;
pub use kvmesh_sched::config::{PluginRef, PluginSpec, ProfileSpec};
use kvmesh_sched::cost_model::CostModelParams;
use kvmesh_sched::reputation::ReputationParams;
use serde::{Deserialize, Serialize};

pub use self::error::ConfigError;
use crate::pd::config::PdConfig;
use crate::prefetch::config::PrefetchConfig;
use crate::replication::config::ReplicationConfig;

/// What an endpoint does in P/D disaggregation; aggregated serving uses `both` (and, if no
/// endpoint is `both`, every endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

/// Where an engine publishes KV events (`docs/protocols.md#kv-events`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsSpec {
    /// ZMQ endpoint, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// Whether the router binds this endpoint (when the engine was configured to *connect*, i.e.
    /// its endpoint has no `*`). Default: connect to an engine that binds.
    #[serde(default)]
    pub bind: bool,
    #[serde(default)]
    pub topic: String,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// With `bind: true`: the networks engines may publish from (`10.0.0.0/8`, `fd00::7`);
    /// default the addresses of the endpoint's `url` host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_peers: Option<Vec<String>>,
}

/// One engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// Unique name (metrics label, debug output).
    pub name: String,
    /// OpenAI base URL, e.g. `http://127.0.0.1:8100`.
    pub url: String,
    #[serde(default)]
    pub kv_events: Option<KvEventsSpec>,
    /// P2P producer address `host:port`; without it the endpoint is never named as a pull source.
    #[serde(default)]
    pub p2p: Option<String>,
    #[serde(default)]
    pub role: Role,
    /// KV compatibility group: endpoints whose KV blocks are interchangeable (same model, block
    /// size, dtype, layout, hash algorithm) share a group, and the router names pull sources and
    /// P/D hand-offs only within one. A pull across groups would be refused by the fingerprint
    /// and recomputed, so naming it only wastes a round trip and counts a failure. Default: one
    /// implicit group shared by every endpoint without one (today's behaviour).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_group: Option<String>,
}

impl EndpointSpec {
    /// The endpoint's KV group, `None` for the implicit default group (an empty string counts as
    /// none, so a templated `kv_group: ""` does not split a fleet by accident).
    pub fn kv_group(&self) -> Option<&str> {
        self.kv_group.as_deref().filter(|g| !g.is_empty())
    }

    /// `(host, port)` of the P2P address, if configured and well-formed.
    pub fn p2p_host_port(&self) -> Option<(String, u16)> {
        let s = self.p2p.as_deref()?;
        let (host, port) = s.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        Some((host.to_owned(), port.parse().ok()?))
    }
}

/// Tokenizer used to cut prompts into blocks; must match the engines'. In YAML: `tokenizer: byte`,
/// `tokenizer: /models/Llama-3.2-1B-Instruct` (a local model directory, as vLLM's `--tokenizer`
/// takes it), or `tokenizer: {path: DIR or tokenizer.json, chat_template: template.jinja}`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "TokenizerYaml", into = "TokenizerYaml")]
pub enum TokenizerSpec {
    /// One token per UTF-8 byte (kvmesh `sim` engines).
    #[default]
    Byte,
    /// A HF model directory or `tokenizer.json`, found as transformers finds it
    /// (`kvmesh_text::HfTokenizer::load`: `tokenizer_config.json`, `chat_template.jinja` beside
    /// it), optionally with a Jinja chat template file that replaces the model's.
    Hf {
        path: PathBuf,
        chat_template: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum TokenizerYaml {
    Name(String),
    Hf {
        path: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chat_template: Option<PathBuf>,
    },
}

impl TryFrom<TokenizerYaml> for TokenizerSpec {
    type Error = String;
    fn try_from(y: TokenizerYaml) -> Result<Self, String> {
        match y {
            TokenizerYaml::Name(n) if n == "byte" => Ok(TokenizerSpec::Byte),
            // A bare string that looks like a path is a model directory or tokenizer file; a bare
            // word (`gpt2`) is more likely a hub name kvmesh cannot fetch than a directory.
            TokenizerYaml::Name(n)
                if n.contains(std::path::MAIN_SEPARATOR)
                    || n.contains('/')
                    || n.ends_with(".json") =>
            {
                Ok(TokenizerSpec::Hf {
                    path: n.into(),
                    chat_template: None,
                })
            }
            TokenizerYaml::Name(n) => Err(format!(
                "unknown tokenizer {n:?}: use `byte`, a local model directory (e.g. `./{n}`) or \
                 {{path: DIR or tokenizer.json, chat_template: FILE}}"
            )),
            TokenizerYaml::Hf {
                path,
                chat_template,
            } => Ok(TokenizerSpec::Hf {
                path,
                chat_template,
            }),
        }
    }
}

impl From<TokenizerSpec> for TokenizerYaml {
    fn from(t: TokenizerSpec) -> Self {
        match t {
            TokenizerSpec::Byte => TokenizerYaml::Name("byte".to_owned()),
            TokenizerSpec::Hf {
                path,
                chat_template,
            } => TokenizerYaml::Hf {
                path,
                chat_template,
            },
        }
    }
}

/// Active health checks: an endpoint failing `unhealthy_threshold` checks in a row is ejected and
/// readmitted after `healthy_threshold` passing ones.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthCheckConfig {
    #[serde(with = "duration_str")]
    pub interval: Duration,
    #[serde(with = "duration_str")]
    pub timeout: Duration,
    pub unhealthy_threshold: u32,
    pub healthy_threshold: u32,
    pub path: String,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        HealthCheckConfig {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            unhealthy_threshold: 3,
            healthy_threshold: 1,
            path: "/health".to_owned(),
        }
    }
}

/// Bounds of the prefix index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexSettings {
    pub max_blocks: usize,
    /// After KV events were lost (a gap replay could not fill), how long an endpoint's
    /// unconfirmed entries keep answering lookups before they are aged out.
    #[serde(with = "duration_str")]
    pub gap_grace: Duration,
    /// Stored blocks one endpoint's events may announce per second (bursts of 10 s of it).
    pub max_blocks_per_second: u64,
}

impl Default for IndexSettings {
    fn default() -> Self {
        IndexSettings {
            max_blocks: 4_000_000,
            gap_grace: Duration::from_secs(10),
            max_blocks_per_second: kvmesh_index::DEFAULT_MAX_BLOCKS_PER_SECOND,
        }
    }
}

fn default_block_size() -> usize {
    16
}
fn default_scrape() -> Duration {
    // As `configs/router.yaml` and every benchmark: queue gauges half a second old mislead
    // placement during a burst.
    Duration::from_millis(200)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(600)
}
fn default_stream_idle_timeout() -> Duration {
    // Far above any decode step, preemption included, yet a client learns of a frozen engine
    // within a minute instead of never.
    Duration::from_secs(60)
}
fn default_max_prompt_tokens() -> usize {
    1 << 20
}

fn default_decisions() -> usize {
    1024
}
fn default_max_in_flight() -> usize {
    4096
}

fn default_max_body() -> usize {
    64 << 20
}

/// The whole router config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    #[serde(default)]
    pub endpoints: Vec<EndpointSpec>,
    /// A YAML file with `endpoints: [...]` (or a bare list), watched for changes.
    #[serde(default)]
    pub endpoints_file: Option<PathBuf>,
    /// Where the endpoint list comes from: absent or `kind: static` = `endpoints` /
    /// `endpoints_file`; `dns` and `kubernetes` discover it (`docs/discovery.md`).
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// Router block size in tokens (engine block sizes must be multiples of it).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    #[serde(default)]
    pub tokenizer: TokenizerSpec,
    #[serde(default)]
    pub plugins: Vec<PluginSpec>,
    #[serde(default)]
    pub scheduling_profiles: Vec<ProfileSpec>,
    /// Profile used unless a request names one with `x-kvmesh-profile`; default the first.
    #[serde(default)]
    pub default_profile: Option<String>,
    #[serde(default = "default_scrape", with = "duration_str")]
    pub metrics_scrape_interval: Duration,
    #[serde(default)]
    pub health_check: HealthCheckConfig,
    /// Maximum wait for an engine's response headers and, counted from the same send, for the
    /// first chunk of its body (not the whole stream).
    #[serde(default = "default_request_timeout", with = "duration_str")]
    pub request_timeout: Duration,
    /// Longest gap between two chunks of an engine's response once its first chunk arrived. A
    /// stream that stalls longer (a frozen engine) is ended with an SSE error event
    /// (`data: {"error": {...}}`, which OpenAI clients raise) and counted
    /// (`kvmesh_router_errors_total{kind="upstream_stalled"}`); a non-stream body is cut.
    #[serde(default = "default_stream_idle_timeout", with = "duration_str")]
    pub stream_idle_timeout: Duration,
    /// Seed of the scheduling rng (random tie-breaks, weighted picks); random if absent.
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub cost_model: CostModelParams,
    #[serde(default)]
    pub index: IndexSettings,
    /// How many recent decisions `/debug/decisions` keeps.
    #[serde(default = "default_decisions")]
    pub decisions_capacity: usize,
    /// The longest prompt the router tokenizes, in tokens (default 1,048,576); longer ones get
    /// vLLM's 400 "maximum context length" answer, before encoding when the text alone proves
    /// it. Bounds the router's memory per request: ids take 4 bytes per token.
    #[serde(default = "default_max_prompt_tokens")]
    pub max_prompt_tokens: usize,
    /// Also send llm-d's `x-kv-cache-source-host-port` header (for llm-d sidecars).
    #[serde(default)]
    pub source_header: bool,
    /// Largest accepted request body.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Forward `kv_transfer_params` sent by clients. Off by default: the router is the only one
    /// that names `remote_kv_source` (a client could otherwise point engines at any port of an
    /// allowed host, or hold pins); dropped params are counted.
    #[serde(default)]
    pub trust_client_kv_transfer_params: bool,
    /// Most client requests held at once (parsing, queued, forwarding, streaming); beyond it the
    /// router answers 503 with `Retry-After`.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// P/D disaggregation (prefill + decode profiles, decider, bi-directional conversations).
    #[serde(default)]
    pub pd: Option<PdConfig>,
    /// The admission queue: hold requests while every endpoint has its share of prefill queued and
    /// release them shortest work first (`kvmesh_sched::admission_queue`). Absent = place on arrival.
    #[serde(default)]
    pub admission_queue: Option<AdmissionQueueConfig>,
    /// How P2P sources whose pulls miss, stall or fail verification are penalised
    /// (`kvmesh_sched::reputation`): decaying per source and reason; the defaults apply when
    /// absent.
    #[serde(default)]
    pub p2p_reputation: ReputationParams,
    /// Prefetch ahead of arrival: follow sessions and, when a turn ends, have a second engine
    /// pull the history during the client's gap (`docs/architecture.md#prefetch`). Absent = off.
    #[serde(default)]
    pub prefetch: Option<PrefetchConfig>,
    /// Hot-prefix replication: copy a prefix that keeps being asked for while every holder is
    /// busy to a second engine ahead of demand (`docs/architecture.md#hot-prefix-replication`).
    /// Absent = off.
    #[serde(default)]
    pub replication: Option<ReplicationConfig>,
    /// A client connection must deliver a request's complete headers within this, counted from
    /// when it opens or its previous response ended (so it also bounds idle keep-alive
    /// connections); no two chunks of a request body may be further apart.
    #[serde(default = "default_header_read_timeout", with = "duration_str")]
    pub header_read_timeout: Duration,
    /// On shutdown (SIGTERM, Ctrl-C), how long in-flight requests, streams included, may take
    /// to finish after the listener closes.
    #[serde(default = "default_drain_timeout", with = "duration_str")]
    pub drain_timeout: Duration,
    /// Client connection caps and request-body bounds (`docs/reliability.md#hostile-clients`).
    #[serde(default)]
    pub http: kvmesh_http::HttpSettings,
    /// The LoRA adapters the engines serve, as given to vLLM's `--lora-modules name=path`. A
    /// request whose `model` names one is keyed in that adapter's key space (vLLM hashes the
    /// adapter into every block), so it never scores or pulls base-model blocks, nor they its.
    #[serde(default)]
    pub lora_adapters: Vec<kvmesh_core::LoraAdapter>,
}

fn default_header_read_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}

impl Default for RouterConfig {
    fn default() -> Self {
        serde_norway::from_str("{}")
            .unwrap_or_else(|_| unreachable!("empty config has defaults for every field"))
    }
}

/// The default placement, `configs/router.yaml`, embedded: the file a user runs is the one the
/// router falls back to and the one the bench's default arm measures.
pub const DEFAULT_CONFIG_YAML: &str = include_str!("../../../../configs/router.yaml");

impl RouterConfig {
    /// Loads and validates a config file; a relative `endpoints_file` is resolved against the
    /// config's directory.
    pub fn load(path: &Path) -> Result<RouterConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut cfg = RouterConfig::from_yaml(&text, path)?;
        if let Some(f) = &cfg.endpoints_file
            && f.is_relative()
            && let Some(dir) = path.parent()
        {
            cfg.endpoints_file = Some(dir.join(f));
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a config (`origin` names it in errors); not validated. Deprecated spellings of keys
    /// (llm-d's camelCase, `dispatch`) are read as their snake_case names, with a warning per key.
    pub fn from_yaml(text: &str, origin: &Path) -> Result<RouterConfig, ConfigError> {
        let parse = |source| ConfigError::Parse {
            path: origin.to_owned(),
            source,
        };
        let mut doc: serde_norway::Value = serde_norway::from_str(text).map_err(parse)?;
        let renamed = keys::rename_deprecated_keys(&mut doc)
            .map_err(|m| ConfigError::Invalid(format!("{}: {m}", origin.display())))?;
        if renamed.is_empty() {
            // Read from the text, so errors keep their line and column.
            return serde_norway::from_str(text).map_err(parse);
        }
        for (old, new) in renamed {
            tracing::warn!(
                config = %origin.display(),
                "`{old}` is deprecated: kvmesh YAML keys are snake_case, write `{new}` (the old \
                 spelling is read for one more release)"
            );
        }
        serde_norway::from_value(doc).map_err(parse)
    }

    /// `configs/router.yaml`, the default placement.
    fn default_placement() -> Result<RouterConfig, ConfigError> {
        RouterConfig::from_yaml(DEFAULT_CONFIG_YAML, Path::new("configs/router.yaml"))
    }

    /// A config without `scheduling_profiles` places as `configs/router.yaml` does: that file's
    /// plugins, profiles and admission queue (unless this config has its own `admission_queue:`). Its
    /// cost model and scrape interval are the defaults of every config (a test keeps the file
    /// and the defaults equal). Other configs are returned as they are.
    pub fn with_default_placement(mut self) -> Result<RouterConfig, ConfigError> {
        if !self.scheduling_profiles.is_empty() {
            return Ok(self);
        }
        let default = RouterConfig::default_placement()?;
        self.plugins = default.plugins;
        self.scheduling_profiles = default.scheduling_profiles;
        self.default_profile = self.default_profile.or(default.default_profile);
        self.admission_queue = self.admission_queue.or(default.admission_queue);
        Ok(self)
    }

    /// Puts the config's model-time values on the clock of a fleet sped up by `time_scale` (its
    /// engines compute, pull and answer that many times faster; config files hold model time):
    /// rates × `time_scale`, the per-pull floor and delays ÷ `time_scale`. That is the cost
    /// model's rates and floor (the admission queue weighs predicted work in the cost model's
    /// clock against time actually waited, so both must be wall time), prefetch's `delay_ms` and
    /// `lead_ms`, and replication's `window_s` and `cooldown_s`. Bounds on a client's wait
    /// (`admission_queue.max_hold`, timeouts) and prediction knobs in milliseconds (margins,
    /// penalties) stay as written, as every published benchmark ran them. `kvmesh bench` and
    /// `kvmesh up` call this with the fleet's `--time-scale`; a non-positive or non-finite scale
    /// counts as 1.
    pub fn scale_time(&mut self, time_scale: f64) {
        let ts = if time_scale.is_finite() && time_scale > 0.0 {
            time_scale
        } else {
            1.0
        };
        let cm = &mut self.cost_model;
        cm.prefill_tokens_per_second *= ts;
        cm.pull_tokens_per_second *= ts;
        cm.pull_floor_ms /= ts;
        if let Some(p) = &mut self.prefetch {
            p.scale_time(ts);
        }
        if let Some(r) = &mut self.replication {
            r.scale_time(ts);
        }
    }

    /// Sets the P2P pull threshold (tokens) wherever the config's plugins own one (see
    /// [`PluginSpec::set_pull_threshold`]); returns how many plugins took it.
    pub fn set_pull_threshold(&mut self, tokens: u64) -> usize {
        self.plugins
            .iter_mut()
            .filter_map(|p| p.set_pull_threshold(tokens).then_some(()))
            .count()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Invalid("block_size must be > 0".into()));
        }
        self.validate_intervals()?;
        validate_cost_model(&self.cost_model)?;
        validate_endpoints(&self.endpoints)?;
        if let Some(d) = &self.discovery {
            d.validate(!self.endpoints.is_empty() || self.endpoints_file.is_some())?;
        }
        if self.max_prompt_tokens == 0 {
            return Err(ConfigError::Invalid("max_prompt_tokens must be > 0".into()));
        }
        if self.decisions_capacity == 0 {
            return Err(ConfigError::Invalid(
                "decisions_capacity must be > 0".into(),
            ));
        }
        if let Some(d) = &self.admission_queue {
            d.validate().map_err(ConfigError::Invalid)?;
        }
        self.p2p_reputation
            .validate()
            .map_err(ConfigError::Invalid)?;
        if self.max_in_flight == 0 {
            return Err(ConfigError::Invalid("max_in_flight must be > 0".into()));
        }
        if let Some(p) = &self.prefetch {
            p.validate()?;
        }
        if let Some(r) = &self.replication {
            r.validate()?;
        }
        validate_lora_adapters(&self.lora_adapters)?;
        Ok(())
    }

    /// The key space of a request for `model` with `cache_salt`: the adapter when `model` names
    /// a configured one (otherwise the base model's), and the salt.
    pub fn tenant_keys(&self, model: Option<&str>, cache_salt: Option<&str>) -> TenantKeys {
        TenantKeys {
            lora: model.and_then(|m| self.lora_adapters.iter().find(|a| a.name == m).cloned()),
            cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned),
        }
    }
}

/// Adapter names non-empty and unique (a request's `model` picks one by name), paths non-empty.
fn validate_lora_adapters(adapters: &[kvmesh_core::LoraAdapter]) -> Result<(), ConfigError> {
    let mut names = std::collections::HashSet::new();
    for a in adapters {
        if a.name.is_empty() || !names.insert(a.name.as_str()) {
            return Err(ConfigError::Invalid(format!(
                "lora_adapters: name {:?} empty or duplicated",
                a.name
            )));
        }
        if a.path.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "lora_adapters: adapter {:?} has an empty path (give it as vLLM's --lora-modules \
                 name=path)",
                a.name
            )));
        }
    }
    Ok(())
}

impl RouterConfig {
    /// Every period and deadline is > 0: a zero scrape or health-check interval makes its loop
    /// spin, a zero timeout fails every request. Thresholds count checks, at least one.
    fn validate_intervals(&self) -> Result<(), ConfigError> {
        let hc = &self.health_check;
        let periods = [
            ("metrics_scrape_interval", self.metrics_scrape_interval),
            ("health_check.interval", hc.interval),
            ("health_check.timeout", hc.timeout),
            ("request_timeout", self.request_timeout),
            ("stream_idle_timeout", self.stream_idle_timeout),
            ("header_read_timeout", self.header_read_timeout),
        ];
        if let Some((key, _)) = periods.iter().find(|(_, d)| d.is_zero()) {
            return Err(ConfigError::Invalid(format!("{key} must be > 0, got 0s")));
        }
        if hc.unhealthy_threshold == 0 || hc.healthy_threshold == 0 {
            return Err(ConfigError::Invalid(
                "health_check.unhealthy_threshold and health_check.healthy_threshold must be >= 1"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Rates are finite and > 0 (a zero or negative `prefill_tokens_per_second` predicted 3e15 ms
/// and so placed nothing sensibly), the per-pull floor finite and >= 0, the EWMA weight in (0, 1].
fn validate_cost_model(cm: &CostModelParams) -> Result<(), ConfigError> {
    for (key, rate) in [
        ("prefill_tokens_per_second", cm.prefill_tokens_per_second),
        ("pull_tokens_per_second", cm.pull_tokens_per_second),
    ] {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "cost_model.{key} must be a finite number > 0, got {rate}"
            )));
        }
    }
    if !(cm.pull_floor_ms.is_finite() && cm.pull_floor_ms >= 0.0) {
        return Err(ConfigError::Invalid(format!(
            "cost_model.pull_floor_ms must be a finite number >= 0, got {}",
            cm.pull_floor_ms
        )));
    }
    if !(cm.ewma_alpha > 0.0 && cm.ewma_alpha <= 1.0) {
        return Err(ConfigError::Invalid(format!(
            "cost_model.ewma_alpha must be in (0, 1], got {}",
            cm.ewma_alpha
        )));
    }
    Ok(())
}

/// Names unique, URLs http(s), P2P addresses `host:port`, KV-event endpoints `tcp://` or `ipc://`.
pub fn validate_endpoints(endpoints: &[EndpointSpec]) -> Result<(), ConfigError> {
    let mut names = std::collections::HashSet::new();
    for e in endpoints {
        if e.name.is_empty() || !names.insert(e.name.as_str()) {
            return Err(ConfigError::Invalid(format!(
                "endpoint name {:?} empty or duplicated",
                e.name
            )));
        }
        let url = reqwest::Url::parse(&e.url)
            .map_err(|err| ConfigError::Invalid(format!("endpoint {}: url: {err}", e.name)))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ConfigError::Invalid(format!(
                "endpoint {}: url must be http(s)",
                e.name
            )));
        }
        if let Some(k) = &e.kv_events {
            // A `udp://` endpoint used to be accepted and then silently never subscribed.
            let endpoints = [
                ("endpoint", Some(&k.endpoint)),
                ("replay_endpoint", k.replay_endpoint.as_ref()),
            ];
            for (key, ep) in endpoints {
                if let Some(ep) = ep {
                    kvmesh_events::resolve_endpoint(ep).map_err(|err| {
                        ConfigError::Invalid(format!("endpoint {}: kv_events.{key}: {err}", e.name))
                    })?;
                }
            }
        }
        if let Some(list) = e.kv_events.as_ref().and_then(|k| k.allowed_peers.as_ref()) {
            kvmesh_events::AllowedPeers::parse(list).map_err(|err| {
                ConfigError::Invalid(format!(
                    "endpoint {}: kv_events.allowed_peers: {err}",
                    e.name
                ))
            })?;
        }
        if e.p2p.is_some() && e.p2p_host_port().is_none() {
            return Err(ConfigError::Invalid(format!(
                "endpoint {}: p2p must be host:port",
                e.name
            )));
        }
    }
    Ok(())
}

/// The endpoints file: `endpoints: [...]` or a bare list.
pub fn load_endpoints_file(path: &Path) -> Result<Vec<EndpointSpec>, ConfigError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum File {
        List(Vec<EndpointSpec>),
        Wrapped { endpoints: Vec<EndpointSpec> },
    }
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let file: File = serde_norway::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })?;
    let list = match file {
        File::List(l) => l,
        File::Wrapped { endpoints } => endpoints,
    };
    validate_endpoints(&list)?;
    Ok(list)
}

/// The `discovery:` section: where the endpoint list comes from. The types live here rather than
/// in `discovery/` because they name [`Role`] and the config names them (no import circle).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DiscoveryConfig {
    /// `endpoints` / `endpoints_file`, hot-reloaded (the behaviour without a `discovery:` key).
    Static,
    Dns(DnsDiscovery),
    Kubernetes(KubernetesDiscovery),
}

impl DiscoveryConfig {
    /// `has_static_list`: the config also names `endpoints` or `endpoints_file`.
    pub fn validate(&self, has_static_list: bool) -> Result<(), ConfigError> {
        let kind = match self {
            DiscoveryConfig::Static => return Ok(()),
            DiscoveryConfig::Dns(d) => {
                if d.name.trim().is_empty() {
                    return Err(ConfigError::Invalid(
                        "discovery.name must not be empty".into(),
                    ));
                }
                if d.interval.is_zero() {
                    return Err(ConfigError::Invalid(
                        "discovery.interval must be > 0".into(),
                    ));
                }
                "dns"
            }
            DiscoveryConfig::Kubernetes(k) => {
                if k.label_selector.trim().is_empty() {
                    // An empty selector would route to every pod of the namespace.
                    return Err(ConfigError::Invalid(
                        "discovery.label_selector must not be empty".into(),
                    ));
                }
                "kubernetes"
            }
        };
        if has_static_list {
            return Err(ConfigError::Invalid(format!(
                "discovery: kind {kind} finds the endpoints itself; remove `endpoints` and \
                 `endpoints_file` (or use `discovery: {{kind: static}}`)"
            )));
        }
        Ok(())
    }
}

fn default_discovery_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_http_port() -> u16 {
    8000
}

/// `kind: dns`: a (headless Service) name resolved every `interval`; one endpoint per A/AAAA
/// address, named `dns:<ip>:<http_port>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsDiscovery {
    pub name: String,
    #[serde(default = "default_discovery_interval", with = "duration_str")]
    pub interval: Duration,
    #[serde(default = "default_http_port")]
    pub http_port: u16,
    #[serde(default)]
    pub p2p_port: Option<u16>,
    #[serde(default)]
    pub kv_events_port: Option<u16>,
    /// The engines' KV-event replay port (catch-up on join; see `KvEventsSpec::replay_endpoint`).
    #[serde(default)]
    pub kv_replay_port: Option<u16>,
    #[serde(default)]
    pub role: Role,
    /// KV group of every address behind the name (see [`EndpointSpec::kv_group`]).
    #[serde(default)]
    pub kv_group: Option<String>,
    /// Ask this name server (`ip:port`) instead of the system's (`/etc/resolv.conf`).
    #[serde(default)]
    pub nameserver: Option<std::net::SocketAddr>,
}

/// Container port names looked up in a pod's spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PortNames {
    pub http: String,
    pub p2p: String,
    pub kv_events: String,
    /// The KV-event replay port (a pod without it is indexed from the live stream only).
    pub kv_replay: String,
}

impl Default for PortNames {
    fn default() -> Self {
        PortNames {
            http: "http".to_owned(),
            p2p: "p2p".to_owned(),
            kv_events: "kv-events".to_owned(),
            kv_replay: "kv-replay".to_owned(),
        }
    }
}

/// `kind: kubernetes`: pods watched through the Kubernetes API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesDiscovery {
    /// Default: the router pod's own namespace (from its service-account mount).
    #[serde(default)]
    pub namespace: Option<String>,
    pub label_selector: String,
    #[serde(default)]
    pub ports: PortNames,
    /// Role of pods without a `kvmesh.dev/role` annotation or label.
    #[serde(default)]
    pub role: Role,
    /// KV group of pods without a `kvmesh.dev/kv-group` annotation or label (see
    /// [`EndpointSpec::kv_group`]).
    #[serde(default)]
    pub kv_group: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_full_config() {
        let cfg: RouterConfig = serde_norway::from_str(
            r#"
block_size: 32
endpoints:
  - name: e0
    url: http://127.0.0.1:8100
    kv_events: {endpoint: "tcp://127.0.0.1:5557", topic: kv-events}
    p2p: "127.0.0.1:7777"
    role: both
metrics_scrape_interval: 250ms
health_check: {interval: 1s, unhealthy_threshold: 2}
plugins:
  - {type: queue-scorer, name: q}
scheduling_profiles:
  - name: a
    plugins: [{plugin_ref: q, weight: 2}]
"#,
        )
        .expect("parse");
        assert_eq!(cfg.block_size, 32);
        assert_eq!(cfg.metrics_scrape_interval, Duration::from_millis(250));
        assert_eq!(cfg.health_check.unhealthy_threshold, 2);
        assert_eq!(cfg.health_check.timeout, Duration::from_secs(1));
        assert_eq!(
            cfg.endpoints[0].p2p_host_port(),
            Some(("127.0.0.1".to_owned(), 7777))
        );
        assert_eq!(cfg.scheduling_profiles[0].plugins[0].weight, Some(2.0));
        cfg.validate().expect("valid");
    }

    #[test]
    fn rejects_duplicates_and_bad_addresses() {
        let e = |name: &str, url: &str, p2p: Option<&str>| EndpointSpec {
            name: name.into(),
            url: url.into(),
            kv_events: None,
            p2p: p2p.map(Into::into),
            role: Role::Both,
            kv_group: None,
        };
        assert!(
            validate_endpoints(&[e("a", "http://x:1", None), e("a", "http://y:1", None)]).is_err()
        );
        assert!(validate_endpoints(&[e("a", "ftp://x", None)]).is_err());
        assert!(validate_endpoints(&[e("a", "http://x:1", Some("nohost"))]).is_err());
        assert!(validate_endpoints(&[e("a", "http://x:1", Some("[::1]:7"))]).is_ok());
    }

    /// The error a config (YAML) is refused with by `validate`.
    fn refusal(yaml: &str) -> String {
        let cfg: RouterConfig = serde_norway::from_str(yaml).expect("parses");
        cfg.validate().expect_err(yaml).to_string()
    }

    #[test]
    fn zero_intervals_and_nonpositive_rates_are_refused_naming_the_key() {
        let cases = [
            (
                "health_check: {interval: 0s}",
                "health_check.interval must be > 0",
            ),
            (
                "health_check: {timeout: 0ms}",
                "health_check.timeout must be > 0",
            ),
            (
                "health_check: {unhealthy_threshold: 0}",
                "health_check.unhealthy_threshold",
            ),
            (
                "metrics_scrape_interval: 0s",
                "metrics_scrape_interval must be > 0",
            ),
            ("request_timeout: 0s", "request_timeout must be > 0"),
            ("stream_idle_timeout: 0s", "stream_idle_timeout must be > 0"),
            (
                "cost_model: {prefill_tokens_per_second: 0}",
                "cost_model.prefill_tokens_per_second",
            ),
            (
                "cost_model: {prefill_tokens_per_second: -25000}",
                "got -25000",
            ),
            (
                "cost_model: {pull_tokens_per_second: .nan}",
                "cost_model.pull_tokens_per_second",
            ),
            (
                "cost_model: {pull_floor_ms: -1}",
                "cost_model.pull_floor_ms",
            ),
            ("cost_model: {ewma_alpha: 0}", "cost_model.ewma_alpha"),
        ];
        for (yaml, named) in cases {
            let err = refusal(yaml);
            assert!(err.contains(named), "{yaml}: {err}");
        }
        let ok: RouterConfig = serde_norway::from_str("health_check: {interval: 1ms}").unwrap();
        assert!(ok.validate().is_ok());
    }

    #[test]
    fn a_kv_events_endpoint_that_is_not_tcp_or_ipc_is_refused_naming_the_endpoint() {
        let err = refusal(
            "endpoints: [{name: e0, url: \"http://127.0.0.1:8100\", kv_events: {endpoint: \"udp://127.0.0.1:5557\"}}]",
        );
        assert!(
            err.contains("endpoint e0: kv_events.endpoint") && err.contains("udp://"),
            "{err}"
        );
        let err = refusal(
            "endpoints: [{name: e0, url: \"http://h:1\", kv_events: {endpoint: \"tcp://h:2\", replay_endpoint: \"h:3\"}}]",
        );
        assert!(err.contains("kv_events.replay_endpoint"), "{err}");
        let ok: RouterConfig = serde_norway::from_str(
            "endpoints: [{name: e0, url: \"http://h:1\", kv_events: {endpoint: \"ipc:///tmp/kv\"}}]",
        )
        .unwrap();
        assert!(ok.validate().is_ok());
    }

    #[test]
    fn kv_group_key_parses_and_defaults_to_the_implicit_group() {
        let cfg: RouterConfig = serde_norway::from_str(
            "endpoints:\n  - {name: a, url: \"http://x:1\", kv_group: vllm-llama}\n  - {name: b, url: \"http://x:2\"}\n  - {name: c, url: \"http://x:3\", kv_group: \"\"}\n",
        )
        .expect("parse");
        cfg.validate().expect("valid");
        let groups: Vec<Option<&str>> = cfg.endpoints.iter().map(|e| e.kv_group()).collect();
        assert_eq!(groups, vec![Some("vllm-llama"), None, None]);
        // The key survives a round trip and is left out when unset.
        let out = serde_norway::to_string(&cfg.endpoints).expect("serialize");
        assert!(out.contains("kv_group: vllm-llama"), "{out}");
        assert_eq!(out.matches("kv_group").count(), 2, "{out}");
        let c: RouterConfig =
            serde_norway::from_str("discovery: {kind: dns, name: e.svc, kv_group: g1}")
                .expect("dns");
        let Some(DiscoveryConfig::Dns(d)) = &c.discovery else {
            panic!("{:?}", c.discovery)
        };
        assert_eq!(d.kv_group.as_deref(), Some("g1"));
    }

    #[test]
    fn tokenizer_spellings() {
        let c: RouterConfig = serde_norway::from_str("tokenizer: byte").expect("byte");
        assert_eq!(c.tokenizer, TokenizerSpec::Byte);
        let c: RouterConfig =
            serde_norway::from_str("tokenizer: {path: /t/tokenizer.json}").expect("hf");
        assert_eq!(
            c.tokenizer,
            TokenizerSpec::Hf {
                path: "/t/tokenizer.json".into(),
                chat_template: None
            }
        );
        let err = serde_norway::from_str::<RouterConfig>("tokenizer: gpt2")
            .expect_err("a bare name is not a path")
            .to_string();
        assert!(err.contains("model directory"), "{err}");
        for dir in ["/models/llama", "./llama", "models/tokenizer.json"] {
            let c: RouterConfig =
                serde_norway::from_str(&format!("tokenizer: {dir}")).expect("a path");
            assert_eq!(
                c.tokenizer,
                TokenizerSpec::Hf {
                    path: dir.into(),
                    chat_template: None
                }
            );
        }
        let c: RouterConfig = serde_norway::from_str(
            "tokenizer: {path: /models/llama, chat_template: /t/llama.jinja}",
        )
        .expect("a directory and a template");
        assert_eq!(
            c.tokenizer,
            TokenizerSpec::Hf {
                path: "/models/llama".into(),
                chat_template: Some("/t/llama.jinja".into())
            }
        );
    }

    #[test]
    fn a_config_without_profiles_places_as_configs_router_yaml() {
        let bare: RouterConfig =
            serde_norway::from_str("endpoints: [{name: a, url: \"http://x:1\"}]").expect("parse");
        let file = RouterConfig::default_placement().expect("the embedded file parses");
        let filled = bare.clone().with_default_placement().expect("filled");
        assert_eq!(filled.scheduling_profiles, file.scheduling_profiles);
        assert_eq!(filled.plugins, file.plugins);
        assert!(
            filled.admission_queue.is_some(),
            "the admission queue is part of it"
        );
        assert_eq!(filled.admission_queue, file.admission_queue);
        assert_eq!(
            filled.endpoints, bare.endpoints,
            "the config's own settings stay"
        );
        // Defaults every config shares, so the file cannot drift from them.
        assert_eq!(file.cost_model, CostModelParams::default());
        assert_eq!(file.metrics_scrape_interval, bare.metrics_scrape_interval);
        // Its own admission queue wins; a config with profiles is left alone.
        let own: RouterConfig =
            serde_norway::from_str("admission_queue: {max_queued_prefill_tokens: 5}")
                .expect("parse");
        let own = own.with_default_placement().expect("filled");
        assert_eq!(
            own.admission_queue.map(|d| d.max_queued_prefill_tokens),
            Some(5)
        );
        let affinity: RouterConfig = serde_norway::from_str(
            "plugins: [{type: prefix-cache-scorer, name: p}]\nscheduling_profiles: [{name: a, plugins: [{plugin_ref: p}]}]",
        )
        .expect("parse");
        assert_eq!(
            affinity.clone().with_default_placement().expect("same"),
            affinity
        );
    }

    #[test]
    fn a_sped_up_fleet_scales_rates_up_and_delays_down() {
        let mut c: RouterConfig = serde_norway::from_str(
            "prefetch: {delay_ms: 500, lead_ms: 1000}\nreplication: {window_s: 10, cooldown_s: 30}\nadmission_queue: {max_hold: 10s}",
        )
        .expect("parse");
        let before = c.clone();
        c.scale_time(4.0);
        assert_eq!(c.cost_model.prefill_tokens_per_second, 100_000.0);
        assert_eq!(c.cost_model.pull_tokens_per_second, 940_000.0);
        assert_eq!(c.cost_model.pull_floor_ms, 6.5);
        let p = c.prefetch.as_ref().expect("prefetch");
        assert_eq!((p.delay_ms, p.lead_ms), (125.0, 250.0));
        let r = c.replication.as_ref().expect("replication");
        assert_eq!((r.window_s, r.cooldown_s), (2.5, 7.5));
        assert_eq!(
            c.admission_queue, before.admission_queue,
            "a client's wait bound is not scaled"
        );
        let mut same = before.clone();
        same.scale_time(f64::NAN);
        same.scale_time(1.0);
        assert_eq!(same, before);
    }

    #[test]
    fn a_config_in_the_old_spelling_loads_as_the_new_one() {
        let new = "admission_queue: {max_queued_prefill_tokens: 4096}
plugins:
  - {type: queue-scorer, name: q, parameters: {queue_source: waiting}}
  - {type: p2p-source-producer, name: p2p, parameters: {min_cached_token_delta: 64, mode: cost_model, margin_ms: 5}}
scheduling_profiles:
  - {name: a, plugins: [{plugin_ref: q, weight: 2}, {plugin_ref: p2p}]}
";
        let old = new
            .replace("admission_queue", "dispatch")
            .replace("queue_source", "queueSource")
            .replace("min_cached_token_delta", "minCachedTokenDelta")
            .replace("margin_ms", "marginMs")
            .replace("scheduling_profiles", "schedulingProfiles")
            .replace("plugin_ref", "pluginRef");
        let read = |text: &str| RouterConfig::from_yaml(text, Path::new("t.yaml")).expect("reads");
        assert_eq!(read(&old), read(new));
        assert_eq!(
            read(new)
                .admission_queue
                .map(|q| q.max_queued_prefill_tokens),
            Some(4096)
        );
        // The typed config knows only the new spelling.
        assert!(serde_norway::from_str::<RouterConfig>(&old).is_err());
        // A syntax error keeps its position.
        let err = RouterConfig::from_yaml("plugins: [\n", Path::new("t.yaml")).expect_err("bad");
        assert!(err.to_string().contains("line"), "{err}");
    }

    #[test]
    fn unknown_keys_are_errors() {
        assert!(serde_norway::from_str::<RouterConfig>("blocksize: 3").is_err());
    }

    #[test]
    fn shipped_example_configs_parse() {
        for f in [
            "router.yaml",
            "router-affinity.yaml",
            "router-load-p2p.yaml",
        ] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../configs")
                .join(f);
            let cfg = RouterConfig::load(&path).unwrap_or_else(|e| panic!("{f}: {e}"));
            let cm = std::sync::Arc::new(kvmesh_sched::cost_model::CostModel::new(
                cfg.cost_model.clone(),
            ));
            kvmesh_sched::Scheduler::build(
                &cfg.plugins,
                &cfg.scheduling_profiles,
                cfg.default_profile.as_deref(),
                None,
                &cm,
            )
            .unwrap_or_else(|e| panic!("{f}: {e}"));
        }
    }

    #[test]
    fn discovery_sections_parse_with_defaults() {
        let c: RouterConfig = serde_norway::from_str(
            "discovery: {kind: dns, name: e.ns.svc.cluster.local, p2p_port: 7100, kv_events_port: 5557}",
        )
        .expect("dns");
        let Some(DiscoveryConfig::Dns(d)) = &c.discovery else {
            panic!("{:?}", c.discovery)
        };
        assert_eq!(
            (d.interval, d.http_port, d.p2p_port, d.role),
            (Duration::from_secs(5), 8000, Some(7100), Role::Both)
        );
        c.validate().expect("valid");
        let c: RouterConfig = serde_norway::from_str(
            "discovery:\n  kind: kubernetes\n  label_selector: app=e\n  ports: {http: web}\n  role: decode\n",
        )
        .expect("kubernetes");
        let Some(DiscoveryConfig::Kubernetes(k)) = &c.discovery else {
            panic!("{:?}", c.discovery)
        };
        assert_eq!(k.namespace, None);
        assert_eq!(
            (k.ports.http.as_str(), k.ports.p2p.as_str()),
            ("web", "p2p")
        );
        assert_eq!(k.role, Role::Decode);
        let c: RouterConfig = serde_norway::from_str("discovery: {kind: static}").expect("static");
        assert_eq!(c.discovery, Some(DiscoveryConfig::Static));
        assert!(
            serde_norway::from_str::<RouterConfig>("discovery: {kind: dns, name: x, port: 1}")
                .is_err()
        );
    }

    #[test]
    fn discovery_with_a_static_list_is_refused() {
        let c: RouterConfig = serde_norway::from_str(
            "endpoints: [{name: a, url: \"http://127.0.0.1:1\"}]\ndiscovery: {kind: dns, name: x}",
        )
        .expect("parses");
        let err = c.validate().expect_err("mixed").to_string();
        assert!(err.contains("remove `endpoints`"), "{err}");
        let c: RouterConfig = serde_norway::from_str(
            "endpoints_file: f.yaml\ndiscovery: {kind: kubernetes, label_selector: a=b}",
        )
        .expect("parses");
        assert!(c.validate().is_err());
        let c: RouterConfig = serde_norway::from_str(
            "endpoints: [{name: a, url: \"http://127.0.0.1:1\"}]\ndiscovery: {kind: static}",
        )
        .expect("parses");
        c.validate().expect("static keeps the list");
    }
}
