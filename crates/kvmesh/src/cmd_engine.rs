//! `kvmesh engine`: a vLLM-compatible model server (flags follow `vllm serve` where they exist).
//! SIGTERM or Ctrl-C closes the listener, lets in-flight requests (streams included) finish for
//! up to `--drain-timeout`, then exits 0.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvmesh_engine::EngineConfig;
use kvmesh_engine::compute::profiles::PROFILES;
use kvmesh_engine::compute::sim_link::{DEFAULT_SIM_LINK, SimLink, fitted, validation};
use kvmesh_engine::config::{
    KvEventsConfig, P2pConfig, Role, parse_byte_size, resolve_max_model_len,
};
use kvmesh_engine::server::{HttpLimits, ServerOptions, sim_backend_with_link, start_server};
use kvmesh_text::ByteTokenizer;

#[derive(clap::Args, Debug)]
pub struct EngineCmd {
    /// Print the built-in sim profiles (name, source) and exit.
    #[arg(long)]
    list_profiles: bool,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The host every address this engine tells others uses: the P2P producer in P/D hand-off
    /// params and the KV-event endpoint it announces (e.g. this machine's IP or the pod IP).
    /// Default: --host when it is a concrete address. Required with --host 0.0.0.0 / :: when a
    /// P2P producer serves peers beyond loopback.
    #[arg(long)]
    advertise_host: Option<String>,
    /// HTTP port; 0 picks a free one (the startup line prints it).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model name in requests and responses; default `sim` for `--backend sim` and the model's
    /// name (GGUF file stem or safetensors directory name) for `--backend model`.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Compute backend: `sim` (time-modelled GPU profile) or `model` (real model on CPU).
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Model file or directory for `--backend model`.
    #[arg(long)]
    model: Option<String>,
    /// KV element type for `--backend model`: f32 or bf16.
    #[arg(long, default_value = "f32")]
    kv_dtype: String,
    /// Sim profile (see --list-profiles).
    #[arg(long, default_value = "gpt-oss-120b-h200")]
    profile: String,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 4096)]
    num_gpu_blocks: usize,
    /// CPU offload tier size, e.g. `2GiB`.
    #[arg(long, default_value = "1GiB")]
    cpu_offload_bytes: String,
    /// vLLM's KV-events JSON, e.g. '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}'.
    #[arg(long)]
    kv_events_config: Option<String>,
    /// Do not publish the engine's load on the KV-event socket (topic `kvmesh.load`); router
    /// replicas then each see only their own work. The same as `"load_reports": false` in
    /// `--kv-events-config`.
    #[arg(long)]
    no_load_reports: bool,
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Longest prompt + output. Default: the model's context length (`--backend model`) or
    /// 131072, capped at what the GPU KV pool holds; a larger explicit value is refused.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Requests allowed to wait; beyond it new requests get 429 with Retry-After.
    #[arg(long, default_value_t = 4096)]
    max_waiting: usize,
    /// Divides every modelled duration of the sim backend (100 = 100x faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// KV payload bytes per token the sim backend stores and moves on the wire (scaled down;
    /// the modelled link prices the profile's real KV bytes per token).
    #[arg(long, default_value_t = 32)]
    sim_kv_bytes_per_token: usize,
    /// The sim backend's modelled P2P link, shared by everything this engine pulls and serves:
    /// `llmd-h200` (derived from llm-d's published gpt-oss-120b pull ladder; see
    /// --list-profiles), `rdma-400g`, `tcp-100g`, `GBPS,MS` (e.g. `200,5`), or `ladder` (replay
    /// the profile's published pull ladder by token count: no bytes, no contention).
    #[arg(long, default_value = kvmesh_engine::compute::sim_link::DEFAULT_SIM_LINK)]
    sim_link: String,
    /// How the sim backend charges a restore from the CPU tier into the GPU tier: `overlap` (a
    /// copy engine beside compute, as vLLM's offloading connector loads on its own stream: only
    /// the requests needing the blocks wait, concurrent restores queue on the host link) or
    /// `step` (added to the next step: the whole batch waits).
    #[arg(long, default_value = "overlap")]
    sim_h2d: String,
    #[arg(long, default_value = "sha256_cbor")]
    prefix_caching_hash_algo: String,
    /// The `engine` label of metrics.
    #[arg(long, default_value = "0")]
    engine_label: String,
    /// TCP port of the P2P KV producer (0 picks a free one; the startup line prints it).
    #[arg(long)]
    p2p_port: Option<u16>,
    /// Comma-separated hosts, host:port, networks (10.244.0.0/16) or `*` this engine may pull
    /// from.
    #[arg(long, value_delimiter = ',')]
    p2p_allowed_peers: Vec<String>,
    /// Timeout of each P2P protocol step (connect, handshake, one block). A whole pull, waiting
    /// on another request's pull included, gets this plus the pending deadline before the engine
    /// computes the rest itself.
    #[arg(long, default_value_t = 5000)]
    p2p_timeout_ms: u64,
    /// How long a pull may wait for blocks the peer is computing right now (PENDING); default
    /// 2000 ms, divided by --time-scale on the sim backend.
    #[arg(long)]
    p2p_pending_deadline_ms: Option<u64>,
    /// A pull the router priced gets this many times its predicted time (at least
    /// --p2p-deadline-floor-ms, at most --p2p-timeout-ms plus the pending deadline), so a
    /// stalling source costs about the prediction instead of the flat timeout.
    #[arg(long, default_value_t = kvmesh_engine::config::DEFAULT_P2P_DEADLINE_FACTOR)]
    p2p_deadline_factor: f64,
    /// The least time a priced pull gets, whatever the prediction (wall time, not scaled).
    #[arg(long, default_value_t = kvmesh_engine::config::DEFAULT_P2P_DEADLINE_FLOOR_MS)]
    p2p_deadline_floor_ms: u64,
    /// How a pulled prefix reaches compute: `async` lands it whole before the request is
    /// scheduled; `layerwise` schedules the request at once and waits for each layer as the
    /// step computes it (the `model` backend; a stalled peer then stalls that step for the
    /// whole batch, up to the pull's deadline).
    #[arg(long, default_value = "async")]
    p2p_load_mode: String,
    /// Share (0..=1) of the CPU tier that pulled blocks may keep pinned until their request is
    /// scheduled; beyond it they land evictable (a pull never stalls on a full tier).
    #[arg(long, default_value_t = kvmesh_engine::cpu_tier::DEFAULT_PULL_PIN_FRACTION)]
    p2p_pull_pin_fraction: f64,
    /// File holding a shared secret P2P peers must prove (never pass it on the command line);
    /// every P2P frame after the handshake is then MACed.
    #[arg(long)]
    p2p_secret_file: Option<std::path::PathBuf>,
    /// Encrypt P2P transfers (AES-256-GCM) as producer and consumer; needs --p2p-secret-file,
    /// and every peer must set it alike (a peer that does not is refused, naming this flag).
    #[arg(long)]
    p2p_encrypt: bool,
    /// Connections one P2P pull may stripe its blocks over, for links one TCP stream cannot
    /// fill (at most what the producer allows per peer).
    #[arg(long, default_value_t = kvmesh_transfer::DEFAULT_STRIPES)]
    p2p_stripes: usize,
    /// Comma-separated addresses or networks (10.0.0.7, 10.0.0.0/8) allowed to pull from this
    /// engine's P2P producer. A producer on a non-loopback --host needs this or
    /// --p2p-secret-file.
    #[arg(long, value_delimiter = ',')]
    p2p_allowed_consumers: Vec<String>,
    /// Connections one peer address may hold on this engine's P2P producer.
    #[arg(long, default_value_t = kvmesh_transfer::server::DEFAULT_MAX_CONNECTIONS_PER_IP)]
    p2p_max_connections_per_ip: usize,
    /// Fetch streams one peer address may run at once on this engine's P2P producer (more wait
    /// their turn). Engines on one host share an address: raise it for a loopback fleet.
    #[arg(long, default_value_t = kvmesh_transfer::server::DEFAULT_MAX_TRANSFERS_PER_PEER)]
    p2p_max_fetches_per_peer: usize,
    /// Blocks one peer lookup may pin on this engine's P2P producer (the rest are answered MISS).
    #[arg(long, default_value_t = kvmesh_transfer::server::DEFAULT_MAX_PINS_PER_LOOKUP)]
    p2p_max_pins_per_lookup: usize,
    /// Blocks one peer address may hold pinned on this engine's P2P producer.
    #[arg(long, default_value_t = kvmesh_transfer::server::DEFAULT_MAX_PINNED_PER_PEER)]
    p2p_max_pinned_per_peer: usize,
    /// both | prefill | decode.
    #[arg(long, default_value = "both")]
    role: String,
    #[arg(long)]
    bidirectional_kv_xfer: bool,
    /// Seconds a decode engine retains a finished request's blocks.
    #[arg(long, default_value_t = 480)]
    decoder_kv_blocks_ttl: u64,
    #[arg(long, default_value_t = 64)]
    kv_recompute_threshold: usize,
    /// On SIGTERM / Ctrl-C, how long in-flight requests (streams included) may take to finish
    /// after the listener closes.
    #[arg(long, default_value = "30s", value_parser = crate::parse_duration)]
    drain_timeout: Duration,
    /// Drop a client that has not sent complete request headers within this; also bounds idle
    /// keep-alive connections and the gap between two chunks of a request body.
    #[arg(long, default_value = "10s", value_parser = crate::parse_duration)]
    header_read_timeout: Duration,
    /// Open client connections at most; more are answered 503 and closed at once.
    #[arg(long, default_value_t = HttpLimits::default().max_connections)]
    http_max_connections: usize,
    /// Open connections from one source address (IPv6: one /64) at most; 0 = no such cap.
    #[arg(long, default_value_t = HttpLimits::default().max_connections_per_ip)]
    http_max_connections_per_ip: usize,
    /// A request body must be complete this long after its headers, plus the time its bytes
    /// earn at --http-body-min-rate.
    #[arg(long, default_value = "30s", value_parser = crate::parse_duration)]
    http_body_timeout: Duration,
    /// Bytes per second a body must keep up to be given more time (e.g. 256KiB).
    #[arg(long, default_value = "256KiB")]
    http_body_min_rate: String,
    /// Bytes of request bodies all connections together may hold; past it, 503 + Retry-After.
    #[arg(long, default_value = "1GiB")]
    http_body_memory: String,
}

impl EngineCmd {
    /// The model `--backend model` loads: `--model`, else the fetched SmolLM2.
    fn model_path(&self) -> anyhow::Result<std::path::PathBuf> {
        match &self.model {
            Some(p) => Ok(std::path::PathBuf::from(p)),
            None => kvmesh_model::find_smollm2(&kvmesh_model::default_cache_dir()).context(
                "--backend model needs --model <gguf file or safetensors dir> (or fetch SmolLM2 first: `kvmesh model fetch`)",
            ),
        }
    }

    /// `--served-model-name`, else what clients of this backend expect to send.
    fn served_model_name(&self) -> anyhow::Result<String> {
        Ok(match &self.served_model_name {
            Some(n) => n.clone(),
            None if self.backend == "model" => model_name(&self.model_path()?),
            None => "sim".to_owned(),
        })
    }

    /// The engine configuration these flags describe.
    pub fn to_config(&self) -> anyhow::Result<EngineConfig> {
        let kv_events = self
            .kv_events_config
            .as_deref()
            .map(KvEventsConfig::parse)
            .transpose()?
            .map(|mut k| {
                k.load_reports &= !self.no_load_reports;
                k
            });
        let cfg = EngineConfig {
            host: self.host.clone(),
            advertise_host: self.advertise_host.clone(),
            port: self.port,
            served_model_name: self.served_model_name()?,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            cpu_offload_bytes: parse_byte_size(&self.cpu_offload_bytes)?,
            kv_events,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            // A real model's context is known once it is loaded (see `run`).
            max_model_len: resolve_max_model_len(
                self.max_model_len,
                None,
                self.num_gpu_blocks,
                self.block_size,
            )?,
            max_waiting: self.max_waiting,
            hash_algo: self.prefix_caching_hash_algo.parse()?,
            hash_seed: std::env::var("PYTHONHASHSEED").ok(),
            engine_label: self.engine_label.clone(),
            p2p: P2pConfig {
                port: self.p2p_port,
                allowed_peers: self.p2p_allowed_peers.clone(),
                timeout: Duration::from_millis(self.p2p_timeout_ms),
                pending_deadline: match self.p2p_pending_deadline_ms {
                    Some(ms) => Duration::from_millis(ms),
                    None if self.backend == "sim" && self.time_scale > 0.0 => {
                        Duration::from_millis(2000).div_f64(self.time_scale)
                    }
                    None => Duration::from_millis(2000),
                },
                deadline_factor: self.p2p_deadline_factor,
                deadline_floor: Duration::from_millis(self.p2p_deadline_floor_ms),
                pull_pin_fraction: self.p2p_pull_pin_fraction,
                load_mode: self.p2p_load_mode.parse()?,
                secret: self
                    .p2p_secret_file
                    .as_deref()
                    .map(read_secret)
                    .transpose()?,
                encrypt: self.p2p_encrypt,
                stripes: self.p2p_stripes,
                allowed_consumers: self.p2p_allowed_consumers.clone(),
                max_connections_per_ip: self.p2p_max_connections_per_ip,
                max_fetches_per_peer: self.p2p_max_fetches_per_peer,
                max_pins_per_lookup: self.p2p_max_pins_per_lookup,
                max_pinned_per_peer: self.p2p_max_pinned_per_peer,
                role: self.role.parse::<Role>()?,
                bidirectional_kv_xfer: self.bidirectional_kv_xfer,
                decoder_kv_blocks_ttl: Duration::from_secs(self.decoder_kv_blocks_ttl),
                kv_recompute_threshold: self.kv_recompute_threshold,
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// A model's name from its path: a GGUF file's stem or a safetensors directory's name; `model`
/// when the path has no name.
fn model_name(path: &std::path::Path) -> String {
    let named = if path.is_dir() {
        // Canonical, so `.` or `dir/` still names the directory.
        path.canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    } else {
        path.file_stem().map(|n| n.to_string_lossy().into_owned())
    };
    named
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "model".to_owned())
}

/// The secret is the file's content without its trailing newline; an empty one is refused.
fn read_secret(path: &std::path::Path) -> anyhow::Result<kvmesh_transfer::Secret> {
    let raw = std::fs::read(path)
        .with_context(|| format!("reading --p2p-secret-file {}", path.display()))?;
    let trimmed = raw.strip_suffix(b"\n").unwrap_or(&raw);
    let trimmed = trimmed.strip_suffix(b"\r").unwrap_or(trimmed);
    anyhow::ensure!(
        !trimmed.is_empty(),
        "--p2p-secret-file {} is empty",
        path.display()
    );
    Ok(kvmesh_transfer::Secret::new(trimmed))
}

fn list_profiles() {
    println!(
        "{:<22} {:>10} {:>12}  description / source",
        "profile", "KV B/tok", "2K prefill"
    );
    for p in PROFILES {
        println!(
            "{:<22} {:>10} {:>10.0}ms  {}",
            p.name,
            p.real_kv_bytes_per_token,
            p.prefill_total_ms(2048),
            p.description
        );
        println!("{:<22} {:>10} {:>12}  source: {}", "", "", "", p.source);
    }
    println!();
    print!("{}", link_validation());
}

/// The `--sim-link` presets and, per profile, the default link's single uncontended pull next to
/// the profile's pull ladder: a validation of the derived link, not an input to it.
fn link_validation() -> String {
    use std::fmt::Write;
    let gpt = &kvmesh_engine::compute::profiles::GPT_OSS_120B_H200;
    let mut out =
        String::from("sim links (--sim-link), as a gpt-oss-120b-h200 engine gets them:\n");
    for name in ["llmd-h200", "rdma-400g", "tcp-100g", "ladder"] {
        if let Ok(link) = name.parse::<SimLink>() {
            let _ = writeln!(out, "  {}", link.describe(gpt));
        }
    }
    let _ = writeln!(
        out,
        "\nvalidation: single uncontended pull on the default link ({DEFAULT_SIM_LINK}, fitted per \
         profile) vs the profile's pull ladder (published by llm-d for gpt-oss-120b and glm-5.2; an \
         estimate for llama-3.1-8b)"
    );
    for p in PROFILES {
        let link = fitted(p);
        let _ = writeln!(
            out,
            "  {} ({} B/token; {:.1} Gb/s, {:.1} ms setup):",
            p.name,
            p.real_kv_bytes_per_token,
            link.gbps(),
            link.setup_s * 1000.0
        );
        let _ = writeln!(
            out,
            "    {:>8} {:>10} {:>10} {:>7}",
            "tokens", "ladder", "derived", "error"
        );
        for row in validation(p, &link) {
            let _ = writeln!(
                out,
                "    {:>8.0} {:>8.0}ms {:>8.1}ms {:>+6.1}%",
                row.tokens,
                row.published_ms,
                row.derived_ms,
                100.0 * row.relative_error(),
            );
        }
    }
    out
}

pub async fn run(args: EngineCmd) -> anyhow::Result<()> {
    if args.list_profiles {
        list_profiles();
        return Ok(());
    }
    let mut config = args.to_config()?;
    let (backend, tokenizer): (_, Arc<dyn kvmesh_text::Tokenizer>) = match args.backend.as_str() {
        "sim" => (
            sim_backend_with_link(
                &config,
                &args.profile,
                args.time_scale,
                args.sim_kv_bytes_per_token,
                args.sim_link.parse::<SimLink>()?,
                args.sim_h2d
                    .parse::<kvmesh_engine::compute::sim::SimH2d>()
                    .map_err(anyhow::Error::msg)?,
            )?,
            Arc::new(ByteTokenizer),
        ),
        "model" => {
            let path = args.model_path()?;
            let opts = kvmesh_model::LoadOptions {
                block_size: config.block_size,
                kv_dtype: match args.kv_dtype.as_str() {
                    "f32" => kvmesh_model::KvDtype::F32,
                    "bf16" => kvmesh_model::KvDtype::Bf16,
                    other => anyhow::bail!("unknown --kv-dtype `{other}` (f32, bf16)"),
                },
                ..Default::default()
            };
            let (backend, tok) =
                tokio::task::spawn_blocking(move || kvmesh_model::load_backend(&path, &opts))
                    .await??;
            config.max_model_len = resolve_max_model_len(
                args.max_model_len,
                kvmesh_engine::compute::ComputeBackend::max_context(&backend),
                config.num_gpu_blocks,
                config.block_size,
            )?;
            (
                Box::new(backend) as Box<dyn kvmesh_engine::compute::ComputeBackend>,
                tok,
            )
        }
        other => anyhow::bail!("unknown --backend `{other}` (sim, model)"),
    };
    let http = HttpLimits {
        header_read_timeout: args.header_read_timeout,
        drain_timeout: args.drain_timeout,
        body_timeout: args.http_body_timeout,
        body_min_rate: parse_byte_size(&args.http_body_min_rate).context("--http-body-min-rate")?,
        body_memory: usize::try_from(
            parse_byte_size(&args.http_body_memory).context("--http-body-memory")?,
        )
        .unwrap_or(usize::MAX),
        max_connections: args.http_max_connections,
        max_connections_per_ip: args.http_max_connections_per_ip,
        ..HttpLimits::default()
    };
    http.validate()
        .map_err(|e| anyhow::anyhow!("{}: {}", e.setting.flag(), e.reason))?;
    let options = ServerOptions {
        http,
        ..ServerOptions::default()
    };
    let server = start_server(config, backend, tokenizer, options)
        .await
        .context("starting engine")?;
    if args.backend == "sim" {
        // Which physics the transfers get, on record in the engine's log.
        if let (Ok(link), Some(profile)) = (
            args.sim_link.parse::<SimLink>(),
            kvmesh_engine::compute::profiles::profile(&args.profile),
        ) {
            eprintln!(
                "kvmesh engine: sim link {}; CPU-tier restores: {}",
                link.describe(profile),
                args.sim_h2d
            );
        }
    }
    // The line launchers and tests parse to learn the port.
    println!("kvmesh engine listening on http://{}", server.addr);
    if let Some(addr) = &server.p2p_addr {
        println!("kvmesh engine p2p listening on {addr}");
    }
    // A line of its own, so launchers parsing the line above still read a socket address.
    if let Some(adv) = &server.p2p_advertised {
        println!("kvmesh engine p2p advertised as {adv}");
    }
    if let Some(ep) = &server.events_endpoint {
        println!(
            "{}",
            kv_events_line(ep, server.events_mode, server.events_advertised.as_deref())
        );
    }
    if let Some(ep) = &server.replay_endpoint {
        println!("kvmesh engine kv events replay bound on {ep}{}", scope(ep));
    }
    let cancel = server.cancel_token();
    let drain = args.drain_timeout;
    tokio::spawn(async move {
        let signal = crate::shutdown_signal().await;
        eprintln!(
            "kvmesh engine: {signal}: not accepting new connections; draining in-flight requests (up to {})",
            humantime::format_duration(drain)
        );
        cancel.cancel();
    });
    let mut server = server;
    server.wait().await;
    server.shutdown().await;
    eprintln!("kvmesh engine: drained, exiting");
    Ok(())
}

/// The startup line for the PUB socket: says whether it listens or dials out, and where, because
/// a connecting engine with no subscriber bound there publishes into the void; a socket bound on
/// all interfaces also says where subscribers connect (`advertised`).
fn kv_events_line(
    endpoint: &str,
    mode: Option<kvmesh_events::EndpointMode>,
    advertised: Option<&str>,
) -> String {
    match mode {
        Some(kvmesh_events::EndpointMode::Connect) => format!(
            "kvmesh engine kv events connecting to {endpoint} (the subscriber must bind it; \
             events wait in a bounded buffer until it does)"
        ),
        _ => {
            let scope = scope(endpoint);
            match advertised.filter(|a| !scope.is_empty() && *a != endpoint) {
                Some(adv) => format!(
                    "kvmesh engine kv events bound on {endpoint} (all interfaces; subscribers \
                     connect to {adv})"
                ),
                None => format!("kvmesh engine kv events bound on {endpoint}{scope}"),
            }
        }
    }
}

/// Says so when a bound socket listens beyond this host.
fn scope(endpoint: &str) -> &'static str {
    if endpoint.starts_with("tcp://0.0.0.0:") || endpoint.starts_with("tcp://[::]:") {
        " (all interfaces)"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn the_kv_events_line_says_bind_or_connect_and_where() {
        use kvmesh_events::EndpointMode::{Bind, Connect};
        let c = kv_events_line("tcp://127.0.0.1:5557", Some(Connect), None);
        assert!(
            c.contains("connecting to tcp://127.0.0.1:5557") && c.contains("must bind"),
            "{c}"
        );
        let b = kv_events_line(
            "tcp://127.0.0.1:5557",
            Some(Bind),
            Some("tcp://127.0.0.1:5557"),
        );
        assert_eq!(b, "kvmesh engine kv events bound on tcp://127.0.0.1:5557");
        let all = kv_events_line("tcp://0.0.0.0:5557", Some(Bind), None);
        assert!(all.ends_with("(all interfaces)"), "{all}");
        let adv = kv_events_line(
            "tcp://0.0.0.0:5557",
            Some(Bind),
            Some("tcp://10.0.0.7:5557"),
        );
        assert!(
            adv.starts_with("kvmesh engine kv events bound on tcp://0.0.0.0:5557 (all interfaces")
                && adv.ends_with("subscribers connect to tcp://10.0.0.7:5557)"),
            "{adv}"
        );
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineCmd,
    }

    fn config(args: &[&str]) -> anyhow::Result<EngineConfig> {
        let cli = Cli::try_parse_from(std::iter::once("kvmesh-engine").chain(args.iter().copied()))
            .unwrap();
        cli.engine.to_config()
    }

    /// Beyond loopback, a P2P producer must authenticate or list its consumers; the error names
    /// the flags that fix it.
    #[test]
    fn a_p2p_producer_on_all_interfaces_without_secret_or_allow_list_is_refused() {
        let err = config(&["--host", "0.0.0.0", "--p2p-port", "0"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--p2p-secret-file") && err.contains("--p2p-allowed-consumers"),
            "{err}"
        );
        let listed = config(&[
            "--host",
            "0.0.0.0",
            "--p2p-port",
            "0",
            "--p2p-allowed-consumers",
            "10.0.0.0/8,192.168.1.7",
            "--advertise-host",
            "10.0.0.7",
            "--p2p-max-connections-per-ip",
            "8",
            "--p2p-max-pins-per-lookup",
            "100",
            "--p2p-max-pinned-per-peer",
            "1000",
        ])
        .unwrap();
        assert_eq!(listed.p2p.allowed_consumers, ["10.0.0.0/8", "192.168.1.7"]);
        assert_eq!(
            (
                listed.p2p.max_connections_per_ip,
                listed.p2p.max_pins_per_lookup,
                listed.p2p.max_pinned_per_peer
            ),
            (8, 100, 1000)
        );
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "s3cret\n").unwrap();
        let secret = secret.display().to_string();
        assert!(
            config(&[
                "--host",
                "0.0.0.0",
                "--p2p-port",
                "0",
                "--p2p-secret-file",
                &secret,
                "--advertise-host",
                "10.0.0.7"
            ])
            .is_ok()
        );
        // Protected but with no address to hand peers: refused, naming the flag.
        let err = config(&[
            "--host",
            "0.0.0.0",
            "--p2p-port",
            "0",
            "--p2p-secret-file",
            &secret,
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("--advertise-host"), "{err}");
        assert!(config(&["--p2p-port", "0"]).is_ok(), "loopback by default");
        assert!(
            config(&["--host", "0.0.0.0"]).is_ok(),
            "no producer, nothing to protect"
        );
    }

    /// `--list-profiles` prints the derived-vs-published ladder, every gpt-oss point within 15 %.
    #[test]
    fn the_link_validation_lists_the_published_and_derived_ladder() {
        let text = link_validation();
        assert!(text.contains("llmd-h200 (145.0 Gb/s"), "{text}");
        assert!(
            text.contains("gpt-oss-120b-h200 (73728 B/token; 145.0 Gb/s"),
            "{text}"
        );
        assert!(text.contains("235ms"), "{text}");
        let _ = config(&["--sim-link", "200,5"]);
        let cli = Cli::try_parse_from(["kvmesh-engine", "--sim-link", "tcp-100g"]).unwrap();
        assert_eq!(cli.engine.sim_link, "tcp-100g");
    }

    fn served(args: &[&str]) -> String {
        let cli = Cli::try_parse_from(std::iter::once("kvmesh-engine").chain(args.iter().copied()))
            .unwrap();
        cli.engine.to_config().unwrap().served_model_name
    }

    /// Clients of a real model send its name (as with `vllm serve <model>`), not `sim`.
    #[test]
    fn model_backend_serves_the_models_name_unless_told_otherwise() {
        assert_eq!(served(&[]), "sim");
        assert_eq!(
            served(&[
                "--backend",
                "model",
                "--model",
                "/m/SmolLM2-135M-Instruct-Q8_0.gguf"
            ]),
            "SmolLM2-135M-Instruct-Q8_0"
        );
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("Llama-3.2-1B");
        std::fs::create_dir(&model_dir).unwrap();
        let with_slash = format!("{}/", model_dir.display());
        assert_eq!(
            served(&["--backend", "model", "--model", &with_slash]),
            "Llama-3.2-1B"
        );
        assert_eq!(
            served(&[
                "--backend",
                "model",
                "--model",
                &with_slash,
                "--served-model-name",
                "mine"
            ]),
            "mine"
        );
        assert_eq!(
            served(&["--served-model-name", "sim-gpt-oss"]),
            "sim-gpt-oss"
        );
    }
}
