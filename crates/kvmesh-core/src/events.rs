//! vLLM KV events: types and the msgpack wire codec (`vllm/distributed/kv_events.py`).
//!
//! A ZMQ message is three frames `[topic, seq (u64 BE), payload]`; the payload is a msgpack array
//! `[ts, [event...], data_parallel_rank]`. Events arrive in the map encoding (vLLM ≥ mid-2026) or
//! the older array encoding; both decode to [`KvEvent`].

use bytes::Bytes;
use rmp::decode::RmpRead;
use thiserror::Error;

use crate::TokenId;
use crate::hashing::{BlockHash, event_hash_from_bytes};

/// Storage tier a KV event refers to. Compared case-insensitively on the wire; absent means GPU.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Cpu,
    Storage,
    /// Any other tier name, kept verbatim (upper-cased).
    Other(String),
}

impl Medium {
    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
            Medium::Other(s) => s,
        }
    }

    /// Parses a wire medium name case-insensitively.
    pub fn parse(s: &str) -> Medium {
        if s.eq_ignore_ascii_case("gpu") {
            Medium::Gpu
        } else if s.eq_ignore_ascii_case("cpu") {
            Medium::Cpu
        } else if s.eq_ignore_ascii_case("storage") {
            Medium::Storage
        } else {
            Medium::Other(s.to_ascii_uppercase())
        }
    }
}

/// A stored block run: `block_hashes[i]` covers `token_ids[i*block_size..(i+1)*block_size]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    pub parent_block_hash: Option<BlockHash>,
    /// Concatenated tokens of all blocks; empty for CPU-tier events from vLLM's offloading
    /// connector unless it is self-describing.
    pub token_ids: Vec<TokenId>,
    /// Tokens per block; 0 when the event carries no tokens.
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Medium,
    pub lora_name: Option<String>,
    /// The vLLM KV-cache group the blocks were stored in (HMA: one per attention type and layer
    /// set); `None` from kvmesh's own engines and vLLM before groups were published.
    pub group_idx: Option<u32>,
    /// The group's kind: `full_attention`, `sliding_window`, `mamba`, … (see [`FULL_ATTENTION`]).
    pub kv_cache_spec_kind: Option<String>,
    /// The group's attention window in tokens, for sliding-window kinds. With it the router can
    /// tell how many trailing blocks a prefix hit needs in that group.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// The `cache_salt` hashed into this run's first block, when the run starts a salted
    /// request's chain (vLLM hashes the salt into block 0 only). On the wire it is the last
    /// string of block 0's `extra_keys`, after the LoRA name when there is one, as vLLM's
    /// `to_event_extra_keys` publishes it.
    pub cache_salt: Option<String>,
}

/// `kv_cache_spec_kind` of a full-attention KV-cache group, as vLLM 0.32 reports it.
pub const FULL_ATTENTION: &str = "full_attention";
/// `kv_cache_spec_kind` of a sliding-window group (its window is `kv_cache_spec_sliding_window`).
pub const SLIDING_WINDOW: &str = "sliding_window";
/// `kv_cache_spec_kind` of a Mamba / linear-attention state group.
pub const MAMBA: &str = "mamba";

impl BlockStored {
    /// Marks the event as vLLM 0.32 marks a model with one full-attention KV-cache group
    /// (`group_idx` 0, `kv_cache_spec_kind` "full_attention"): what a kvmesh engine publishes.
    pub fn in_full_attention_group(mut self) -> Self {
        self.group_idx = Some(0);
        self.kv_cache_spec_kind = Some(FULL_ATTENTION.to_owned());
        self
    }

    /// A run of `block_hashes` stored in `medium` under `parent`, with their concatenated
    /// `token_ids` (vLLM's optional LoRA / group / spec fields unset).
    pub fn run(
        medium: Medium,
        parent: Option<BlockHash>,
        block_size: u32,
        block_hashes: Vec<BlockHash>,
        token_ids: Vec<TokenId>,
    ) -> Self {
        Self {
            block_hashes,
            parent_block_hash: parent,
            token_ids,
            block_size,
            lora_id: None,
            medium,
            lora_name: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
            cache_salt: None,
        }
    }

    /// The run starts a chain salted with `salt` (empty means unsalted, as in vLLM).
    pub fn with_cache_salt(mut self, salt: Option<&str>) -> Self {
        self.cache_salt = salt.filter(|s| !s.is_empty()).map(str::to_owned);
        self
    }
}

/// Blocks dropped from one tier.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<BlockHash>,
    pub medium: Medium,
    pub group_idx: Option<u32>,
}

/// One KV event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// The decoded payload of one ZMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Which event encoding to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventEncoding {
    /// vLLM's current map form (what vLLM 0.32 emits).
    #[default]
    Map,
    /// The older positional array form.
    Array,
}

/// Why a payload or frame could not be decoded.
#[derive(Debug, Error, PartialEq)]
pub enum EventDecodeError {
    #[error("malformed msgpack: {0}")]
    Msgpack(String),
    #[error("unexpected shape: {0}")]
    Shape(String),
    #[error("unknown event type `{0}`")]
    UnknownType(String),
    #[error("frame: {0}")]
    Frame(String),
}

// ---------------------------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------------------------

/// One ZMQ message of the KV-event stream: `[topic, seq (u64 BE), payload]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFrame {
    /// Publisher topic (vLLM default `""`, often `"kv-events"`).
    pub topic: String,
    /// Batch sequence number: from 0, +1 per batch, per publisher incarnation.
    pub seq: u64,
    /// Raw msgpack payload; decode with [`decode_batch`].
    pub payload: Bytes,
}

impl EventFrame {
    /// Parses the three parts of one ZMQ message.
    pub fn from_parts<P: AsRef<[u8]>>(parts: &[P]) -> Result<EventFrame, EventDecodeError> {
        if parts.len() != 3 {
            return Err(EventDecodeError::Frame(format!(
                "expected 3 parts [topic, seq, payload], got {}",
                parts.len()
            )));
        }
        let topic = std::str::from_utf8(parts[0].as_ref())
            .map_err(|_| EventDecodeError::Frame("topic is not valid utf-8".into()))?
            .to_owned();
        let seq = parse_seq(parts[1].as_ref())?;
        Ok(EventFrame {
            topic,
            seq,
            payload: Bytes::copy_from_slice(parts[2].as_ref()),
        })
    }

    /// Like [`EventFrame::from_parts`] but takes ownership of already reference-counted parts
    /// (what the `zeromq` crate hands out), so the payload is not copied.
    pub fn from_owned_parts(parts: Vec<Bytes>) -> Result<EventFrame, EventDecodeError> {
        if parts.len() != 3 {
            return Err(EventDecodeError::Frame(format!(
                "expected 3 parts [topic, seq, payload], got {}",
                parts.len()
            )));
        }
        let mut it = parts.into_iter();
        let (Some(topic), Some(seq), Some(payload)) = (it.next(), it.next(), it.next()) else {
            return Err(EventDecodeError::Frame("missing part".into()));
        };
        let topic = String::from_utf8(topic.to_vec())
            .map_err(|_| EventDecodeError::Frame("topic is not valid utf-8".into()))?;
        let seq = parse_seq(&seq)?;
        Ok(EventFrame {
            topic,
            seq,
            payload,
        })
    }

    /// The three parts to send.
    pub fn to_parts(&self) -> [Bytes; 3] {
        [
            Bytes::copy_from_slice(self.topic.as_bytes()),
            Bytes::copy_from_slice(&self.seq.to_be_bytes()),
            self.payload.clone(),
        ]
    }

    /// Decodes the payload.
    pub fn decode(&self) -> Result<EventBatch, EventDecodeError> {
        decode_batch(&self.payload)
    }
}

/// Reads an 8-byte big-endian sequence number.
pub fn parse_seq(raw: &[u8]) -> Result<u64, EventDecodeError> {
    let arr: [u8; 8] = raw.try_into().map_err(|_| {
        EventDecodeError::Frame(format!("seq part must be 8 bytes, got {}", raw.len()))
    })?;
    Ok(u64::from_be_bytes(arr))
}

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

/// Encodes a batch as vLLM does: `[ts, [event...], dp_rank]` with events in `encoding`.
///
/// The map form reproduces vLLM 0.32's field set and key order byte for byte (integers in
/// minimal msgpack encoding, `ts` as float64, `extra_keys` as one nil per block).
pub fn encode_batch(batch: &EventBatch, encoding: EventEncoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 256);
    encode_batch_into(batch, encoding, &mut out);
    out
}

/// [`encode_batch`] appending to a reusable buffer.
pub fn encode_batch_into(batch: &EventBatch, encoding: EventEncoding, out: &mut Vec<u8>) {
    let mut w = Writer(out);
    w.array_len(3);
    w.f64(batch.ts);
    w.array_len(batch.events.len());
    for event in &batch.events {
        match encoding {
            EventEncoding::Map => encode_event_map(&mut w, event),
            EventEncoding::Array => encode_event_array(&mut w, event),
        }
    }
    match batch.data_parallel_rank {
        Some(r) => w.int(r),
        None => w.nil(),
    }
}

/// Thin wrapper over `rmp::encode` writing into a `Vec`, where writes cannot fail.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    // `rmp` reports I/O errors of the underlying writer; a `Vec` never fails, so results are
    // intentionally discarded.
    fn array_len(&mut self, n: usize) {
        let _ = rmp::encode::write_array_len(self.0, saturating_u32(n));
    }
    fn map_len(&mut self, n: u32) {
        let _ = rmp::encode::write_map_len(self.0, n);
    }
    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(self.0, s);
    }
    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(self.0, v);
    }
    fn int(&mut self, v: i64) {
        // `write_sint` picks the smallest representation, positive values as unsigned like msgspec.
        let _ = rmp::encode::write_sint(self.0, v);
    }
    fn f64(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(self.0, v);
    }
    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(self.0);
    }
    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    fn opt_int(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.int(v),
            None => self.nil(),
        }
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }
    fn hashes(&mut self, hashes: &[BlockHash]) {
        self.array_len(hashes.len());
        for h in hashes {
            self.uint(h.0);
        }
    }
    fn tokens(&mut self, tokens: &[TokenId]) {
        self.array_len(tokens.len());
        for &t in tokens {
            self.uint(u64::from(t));
        }
    }
    /// vLLM's event form of the extra keys, one entry per block: the LoRA name in every block,
    /// the salt appended in block 0, nil for a block with neither.
    fn extra_keys(&mut self, e: &BlockStored) {
        let lora = e.lora_name.as_deref();
        let salt = e.cache_salt.as_deref().filter(|s| !s.is_empty());
        if lora.is_none() && salt.is_none() {
            self.nils(e.block_hashes.len());
            return;
        }
        self.array_len(e.block_hashes.len());
        for i in 0..e.block_hashes.len() {
            let salt = if i == 0 { salt } else { None };
            let n = usize::from(lora.is_some()) + usize::from(salt.is_some());
            if n == 0 {
                self.nil();
                continue;
            }
            self.array_len(n);
            for s in lora.into_iter().chain(salt) {
                self.str(s);
            }
        }
    }
    fn nils(&mut self, n: usize) {
        self.array_len(n);
        for _ in 0..n {
            self.nil();
        }
    }
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

const BLOCK_STORED: &str = "BlockStored";
const BLOCK_REMOVED: &str = "BlockRemoved";
const ALL_BLOCKS_CLEARED: &str = "AllBlocksCleared";

fn encode_event_map(w: &mut Writer<'_>, event: &KvEvent) {
    match event {
        KvEvent::BlockStored(e) => {
            // The window is written only when set, so captures of vLLM versions that did not
            // publish it re-encode byte for byte.
            w.map_len(11 + u32::from(e.kv_cache_spec_sliding_window.is_some()));
            w.str("type");
            w.str(BLOCK_STORED);
            w.str("block_hashes");
            w.hashes(&e.block_hashes);
            w.str("parent_block_hash");
            w.opt_uint(e.parent_block_hash.map(|h| h.0));
            w.str("token_ids");
            w.tokens(&e.token_ids);
            w.str("block_size");
            w.uint(u64::from(e.block_size));
            w.str("lora_id");
            w.opt_int(e.lora_id);
            w.str("medium");
            w.str(e.medium.as_str());
            w.str("lora_name");
            w.opt_str(e.lora_name.as_deref());
            w.str("extra_keys");
            w.extra_keys(e);
            w.str("group_idx");
            w.opt_uint(e.group_idx.map(u64::from));
            w.str("kv_cache_spec_kind");
            w.opt_str(e.kv_cache_spec_kind.as_deref());
            if let Some(window) = e.kv_cache_spec_sliding_window {
                w.str("kv_cache_spec_sliding_window");
                w.uint(u64::from(window));
            }
        }
        KvEvent::BlockRemoved(e) => {
            w.map_len(4);
            w.str("type");
            w.str(BLOCK_REMOVED);
            w.str("block_hashes");
            w.hashes(&e.block_hashes);
            w.str("medium");
            w.str(e.medium.as_str());
            w.str("group_idx");
            w.opt_uint(e.group_idx.map(u64::from));
        }
        KvEvent::AllBlocksCleared => {
            w.map_len(1);
            w.str("type");
            w.str(ALL_BLOCKS_CLEARED);
        }
    }
}

fn encode_event_array(w: &mut Writer<'_>, event: &KvEvent) {
    match event {
        KvEvent::BlockStored(e) => {
            w.array_len(11 + usize::from(e.kv_cache_spec_sliding_window.is_some()));
            w.str(BLOCK_STORED);
            w.hashes(&e.block_hashes);
            w.opt_uint(e.parent_block_hash.map(|h| h.0));
            w.tokens(&e.token_ids);
            w.uint(u64::from(e.block_size));
            w.opt_int(e.lora_id);
            w.str(e.medium.as_str());
            w.opt_str(e.lora_name.as_deref());
            w.extra_keys(e);
            w.opt_uint(e.group_idx.map(u64::from));
            w.opt_str(e.kv_cache_spec_kind.as_deref());
            if let Some(window) = e.kv_cache_spec_sliding_window {
                w.uint(u64::from(window));
            }
        }
        KvEvent::BlockRemoved(e) => {
            w.array_len(4);
            w.str(BLOCK_REMOVED);
            w.hashes(&e.block_hashes);
            w.str(e.medium.as_str());
            w.opt_uint(e.group_idx.map(u64::from));
        }
        KvEvent::AllBlocksCleared => {
            w.array_len(1);
            w.str(ALL_BLOCKS_CLEARED);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

/// Nesting deeper than this is refused (vLLM payloads nest 4 levels; unknown fields may add a few).
const MAX_DEPTH: u32 = 32;

/// Decodes one payload (`[ts, [event...], dp_rank?]`), accepting both event encodings.
///
/// Never panics and never trusts a declared length: every allocation is bounded by the number of
/// bytes actually left in the input, so a forged `array32` of 4 billion elements costs nothing.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, EventDecodeError> {
    decode_batch_with_stats(payload, &mut DecodeStats::default())
}

/// What [`decode_batch_with_stats`] skipped while decoding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Events of a type this version does not know (skipped, like unknown fields).
    pub unknown_events: u64,
}

/// [`decode_batch`] that also counts skipped unknown event types into `stats`.
pub fn decode_batch_with_stats(
    payload: &[u8],
    stats: &mut DecodeStats,
) -> Result<EventBatch, EventDecodeError> {
    let mut r = Reader::new(payload);
    let n = r.array_len()?;
    if n < 2 {
        return Err(shape(format!(
            "batch array has {n} elements, expected [ts, events, dp_rank?]"
        )));
    }
    let ts = r.number()?;
    let n_events = r.array_len()?;
    let mut events = Vec::with_capacity(r.bounded(n_events));
    for i in 0..n_events {
        match r.event() {
            Ok(ev) => events.push(ev),
            // A newer vLLM may add event types: skip them like unknown fields, but count them.
            Err(EventDecodeError::UnknownType(_)) => stats.unknown_events += 1,
            Err(e) => return Err(e.context(&format!("event {i}"))),
        }
    }
    let data_parallel_rank = if n >= 3 {
        r.opt_int("data_parallel_rank")?
    } else {
        None
    };
    for _ in 3..n {
        r.skip(0)?;
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn shape(msg: impl Into<String>) -> EventDecodeError {
    EventDecodeError::Shape(msg.into())
}

impl EventDecodeError {
    fn context(self, ctx: &str) -> EventDecodeError {
        match self {
            EventDecodeError::Msgpack(m) => EventDecodeError::Msgpack(format!("{ctx}: {m}")),
            EventDecodeError::Shape(m) => EventDecodeError::Shape(format!("{ctx}: {m}")),
            other => other,
        }
    }
}

/// Fields of one event gathered in either encoding, before its type is known.
#[derive(Default)]
struct EventFields {
    block_hashes: Option<Vec<BlockHash>>,
    parent_block_hash: Option<BlockHash>,
    token_ids: Option<Vec<TokenId>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    lora_name: Option<String>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    kv_cache_spec_sliding_window: Option<u32>,
    /// The strings of block 0's `extra_keys` (None when absent or nil).
    first_extra: Option<Vec<String>>,
}

/// A zero-copy msgpack reader over a byte slice built on `rmp`'s low-level decoder.
struct Reader<'a> {
    rd: rmp::decode::Bytes<'a>,
}

type RmpBytesErr = rmp::decode::bytes::BytesReadError;

fn value_err(e: rmp::decode::ValueReadError<RmpBytesErr>) -> EventDecodeError {
    match e {
        rmp::decode::ValueReadError::TypeMismatch(m) => {
            EventDecodeError::Shape(format!("unexpected msgpack type {m:?}"))
        }
        other => EventDecodeError::Msgpack(format!("{other:?}")),
    }
}

fn marker_err(e: rmp::decode::MarkerReadError<RmpBytesErr>) -> EventDecodeError {
    EventDecodeError::Msgpack(format!("truncated input: {}", e.0))
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader {
            rd: rmp::decode::Bytes::new(buf),
        }
    }

    fn remaining(&self) -> usize {
        self.rd.remaining_slice().len()
    }

    /// Capacity to reserve for `n` declared elements: each takes at least one byte.
    fn bounded(&self, n: u32) -> usize {
        (n as usize).min(self.remaining())
    }

    fn peek(&self) -> Option<rmp::Marker> {
        self.rd
            .remaining_slice()
            .first()
            .map(|b| rmp::Marker::from_u8(*b))
    }

    fn marker(&mut self) -> Result<rmp::Marker, EventDecodeError> {
        rmp::decode::read_marker(&mut self.rd).map_err(marker_err)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], EventDecodeError> {
        let rest = self.rd.remaining_slice();
        if n > rest.len() {
            return Err(EventDecodeError::Msgpack(format!(
                "truncated input: need {n} bytes, {} left",
                rest.len()
            )));
        }
        let (head, tail) = rest.split_at(n);
        self.rd = rmp::decode::Bytes::new(tail);
        Ok(head)
    }

    fn array_len(&mut self) -> Result<u32, EventDecodeError> {
        rmp::decode::read_array_len(&mut self.rd).map_err(value_err)
    }

    /// Whether the next value is nil; consumes it if so.
    fn eat_nil(&mut self) -> bool {
        if matches!(self.peek(), Some(rmp::Marker::Null)) {
            let _ = self.take(1);
            true
        } else {
            false
        }
    }

    /// An integer of any msgpack width, as i128 so both u64 and i64 fit.
    fn int_any(&mut self) -> Result<i128, EventDecodeError> {
        use rmp::Marker as M;
        let m = self.marker()?;
        let v = match m {
            M::FixPos(v) => i128::from(v),
            M::FixNeg(v) => i128::from(v),
            M::U8 => i128::from(self.rd.read_data_u8().map_err(value_err)?),
            M::U16 => i128::from(self.rd.read_data_u16().map_err(value_err)?),
            M::U32 => i128::from(self.rd.read_data_u32().map_err(value_err)?),
            M::U64 => i128::from(self.rd.read_data_u64().map_err(value_err)?),
            M::I8 => i128::from(self.rd.read_data_i8().map_err(value_err)?),
            M::I16 => i128::from(self.rd.read_data_i16().map_err(value_err)?),
            M::I32 => i128::from(self.rd.read_data_i32().map_err(value_err)?),
            M::I64 => i128::from(self.rd.read_data_i64().map_err(value_err)?),
            other => return Err(shape(format!("expected an integer, got {other:?}"))),
        };
        Ok(v)
    }

    fn u32_field(&mut self, field: &str) -> Result<u32, EventDecodeError> {
        // The hot path (token ids): rmp's typed integer read, no widening.
        use rmp::decode::NumValueReadError as E;
        rmp::decode::read_int::<u32, _>(&mut self.rd).map_err(|e| match e {
            E::OutOfRange => shape(format!("{field} out of range for u32")),
            E::TypeMismatch(m) => shape(format!("{field}: expected an integer, got {m:?}")),
            other => EventDecodeError::Msgpack(format!("{field}: {other:?}")),
        })
    }

    fn opt_u32(&mut self, field: &str) -> Result<Option<u32>, EventDecodeError> {
        if self.eat_nil() {
            Ok(None)
        } else {
            self.u32_field(field).map(Some)
        }
    }

    fn opt_int(&mut self, field: &str) -> Result<Option<i64>, EventDecodeError> {
        if self.eat_nil() {
            return Ok(None);
        }
        let v = self.int_any()?;
        i64::try_from(v)
            .map(Some)
            .map_err(|_| shape(format!("{field} out of range: {v}")))
    }

    /// A float or integer timestamp.
    fn number(&mut self) -> Result<f64, EventDecodeError> {
        use rmp::Marker as M;
        match self.peek() {
            Some(M::F64) => {
                let _ = self.marker()?;
                self.rd.read_data_f64().map_err(value_err)
            }
            Some(M::F32) => {
                let _ = self.marker()?;
                self.rd.read_data_f32().map(f64::from).map_err(value_err)
            }
            Some(_) => self.int_any().map(|v| v as f64),
            None => Err(EventDecodeError::Msgpack(
                "truncated input: expected ts".into(),
            )),
        }
    }

    fn str_len(&mut self, m: rmp::Marker) -> Result<Option<usize>, EventDecodeError> {
        use rmp::Marker as M;
        Ok(Some(match m {
            M::FixStr(n) => usize::from(n),
            M::Str8 => usize::from(self.rd.read_data_u8().map_err(value_err)?),
            M::Str16 => usize::from(self.rd.read_data_u16().map_err(value_err)?),
            M::Str32 => self.rd.read_data_u32().map_err(value_err)? as usize,
            _ => return Ok(None),
        }))
    }

    fn str(&mut self, field: &str) -> Result<&'a str, EventDecodeError> {
        let m = self.marker()?;
        let Some(n) = self.str_len(m)? else {
            return Err(shape(format!("{field}: expected a string, got {m:?}")));
        };
        let raw = self.take(n)?;
        std::str::from_utf8(raw).map_err(|_| shape(format!("{field}: invalid utf-8")))
    }

    fn opt_str(&mut self, field: &str) -> Result<Option<&'a str>, EventDecodeError> {
        if self.eat_nil() {
            Ok(None)
        } else {
            self.str(field).map(Some)
        }
    }

    /// A block hash: an integer (vLLM's default) or raw digest bytes (last 8 bytes, big-endian).
    /// Negative integers (Python `hash()` of very old vLLM) keep their two's-complement bits.
    fn hash(&mut self) -> Result<BlockHash, EventDecodeError> {
        use rmp::Marker as M;
        match self.peek() {
            Some(M::Bin8 | M::Bin16 | M::Bin32) => {
                let m = self.marker()?;
                let n = match m {
                    M::Bin8 => usize::from(self.rd.read_data_u8().map_err(value_err)?),
                    M::Bin16 => usize::from(self.rd.read_data_u16().map_err(value_err)?),
                    _ => self.rd.read_data_u32().map_err(value_err)? as usize,
                };
                Ok(BlockHash(event_hash_from_bytes(self.take(n)?)))
            }
            Some(M::FixStr(_) | M::Str8 | M::Str16 | M::Str32) => {
                let m = self.marker()?;
                let n = self.str_len(m)?.unwrap_or(0);
                Ok(BlockHash(event_hash_from_bytes(self.take(n)?)))
            }
            _ => {
                let v = self.int_any()?;
                if let Ok(u) = u64::try_from(v) {
                    Ok(BlockHash(u))
                } else {
                    // In range of i64 by construction (int_any reads at most 64 bits).
                    Ok(BlockHash(v as i64 as u64))
                }
            }
        }
    }

    fn opt_hash(&mut self) -> Result<Option<BlockHash>, EventDecodeError> {
        if self.eat_nil() {
            Ok(None)
        } else {
            self.hash().map(Some)
        }
    }

    fn hashes(&mut self) -> Result<Vec<BlockHash>, EventDecodeError> {
        let n = self.array_len().map_err(|e| e.context("block_hashes"))?;
        let mut out = Vec::with_capacity(self.bounded(n));
        for _ in 0..n {
            out.push(self.hash().map_err(|e| e.context("block_hashes"))?);
        }
        Ok(out)
    }

    fn tokens(&mut self) -> Result<Vec<TokenId>, EventDecodeError> {
        if self.eat_nil() {
            return Ok(Vec::new());
        }
        let n = self.array_len().map_err(|e| e.context("token_ids"))?;
        let mut out = Vec::with_capacity(self.bounded(n));
        for _ in 0..n {
            out.push(self.u32_field("token_ids")?);
        }
        Ok(out)
    }

    fn medium(&mut self) -> Result<Option<Medium>, EventDecodeError> {
        Ok(self.opt_str("medium")?.map(Medium::parse))
    }

    /// Reads `extra_keys` (nil, or one entry per block) keeping only block 0's strings: that is
    /// where the salt is. Later blocks and non-string keys are skipped.
    fn first_extra_keys(&mut self) -> Result<Option<Vec<String>>, EventDecodeError> {
        if self.eat_nil() {
            return Ok(None);
        }
        let n = self.array_len()?;
        let mut first = None;
        for i in 0..n {
            if i == 0 && !self.eat_nil() {
                if matches!(
                    self.peek(),
                    Some(rmp::Marker::FixArray(_) | rmp::Marker::Array16 | rmp::Marker::Array32)
                ) {
                    let m = self.array_len()?;
                    let mut keys = Vec::new();
                    for _ in 0..m {
                        match self.peek() {
                            Some(
                                rmp::Marker::FixStr(_)
                                | rmp::Marker::Str8
                                | rmp::Marker::Str16
                                | rmp::Marker::Str32,
                            ) => keys.push(self.str("extra_keys")?.to_owned()),
                            _ => self.skip(1)?,
                        }
                    }
                    first = Some(keys);
                } else {
                    self.skip(1)?;
                }
            } else if i > 0 {
                self.skip(1)?;
            }
        }
        Ok(first)
    }

    /// Skips one value of any type; `depth` bounds recursion.
    fn skip(&mut self, depth: u32) -> Result<(), EventDecodeError> {
        use rmp::Marker as M;
        if depth > MAX_DEPTH {
            return Err(shape(format!("nesting deeper than {MAX_DEPTH}")));
        }
        let m = self.marker()?;
        let (fixed, count): (usize, u64) = match m {
            M::FixPos(_) | M::FixNeg(_) | M::Null | M::True | M::False => (0, 0),
            M::U8 | M::I8 => (1, 0),
            M::U16 | M::I16 => (2, 0),
            M::U32 | M::I32 | M::F32 => (4, 0),
            M::U64 | M::I64 | M::F64 => (8, 0),
            M::FixStr(n) => (usize::from(n), 0),
            M::Str8 | M::Bin8 => (usize::from(self.rd.read_data_u8().map_err(value_err)?), 0),
            M::Str16 | M::Bin16 => (usize::from(self.rd.read_data_u16().map_err(value_err)?), 0),
            M::Str32 | M::Bin32 => (self.rd.read_data_u32().map_err(value_err)? as usize, 0),
            M::FixExt1 => (2, 0),
            M::FixExt2 => (3, 0),
            M::FixExt4 => (5, 0),
            M::FixExt8 => (9, 0),
            M::FixExt16 => (17, 0),
            M::Ext8 => (
                usize::from(self.rd.read_data_u8().map_err(value_err)?) + 1,
                0,
            ),
            M::Ext16 => (
                usize::from(self.rd.read_data_u16().map_err(value_err)?) + 1,
                0,
            ),
            M::Ext32 => (self.rd.read_data_u32().map_err(value_err)? as usize + 1, 0),
            M::FixArray(n) => (0, u64::from(n)),
            M::Array16 => (0, u64::from(self.rd.read_data_u16().map_err(value_err)?)),
            M::Array32 => (0, u64::from(self.rd.read_data_u32().map_err(value_err)?)),
            M::FixMap(n) => (0, 2 * u64::from(n)),
            M::Map16 => (
                0,
                2 * u64::from(self.rd.read_data_u16().map_err(value_err)?),
            ),
            M::Map32 => (
                0,
                2 * u64::from(self.rd.read_data_u32().map_err(value_err)?),
            ),
            M::Reserved => return Err(EventDecodeError::Msgpack("reserved marker 0xc1".into())),
        };
        self.take(fixed)?;
        if count > self.remaining() as u64 {
            return Err(EventDecodeError::Msgpack(format!(
                "truncated input: {count} elements declared, {} bytes left",
                self.remaining()
            )));
        }
        for _ in 0..count {
            self.skip(depth + 1)?;
        }
        Ok(())
    }

    /// One event in either encoding.
    fn event(&mut self) -> Result<KvEvent, EventDecodeError> {
        use rmp::Marker as M;
        let m = self.marker()?;
        match m {
            M::FixMap(_) | M::Map16 | M::Map32 => {
                let n = rmp::decode::marker_to_len(&mut self.rd, m).map_err(value_err)?;
                self.event_map(n)
            }
            M::FixArray(_) | M::Array16 | M::Array32 => {
                let n = match m {
                    M::FixArray(n) => u32::from(n),
                    M::Array16 => u32::from(self.rd.read_data_u16().map_err(value_err)?),
                    _ => self.rd.read_data_u32().map_err(value_err)?,
                };
                self.event_array(n)
            }
            other => Err(shape(format!(
                "event must be a map or an array, got {other:?}"
            ))),
        }
    }

    fn event_map(&mut self, n: u32) -> Result<KvEvent, EventDecodeError> {
        let mut ty: Option<&'a str> = None;
        let mut f = EventFields::default();
        for _ in 0..n {
            let key = self.str("event key")?;
            match key {
                "type" => ty = Some(self.str("type")?),
                "block_hashes" => f.block_hashes = Some(self.hashes()?),
                "parent_block_hash" => f.parent_block_hash = self.opt_hash()?,
                "token_ids" => f.token_ids = Some(self.tokens()?),
                "block_size" => f.block_size = self.opt_u32("block_size")?,
                "lora_id" => f.lora_id = self.opt_int("lora_id")?,
                "medium" => f.medium = self.medium()?,
                "lora_name" => f.lora_name = self.opt_str("lora_name")?.map(str::to_owned),
                "group_idx" => f.group_idx = self.opt_u32("group_idx")?,
                "kv_cache_spec_kind" => {
                    f.kv_cache_spec_kind = self.opt_str("kv_cache_spec_kind")?.map(str::to_owned)
                }
                "extra_keys" => f.first_extra = self.first_extra_keys()?,
                "kv_cache_spec_sliding_window" => {
                    f.kv_cache_spec_sliding_window = self.opt_u32("kv_cache_spec_sliding_window")?
                }
                // locality, ownership, session_id and anything newer: not needed.
                _ => self.skip(1)?,
            }
        }
        let ty = ty.ok_or_else(|| shape("event map has no `type`"))?;
        build_event(ty, f)
    }

    fn event_array(&mut self, n: u32) -> Result<KvEvent, EventDecodeError> {
        if n == 0 {
            return Err(shape("empty event array"));
        }
        let ty = self.str("type")?;
        let mut f = EventFields::default();
        // Positional fields after the tag, per event type; absent trailing fields stay None.
        let mut read = 1u32;
        let mut next = || -> bool {
            if read < n {
                read += 1;
                true
            } else {
                false
            }
        };
        match ty {
            BLOCK_STORED => {
                if next() {
                    f.block_hashes = Some(self.hashes()?);
                }
                if next() {
                    f.parent_block_hash = self.opt_hash()?;
                }
                if next() {
                    f.token_ids = Some(self.tokens()?);
                }
                if next() {
                    f.block_size = self.opt_u32("block_size")?;
                }
                if next() {
                    f.lora_id = self.opt_int("lora_id")?;
                }
                if next() {
                    f.medium = self.medium()?;
                }
                if next() {
                    f.lora_name = self.opt_str("lora_name")?.map(str::to_owned);
                }
                if next() {
                    f.first_extra = self.first_extra_keys()?;
                }
                if next() {
                    f.group_idx = self.opt_u32("group_idx")?;
                }
                if next() {
                    f.kv_cache_spec_kind = self.opt_str("kv_cache_spec_kind")?.map(str::to_owned);
                }
                if next() {
                    f.kv_cache_spec_sliding_window =
                        self.opt_u32("kv_cache_spec_sliding_window")?;
                }
            }
            BLOCK_REMOVED => {
                if next() {
                    f.block_hashes = Some(self.hashes()?);
                }
                if next() {
                    f.medium = self.medium()?;
                }
                if next() {
                    f.group_idx = self.opt_u32("group_idx")?;
                }
            }
            _ => {}
        }
        while next() {
            self.skip(1)?;
        }
        build_event(ty, f)
    }
}

/// The salt in block 0's event extra keys: the last string after the LoRA name. vLLM's order is
/// LoRA name, multimodal `(identifier, offset)` pairs (arrays, skipped when reading), salt, then
/// prompt-embeds digests. Were such a digest a string in a request without salt, it would be read
/// as a salt: that only puts the blocks in a key space no request matches, never in another
/// tenant's.
fn salt_from_extra_keys(lora: Option<&str>, first: Option<Vec<String>>) -> Option<String> {
    let mut keys = first?;
    let lora_part = usize::from(lora.is_some());
    if keys.len() <= lora_part {
        return None;
    }
    keys.pop().filter(|s| !s.is_empty())
}

fn build_event(ty: &str, f: EventFields) -> Result<KvEvent, EventDecodeError> {
    match ty {
        BLOCK_STORED => Ok(KvEvent::BlockStored(BlockStored {
            cache_salt: salt_from_extra_keys(f.lora_name.as_deref(), f.first_extra),
            block_hashes: f
                .block_hashes
                .ok_or_else(|| shape("BlockStored without block_hashes"))?,
            parent_block_hash: f.parent_block_hash,
            token_ids: f.token_ids.unwrap_or_default(),
            block_size: f.block_size.unwrap_or(0),
            lora_id: f.lora_id,
            medium: f.medium.unwrap_or(Medium::Gpu),
            lora_name: f.lora_name,
            group_idx: f.group_idx,
            kv_cache_spec_kind: f.kv_cache_spec_kind,
            kv_cache_spec_sliding_window: f.kv_cache_spec_sliding_window,
        })),
        BLOCK_REMOVED => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: f
                .block_hashes
                .ok_or_else(|| shape("BlockRemoved without block_hashes"))?,
            medium: f.medium.unwrap_or(Medium::Gpu),
            group_idx: f.group_idx,
        })),
        ALL_BLOCKS_CLEARED => Ok(KvEvent::AllBlocksCleared),
        other => Err(EventDecodeError::UnknownType(other.to_owned())),
    }
}
