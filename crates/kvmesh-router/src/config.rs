//! Router configuration (YAML), in the spirit of llm-d's `EndpointPickerConfig`.
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
//! schedulingProfiles:
//!   - {name: affinity, plugins: [{pluginRef: prefix, weight: 3}]}
//! ```
//! Durations are strings like `500ms`, `2s`, `1m`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvmesh_sched::Scheduler;
use kvmesh_sched::config::duration_str;
pub use kvmesh_sched::config::{PluginRef, PluginSpec, ProfileSpec};
use kvmesh_sched::cost_model::CostModelParams;
use kvmesh_sched::hold_queue::DispatchConfig;
use serde::{Deserialize, Serialize};

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_norway::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

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
    Duration::from_millis(500)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(600)
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
    #[serde(default, rename = "schedulingProfiles", alias = "scheduling_profiles")]
    pub scheduling_profiles: Vec<ProfileSpec>,
    /// Profile used unless a request names one with `x-kvmesh-profile`; default the first.
    #[serde(default)]
    pub default_profile: Option<String>,
    #[serde(default = "default_scrape", with = "duration_str")]
    pub metrics_scrape_interval: Duration,
    #[serde(default)]
    pub health_check: HealthCheckConfig,
    /// Maximum wait for an engine's response headers (not the whole stream).
    #[serde(default = "default_request_timeout", with = "duration_str")]
    pub request_timeout: Duration,
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
    /// Admission queue: hold requests while every endpoint has its share of prefill queued and
    /// release them shortest work first (`kvmesh_sched::hold_queue`). Absent = place on arrival.
    #[serde(default)]
    pub dispatch: Option<DispatchConfig>,
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

impl RouterConfig {
    /// Loads and validates a config file; a relative `endpoints_file` is resolved against the
    /// config's directory.
    pub fn load(path: &Path) -> Result<RouterConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut cfg: RouterConfig =
            serde_norway::from_str(&text).map_err(|source| ConfigError::Parse {
                path: path.to_owned(),
                source,
            })?;
        if let Some(f) = &cfg.endpoints_file
            && f.is_relative()
            && let Some(dir) = path.parent()
        {
            cfg.endpoints_file = Some(dir.join(f));
        }
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Invalid("block_size must be > 0".into()));
        }
        validate_endpoints(&self.endpoints)?;
        if let Some(d) = &self.discovery {
            d.validate(!self.endpoints.is_empty() || self.endpoints_file.is_some())?;
        }
        if self.decisions_capacity == 0 {
            return Err(ConfigError::Invalid(
                "decisions_capacity must be > 0".into(),
            ));
        }
        if let Some(d) = &self.dispatch {
            d.validate().map_err(ConfigError::Invalid)?;
        }
        if self.max_in_flight == 0 {
            return Err(ConfigError::Invalid("max_in_flight must be > 0".into()));
        }
        if let Some(p) = &self.prefetch {
            p.validate()?;
        }
        if let Some(r) = &self.replication {
            r.validate()?;
        }
        Ok(())
    }
}

/// Where a request's session id is read from (`prefetch.session_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionIdSource {
    /// `header:<name>`: a request header (the bench and vLLM's multi-turn benchmark send
    /// `x-session-id`).
    Header(String),
    /// `body:<field>`: a top-level string (or number) field, e.g. OpenAI's `user`.
    Body(String),
    /// `metadata:<key>`: a key of the request's `metadata` object.
    Metadata(String),
}

impl std::str::FromStr for SessionIdSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, name) = s.split_once(':').ok_or_else(|| {
            format!("session_id {s:?}: expected header:<name>, body:<field> or metadata:<key>")
        })?;
        let name = name.trim();
        if name.is_empty() {
            return Err(format!("session_id {s:?}: empty name"));
        }
        match kind.trim() {
            "header" => Ok(Self::Header(name.to_ascii_lowercase())),
            "body" => Ok(Self::Body(name.to_owned())),
            "metadata" => Ok(Self::Metadata(name.to_owned())),
            other => Err(format!(
                "session_id {s:?}: unknown source {other:?} (header, body, metadata)"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for SessionIdSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for SessionIdSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text = match self {
            Self::Header(n) => format!("header:{n}"),
            Self::Body(n) => format!("body:{n}"),
            Self::Metadata(n) => format!("metadata:{n}"),
        };
        s.serialize_str(&text)
    }
}

/// `prefetch:` — sessions and prefetch ahead of arrival.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefetchConfig {
    /// Where the session id comes from (default `header:x-session-id`).
    #[serde(default = "default_session_id")]
    pub session_id: SessionIdSource,
    /// KV bytes one token takes on these engines (prices the budget and the reports; default
    /// 73,728: gpt-oss-120b, bf16).
    #[serde(default = "default_kv_bytes_per_token")]
    pub kv_bytes_per_token: u64,
    /// Most modelled bytes of prefetches in flight towards one endpoint (default 8 GiB); a
    /// prefetch that does not fit is skipped, never queued.
    #[serde(default = "default_prefetch_budget")]
    pub max_inflight_bytes_per_endpoint: u64,
    /// Most modelled bytes of prefetches towards one endpoint whose turn has not come yet
    /// (running or landed, default 16 GiB): landed copies take CPU-tier room from other blocks,
    /// so speculation is bounded by what the tier can spare, not only by what is in flight.
    #[serde(default = "default_prefetch_unused")]
    pub max_unused_bytes_per_endpoint: u64,
    /// Histories shorter than this are not prefetched (a pull's setup would cost more than it
    /// saves).
    #[serde(default = "default_prefetch_min_tokens")]
    pub min_tokens: usize,
    /// A session idle this long is forgotten (its unused prefetch counted as expired).
    #[serde(default = "default_session_ttl")]
    pub session_ttl_s: f64,
    /// Most sessions followed at once (the least recently active is dropped beyond it).
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
    /// Scheduling profile that picks the prefetch target (default: the default profile).
    #[serde(default)]
    pub profile: Option<String>,
    /// How long after a turn ends the router decides (ms): a next turn that arrives sooner had
    /// no gap to hide a transfer in, and the owner's load has settled after its answer.
    #[serde(default = "default_prefetch_delay_ms")]
    pub delay_ms: f64,
    /// Longest a prefetch may run before the router stops waiting for its report.
    #[serde(default = "default_prefetch_timeout")]
    pub timeout_s: f64,
    /// When the next turn is predicted back on its owner: restore the history from the owner's
    /// CPU tier into its GPU tier once the index shows it left the GPU tier (default on). With
    /// `gap_timing` only sessions with a regular pace are restored ahead; on those it lowered
    /// returning turns' TTFT at p50, p90 and p99 where the restore is on the critical path, and
    /// at p50 with the tail unchanged on a saturated fleet, in repeated paired runs
    /// (docs/benchmarks.md, "Repeated and paired"). It costs GPU evictions (about a fifth more).
    #[serde(default = "default_true")]
    pub restore: bool,
    /// How often (ms) the router re-reads the index during a gap whose next turn goes back to
    /// the owner, to catch the history leaving the owner's GPU tier (default: `delay_ms`).
    #[serde(default)]
    pub restore_recheck_ms: Option<f64>,
    /// Time decisions by the session's own gaps (default on): once a session has left two gaps
    /// that agree within `gap_tolerance`, the router decides `lead_ms` before the earliest
    /// expected arrival instead of `delay_ms` after the turn, and a restore ahead is made only
    /// for such predictable sessions (restored early, a history is evicted again before its
    /// turn). Sessions without an estimate get pull prefetches at `delay_ms` as before.
    #[serde(default = "default_true")]
    pub gap_timing: bool,
    /// How far ahead of the earliest expected arrival the router decides (ms, default 1000):
    /// room for the transfer and for the arrival coming early.
    #[serde(default = "default_prefetch_lead_ms")]
    pub lead_ms: f64,
    /// Most relative distance of a session's recent gaps from their mean for the session to
    /// count as predictable (default 0.25).
    #[serde(default = "default_gap_tolerance")]
    pub gap_tolerance: f64,
}

fn default_session_id() -> SessionIdSource {
    SessionIdSource::Header("x-session-id".to_owned())
}
fn default_kv_bytes_per_token() -> u64 {
    73_728
}
fn default_prefetch_budget() -> u64 {
    8 << 30
}
fn default_prefetch_unused() -> u64 {
    16 << 30
}
fn default_prefetch_min_tokens() -> usize {
    1024
}
fn default_session_ttl() -> f64 {
    120.0
}
fn default_max_sessions() -> usize {
    65_536
}
fn default_prefetch_delay_ms() -> f64 {
    500.0
}
fn default_prefetch_timeout() -> f64 {
    30.0
}
fn default_true() -> bool {
    true
}
fn default_prefetch_lead_ms() -> f64 {
    1000.0
}
fn default_gap_tolerance() -> f64 {
    0.25
}

impl PrefetchConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(format!("prefetch: {m}")));
        if self.kv_bytes_per_token == 0 {
            return bad("kv_bytes_per_token must be > 0");
        }
        if self.max_sessions == 0 {
            return bad("max_sessions must be > 0");
        }
        if !(self.session_ttl_s.is_finite() && self.session_ttl_s > 0.0) {
            return bad("session_ttl_s must be a positive number of seconds");
        }
        if !(self.delay_ms.is_finite() && self.delay_ms >= 0.0) {
            return bad("delay_ms must be a number of milliseconds >= 0");
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return bad("timeout_s must be a positive number of seconds");
        }
        if self
            .restore_recheck_ms
            .is_some_and(|ms| !(ms.is_finite() && ms > 0.0))
        {
            return bad("restore_recheck_ms must be a positive number of milliseconds");
        }
        if !(self.lead_ms.is_finite() && self.lead_ms >= 0.0) {
            return bad("lead_ms must be a number of milliseconds >= 0");
        }
        if !(self.gap_tolerance.is_finite() && (0.0..1.0).contains(&self.gap_tolerance)) {
            return bad("gap_tolerance must be in [0, 1)");
        }
        Ok(())
    }

    /// The index re-read interval of restore-ahead: `restore_recheck_ms`, else `delay_ms`; at
    /// least 1 ms so a zero delay cannot spin.
    pub fn restore_recheck(&self) -> std::time::Duration {
        let ms = self.restore_recheck_ms.unwrap_or(self.delay_ms).max(1.0);
        std::time::Duration::from_secs_f64(ms / 1000.0)
    }
}

/// `replication:` — hot-prefix replication ahead of demand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicationConfig {
    /// Prefixes shorter than this are never copied (default 2048).
    #[serde(default = "default_replication_min_tokens")]
    pub min_tokens: usize,
    /// Requests for one prefix within `window_s` that make it hot (default 4).
    #[serde(default = "default_hot_requests")]
    pub hot_requests: usize,
    #[serde(default = "default_hot_window")]
    pub window_s: f64,
    /// Copy only when every holder has at least this much prefill queued by this router (tokens
    /// not cached there; default 8192): an idle holder serves the next request sooner than a copy.
    #[serde(default = "default_busy_tokens")]
    pub busy_tokens: u64,
    /// A prefix held by this many endpoints is not copied again (default 2).
    #[serde(default = "default_max_holders")]
    pub max_holders: usize,
    /// At most one copy of a prefix per this many seconds (default 30).
    #[serde(default = "default_replication_cooldown")]
    pub cooldown_s: f64,
    /// Copies in flight towards one endpoint; beyond it a copy is skipped, never queued (default 1).
    #[serde(default = "default_one")]
    pub max_inflight_per_endpoint: usize,
    /// Prefixes remembered (default 4096; the least recently asked-for is forgotten).
    #[serde(default = "default_hot_entries")]
    pub max_prefixes: usize,
    /// Longest a copy may run before the router stops waiting for its report.
    #[serde(default = "default_prefetch_timeout")]
    pub timeout_s: f64,
}

fn default_replication_min_tokens() -> usize {
    2048
}
fn default_hot_requests() -> usize {
    4
}
fn default_hot_window() -> f64 {
    10.0
}
fn default_busy_tokens() -> u64 {
    8192
}
fn default_max_holders() -> usize {
    2
}
fn default_replication_cooldown() -> f64 {
    30.0
}
fn default_one() -> usize {
    1
}
fn default_hot_entries() -> usize {
    4096
}

impl ReplicationConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(format!("replication: {m}")));
        if self.hot_requests == 0 || self.max_inflight_per_endpoint == 0 || self.max_prefixes == 0 {
            return bad("hot_requests, max_inflight_per_endpoint and max_prefixes must be > 0");
        }
        if self.max_holders < 2 {
            return bad("max_holders must be >= 2 (1 would never copy)");
        }
        for (name, v) in [
            ("window_s", self.window_s),
            ("cooldown_s", self.cooldown_s),
            ("timeout_s", self.timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(&format!("{name} must be a positive number of seconds"));
            }
        }
        Ok(())
    }
}

/// Names unique, URLs http(s), P2P addresses `host:port`.
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
}

impl Default for PortNames {
    fn default() -> Self {
        PortNames {
            http: "http".to_owned(),
            p2p: "p2p".to_owned(),
            kv_events: "kv-events".to_owned(),
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

/// When to disaggregate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Decider {
    /// `always`.
    Named(String),
    /// Disaggregate only when at least this many prompt tokens are uncached on the prefill side;
    /// otherwise the decoder serves the whole request.
    MinUncached { min_uncached_tokens: u64 },
}

impl Default for Decider {
    fn default() -> Self {
        Decider::Named("always".to_owned())
    }
}

fn default_ttl() -> f64 {
    450.0
}

/// The `pd:` section of the router config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PdConfig {
    pub prefill_profile: String,
    pub decode_profile: String,
    #[serde(default)]
    pub decider: Decider,
    /// Cache decoders' returned params per conversation and attach them to the next prefill leg.
    #[serde(default)]
    pub bidirectional: bool,
    /// Lifetime of a cached conversation entry (keep it below the engines' 480 s TTL).
    #[serde(default = "default_ttl")]
    pub conversation_ttl_s: f64,
}

impl PdConfig {
    pub fn validate(&self, scheduler: &Scheduler) -> Result<(), ConfigError> {
        for p in [&self.prefill_profile, &self.decode_profile] {
            if scheduler.profile(Some(p)).is_none() {
                return Err(ConfigError::Invalid(format!(
                    "pd: unknown scheduling profile {p:?}"
                )));
            }
        }
        if let Decider::Named(n) = &self.decider
            && n != "always"
        {
            return Err(ConfigError::Invalid(format!(
                "pd.decider: `always` or {{min_uncached_tokens: N}}, not {n:?}"
            )));
        }
        if !(self.conversation_ttl_s.is_finite() && self.conversation_ttl_s > 0.0) {
            return Err(ConfigError::Invalid(
                "pd.conversation_ttl_s must be > 0".into(),
            ));
        }
        Ok(())
    }
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
schedulingProfiles:
  - name: a
    plugins: [{pluginRef: q, weight: 2}]
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
    fn prefetch_restores_ahead_timed_by_pace_unless_told_not_to() {
        let parse = |extra: &str| -> PrefetchConfig {
            serde_norway::from_str(&format!("session_id: header:x-session-id\n{extra}"))
                .expect("parse")
        };
        let p = parse("");
        assert!(p.restore && p.gap_timing, "restore ahead, timed by pace");
        assert!(!parse("restore: false").restore);
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
            Scheduler::build(
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
    fn example_pd_config_is_valid() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/router-pd.yaml");
        let cfg = RouterConfig::load(std::path::Path::new(path)).unwrap();
        let pd = cfg.pd.clone().unwrap();
        assert!(pd.bidirectional);
        assert_eq!(
            pd.decider,
            Decider::MinUncached {
                min_uncached_tokens: 512
            }
        );
        let cm = std::sync::Arc::new(kvmesh_sched::cost_model::CostModel::new(
            cfg.cost_model.clone(),
        ));
        let s = Scheduler::build(
            &cfg.plugins,
            &cfg.scheduling_profiles,
            cfg.default_profile.as_deref(),
            cfg.seed,
            &cm,
        )
        .unwrap();
        pd.validate(&s).unwrap();
        let mut bad = pd.clone();
        bad.decode_profile = "nope".into();
        assert!(bad.validate(&s).is_err());
        bad = pd;
        bad.decider = Decider::Named("sometimes".into());
        assert!(bad.validate(&s).is_err());
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

    #[test]
    fn decider_parses_both_forms() {
        let d: Decider = serde_norway::from_str("always").unwrap();
        assert_eq!(d, Decider::Named("always".into()));
        let d: Decider = serde_norway::from_str("{min_uncached_tokens: 256}").unwrap();
        assert_eq!(
            d,
            Decider::MinUncached {
                min_uncached_tokens: 256
            }
        );
    }
}
