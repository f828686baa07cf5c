//! `kvmesh events`: watch any vLLM-compatible engine's KV events.
//!
//! `listen` prints one JSON line per event on stdout and reports sequence gaps, publisher restarts
//! and malformed frames on stderr (with running counts); nothing a peer sends stops it. `replay`
//! asks a replay endpoint for its buffered batches.

use std::io::Write;

use anyhow::Context;
use kvmesh_core::events::{EventBatch, KvEvent};
use kvmesh_events::{SubscriberConfig, SubscriberItem, request_replay, subscribe};
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct EventsArgs {
    #[command(subcommand)]
    pub command: EventsCommand,
}

#[derive(clap::Subcommand)]
pub enum EventsCommand {
    /// Subscribe to a KV-event stream and print one JSON line per event.
    Listen(ListenArgs),
    /// Fetch the batches a replay endpoint still buffers and print them like `listen`.
    Replay(ReplayArgs),
}

#[derive(clap::Args)]
pub struct ListenArgs {
    /// The engine's endpoint, e.g. tcp://127.0.0.1:5557 (a `*` host binds).
    pub endpoint: String,
    /// Bind the endpoint instead of connecting: needed when the engine was configured with a
    /// non-wildcard endpoint, which it connects to.
    #[arg(long)]
    pub bind: bool,
    /// Topic prefix to subscribe to (default: all topics).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Exit after printing this many events.
    #[arg(long)]
    pub count: Option<u64>,
    /// The engine's replay endpoint; gaps are filled from it before being reported.
    #[arg(long)]
    pub replay: Option<String>,
}

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// The engine's replay endpoint, e.g. tcp://127.0.0.1:5558.
    pub endpoint: String,
    /// First sequence number wanted.
    #[arg(long, default_value_t = 0)]
    pub from: u64,
}

pub async fn run(args: EventsArgs) -> anyhow::Result<()> {
    match args.command {
        EventsCommand::Listen(a) => listen(a).await,
        EventsCommand::Replay(a) => replay(a).await,
    }
}

/// Running totals, reported on stderr as things happen and once at exit.
#[derive(Default)]
struct Counts {
    batches: u64,
    events: u64,
    gaps: u64,
    lost: u64,
    restarts: u64,
    malformed: u64,
}

async fn listen(args: ListenArgs) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    let config = SubscriberConfig {
        endpoint: args.endpoint.clone(),
        bind: args.bind,
        topic: args.topic.clone(),
        // Engines' load reports share the socket: shown, not mistaken for malformed events.
        side_topics: vec![kvmesh_core::load_report::LOAD_TOPIC.to_owned()],
        replay_endpoint: args.replay.clone(),
        allowed_peers: None,
    };
    // Validate up front so a typo fails fast instead of retrying forever.
    kvmesh_events::resolve_endpoint(&args.endpoint)?;
    if let Some(r) = &args.replay {
        kvmesh_events::resolve_endpoint(r).context("--replay")?;
    }
    let mut rx = subscribe(config, cancel.clone());
    let mut counts = Counts::default();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut first = true;
    let result = loop {
        let item = tokio::select! {
            _ = tokio::signal::ctrl_c() => break Ok(()),
            item = rx.recv() => item,
        };
        let Some(item) = item else { break Ok(()) };
        match item {
            SubscriberItem::Listening { endpoint } => {
                let how = if args.bind { "bound" } else { "connected to" };
                eprintln!("events: {how} {endpoint}");
            }
            SubscriberItem::Batch { topic, seq, batch } => {
                if first {
                    eprintln!("events: first batch seq {seq} on topic {topic:?}");
                    first = false;
                }
                counts.batches += 1;
                let remaining = args.count.map(|c| c.saturating_sub(counts.events));
                let printed = print_batch(&mut out, &topic, seq, &batch, remaining);
                counts.events += printed;
                if let Err(e) = out.flush() {
                    // A closed pipe (e.g. `| head`) ends the command quietly.
                    break if e.kind() == std::io::ErrorKind::BrokenPipe {
                        Ok(())
                    } else {
                        Err(e.into())
                    };
                }
                if args.count.is_some_and(|c| counts.events >= c) {
                    break Ok(());
                }
            }
            SubscriberItem::Side { topic, payload } => {
                eprintln!("events: {topic} {}", String::from_utf8_lossy(&payload));
            }
            SubscriberItem::Gap {
                topic,
                expected,
                got,
            } => {
                counts.gaps += 1;
                counts.lost += got - expected;
                eprintln!(
                    "events: gap on topic {topic:?}: expected seq {expected}, got {got} \
                     ({} batches lost; {} gaps so far)",
                    got - expected,
                    counts.gaps
                );
            }
            SubscriberItem::Restart {
                topic,
                last_seq,
                new_seq,
            } => {
                counts.restarts += 1;
                eprintln!(
                    "events: publisher restart on topic {topic:?}: seq went from {last_seq} back to \
                     {new_seq} ({} restarts so far)",
                    counts.restarts
                );
            }
            SubscriberItem::Malformed { seq, error } => {
                counts.malformed += 1;
                let at = seq.map_or_else(|| "unknown seq".to_owned(), |s| format!("seq {s}"));
                eprintln!(
                    "events: malformed message ({at}) skipped: {error} ({} malformed so far)",
                    counts.malformed
                );
            }
            SubscriberItem::Error { error } => eprintln!("events: socket: {error} (retrying)"),
        }
    };
    cancel.cancel();
    eprintln!(
        "events: {} events in {} batches; {} gaps ({} batches lost), {} restarts, {} malformed",
        counts.events, counts.batches, counts.gaps, counts.lost, counts.restarts, counts.malformed
    );
    result
}

async fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    let batches = request_replay(&args.endpoint, args.from).await?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for (seq, batch) in &batches {
        print_batch(&mut out, "", *seq, batch, None);
    }
    out.flush()?;
    eprintln!(
        "events: {} batches replayed from seq {}",
        batches.len(),
        args.from
    );
    Ok(())
}

/// Writes up to `limit` events of a batch as JSON lines; returns how many were written.
fn print_batch(
    out: &mut impl Write,
    topic: &str,
    seq: u64,
    batch: &EventBatch,
    limit: Option<u64>,
) -> u64 {
    let mut n = 0;
    for event in &batch.events {
        if limit.is_some_and(|l| n >= l) {
            break;
        }
        let line = event_json(topic, seq, batch, event);
        if writeln!(out, "{line}").is_err() {
            break;
        }
        n += 1;
    }
    n
}

/// One printed event; field order is the documented output order.
#[derive(serde::Serialize)]
struct EventLine<'a> {
    seq: u64,
    topic: &'a str,
    ts: f64,
    dp_rank: Option<i64>,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    medium: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    block_hashes: Option<Vec<u64>>,
    /// `null` for a chain start; absent for non-store events.
    #[serde(skip_serializing_if = "Option::is_none")]
    parent: Option<Option<u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    block_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lora_id: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group_idx: Option<u32>,
}

fn event_json(topic: &str, seq: u64, batch: &EventBatch, event: &KvEvent) -> String {
    let mut line = EventLine {
        seq,
        topic,
        ts: batch.ts,
        dp_rank: batch.data_parallel_rank,
        kind: "AllBlocksCleared",
        medium: None,
        block_hashes: None,
        parent: None,
        token_ids: None,
        block_size: None,
        lora_id: None,
        group_idx: None,
    };
    match event {
        KvEvent::BlockStored(e) => {
            line.kind = "BlockStored";
            line.medium = Some(e.medium.as_str());
            line.block_hashes = Some(e.block_hashes.iter().map(|h| h.0).collect());
            line.parent = Some(e.parent_block_hash.map(|h| h.0));
            line.token_ids = Some(&e.token_ids);
            line.block_size = Some(e.block_size);
            line.lora_id = e.lora_id;
            line.group_idx = e.group_idx;
        }
        KvEvent::BlockRemoved(e) => {
            line.kind = "BlockRemoved";
            line.medium = Some(e.medium.as_str());
            line.block_hashes = Some(e.block_hashes.iter().map(|h| h.0).collect());
            line.group_idx = e.group_idx;
        }
        KvEvent::AllBlocksCleared => {}
    }
    // Serializing plain fields cannot fail; fall back to a JSON error object just in case.
    serde_json::to_string(&line).unwrap_or_else(|e| {
        format!(
            r#"{{"seq":{seq},"error":"{}"}}"#,
            e.to_string().escape_default()
        )
    })
}
