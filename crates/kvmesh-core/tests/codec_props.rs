//! Property and edge-case tests of the KV-event codec: round trips in both encodings, the shapes
//! older/newer vLLM versions send, and hostile input that must fail cleanly instead of panicking.
#![allow(clippy::unwrap_used)]

use kvmesh_core::events::{
    BlockRemoved, BlockStored, DecodeStats, EventBatch, EventDecodeError, EventEncoding, KvEvent,
    Medium, decode_batch, decode_batch_with_stats, encode_batch,
};
use kvmesh_core::hashing::BlockHash;
use proptest::prelude::*;
use rmpv::Value;

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![
        Just(Medium::Gpu),
        Just(Medium::Cpu),
        Just(Medium::Storage),
        "[A-Z_]{1,8}".prop_filter_map("not a known tier", |s| match Medium::parse(&s) {
            m @ Medium::Other(_) => Some(m),
            _ => None,
        }),
    ]
}

fn event() -> impl Strategy<Value = KvEvent> {
    let stored = (
        prop::collection::vec(any::<u64>(), 0..6),
        prop::option::of(any::<u64>()),
        prop::collection::vec(any::<u32>(), 0..40),
        any::<u32>(),
        prop::option::of(any::<i64>()),
        medium(),
        prop::option::of("[a-z0-9-]{0,12}"),
        prop::option::of(any::<u32>()),
        prop::option::of(prop_oneof![
            Just("full_attention".to_owned()),
            "[a-z_]{1,20}"
        ]),
        prop::option::of("[a-z0-9-]{1,12}"),
        prop::option::of(any::<u32>()),
    )
        .prop_map(
            |(h, p, t, bs, lora, medium, lname, g, kind, salt, window)| {
                // The salt travels in block 0's extra keys, so only a run with blocks carries one.
                let cache_salt = if h.is_empty() { None } else { salt };
                KvEvent::BlockStored(BlockStored {
                    block_hashes: h.into_iter().map(BlockHash).collect(),
                    parent_block_hash: p.map(BlockHash),
                    token_ids: t,
                    block_size: bs,
                    lora_id: lora,
                    medium,
                    lora_name: lname,
                    group_idx: g,
                    kv_cache_spec_kind: kind,
                    kv_cache_spec_sliding_window: window,
                    cache_salt,
                })
            },
        );
    let removed = (
        prop::collection::vec(any::<u64>(), 0..6),
        medium(),
        prop::option::of(any::<u32>()),
    )
        .prop_map(|(h, medium, g)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: h.into_iter().map(BlockHash).collect(),
                medium,
                group_idx: g,
            })
        });
    prop_oneof![4 => stored, 4 => removed, 1 => Just(KvEvent::AllBlocksCleared)]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        -1e12f64..1e12f64,
        prop::collection::vec(event(), 0..8),
        prop::option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, dp)| EventBatch {
            ts,
            events,
            data_parallel_rank: dp,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn map_encoding_round_trips(b in batch()) {
        prop_assert_eq!(decode_batch(&encode_batch(&b, EventEncoding::Map)).unwrap(), b);
    }

    #[test]
    fn array_encoding_round_trips(b in batch()) {
        prop_assert_eq!(decode_batch(&encode_batch(&b, EventEncoding::Array)).unwrap(), b);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn corrupted_valid_payloads_never_panic(
        b in batch(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = encode_batch(&b, EventEncoding::Map);
        for (i, v) in flips {
            let i = i.index(bytes.len());
            bytes[i] = v;
        }
        let _ = decode_batch(&bytes);
        let _ = decode_batch(&bytes[..cut.index(bytes.len() + 1)]);
    }
}

fn pack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn batch_of(events: Vec<Value>) -> Vec<u8> {
    pack(&Value::Array(vec![
        Value::F64(1.5),
        Value::Array(events),
        Value::Nil,
    ]))
}

fn only_event(bytes: &[u8]) -> KvEvent {
    let mut b = decode_batch(bytes).unwrap();
    assert_eq!(b.events.len(), 1);
    b.events.remove(0)
}

#[test]
fn hashes_as_raw_digest_bytes_use_the_last_eight_bytes_big_endian() {
    let digest: Vec<u8> = (0u8..32).collect();
    let ev = Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), Value::Array(vec![Value::Binary(digest)])),
        (s("medium"), s("gpu")),
    ]);
    let KvEvent::BlockRemoved(e) = only_event(&batch_of(vec![ev])) else {
        panic!()
    };
    assert_eq!(e.block_hashes, vec![BlockHash(0x18191a1b1c1d1e1f)]);
    assert_eq!(e.medium, Medium::Gpu, "case-insensitive medium");
    assert_eq!(e.group_idx, None, "absent field");
}

#[test]
fn uint64_hashes_above_i64_max_survive() {
    let ev = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(u64::MAX), Value::from(1u64 << 63)]),
        Value::Nil,
        Value::Array(vec![]),
        Value::from(0),
        Value::Nil,
        Value::Nil,
    ]);
    let KvEvent::BlockStored(e) = only_event(&batch_of(vec![ev])) else {
        panic!()
    };
    assert_eq!(
        e.block_hashes,
        vec![BlockHash(u64::MAX), BlockHash(1 << 63)]
    );
    assert_eq!(e.medium, Medium::Gpu, "nil medium means GPU");
    assert_eq!(e.lora_name, None, "absent trailing field");
}

#[test]
fn oldest_array_form_without_trailing_fields_decodes() {
    // vLLM 0.8-era: ["BlockStored", hashes, parent, tokens, block_size, lora_id]
    let ev = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(7)]),
        Value::from(3),
        Value::Array((0..4).map(Value::from).collect()),
        Value::from(4),
        Value::Nil,
    ]);
    let rem = Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(7)])]);
    let clr = Value::Array(vec![s("AllBlocksCleared")]);
    // Two-element batch: no dp rank.
    let bytes = pack(&Value::Array(vec![
        Value::from(12),
        Value::Array(vec![ev, rem, clr]),
    ]));
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.ts, 12.0, "integer timestamps are accepted");
    assert_eq!(b.data_parallel_rank, None);
    assert_eq!(b.events.len(), 3);
    let KvEvent::BlockStored(e) = &b.events[0] else {
        panic!()
    };
    assert_eq!(e.parent_block_hash, Some(BlockHash(3)));
    assert_eq!(e.token_ids, vec![0, 1, 2, 3]);
    assert_eq!(b.events[2], KvEvent::AllBlocksCleared);
}

/// One gemma3 `BlockStored` of a sliding-window group as vLLM 0.32 publishes it with HMA on
/// (docs/notes-vllm-models.md §4), in the map form, fields in vLLM's order.
fn vllm_032_sliding_store_map() -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(vec![Value::from(77u64), Value::from(88u64)]),
        ),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array((0..288).map(Value::from).collect()),
        ),
        (s("block_size"), Value::from(32)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (s("extra_keys"), Value::Array(vec![Value::Nil, Value::Nil])),
        (s("group_idx"), Value::from(1)),
        (s("kv_cache_spec_kind"), s("sliding_window")),
        (s("kv_cache_spec_sliding_window"), Value::from(64)),
        (s("locality"), Value::Nil),
        (s("ownership"), Value::Nil),
        (s("session_id"), Value::Nil),
    ])
}

#[test]
fn hma_group_fields_of_vllm_032_decode_in_both_forms() {
    let map = vllm_032_sliding_store_map();
    // The array form carries the same fields positionally, after the tag.
    let array = Value::Array(
        map.as_map()
            .unwrap()
            .iter()
            .map(|(_, v)| v.clone())
            .collect(),
    );
    let removed = Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), Value::Array(vec![Value::from(77u64)])),
        (s("medium"), s("GPU")),
        (s("group_idx"), Value::from(2)),
        (s("locality"), Value::Nil),
        (s("ownership"), Value::Nil),
    ]);
    for form in [map, array] {
        let b = decode_batch(&batch_of(vec![form, removed.clone()])).unwrap();
        let KvEvent::BlockStored(e) = &b.events[0] else {
            panic!()
        };
        assert_eq!(e.block_hashes, vec![BlockHash(77), BlockHash(88)]);
        assert_eq!(e.token_ids.len(), 288, "the range, not the kept blocks");
        assert_eq!(e.group_idx, Some(1));
        assert_eq!(e.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
        assert_eq!(e.kv_cache_spec_sliding_window, Some(64));
        let KvEvent::BlockRemoved(r) = &b.events[1] else {
            panic!()
        };
        assert_eq!(r.group_idx, Some(2));
        // Re-encoding keeps the group fields in either of kvmesh's encodings.
        for enc in [EventEncoding::Map, EventEncoding::Array] {
            assert_eq!(decode_batch(&encode_batch(&b, enc)).unwrap(), b);
        }
    }
}

#[test]
fn a_full_attention_store_has_no_window_and_encodes_without_one() {
    let mut fields = vllm_032_sliding_store_map().as_map().unwrap().clone();
    for (k, v) in fields.iter_mut() {
        match k.as_str().unwrap() {
            "kv_cache_spec_kind" => *v = s("full_attention"),
            "kv_cache_spec_sliding_window" => *v = Value::Nil,
            _ => {}
        }
    }
    let b = decode_batch(&batch_of(vec![Value::Map(fields)])).unwrap();
    let KvEvent::BlockStored(e) = &b.events[0] else {
        panic!()
    };
    assert_eq!(e.kv_cache_spec_sliding_window, None);
    // An unset window is not written, as vLLM before 0.32 did not write it.
    let bytes = encode_batch(&b, EventEncoding::Map);
    let v = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
    let keys: Vec<&str> = v[1][0]
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), 11);
    assert!(!keys.contains(&"kv_cache_spec_sliding_window"));
}

#[test]
fn unknown_map_keys_and_key_order_do_not_matter() {
    let ev = Value::Map(vec![
        (
            s("future_field"),
            Value::Map(vec![(s("nested"), Value::Array(vec![Value::Nil; 3]))]),
        ),
        (s("medium"), s("Cpu")),
        (
            s("block_hashes"),
            Value::Array(vec![Value::from(1), Value::from(2)]),
        ),
        (s("kv_cache_spec_sliding_window"), Value::from(4096)),
        (s("type"), s("BlockStored")),
        (s("block_size"), Value::from(0)),
        (s("token_ids"), Value::Array(vec![])),
        (
            s("extra_keys"),
            Value::Array(vec![Value::Array(vec![s("lora"), s("x")]), Value::Nil]),
        ),
    ]);
    let KvEvent::BlockStored(e) = only_event(&batch_of(vec![ev])) else {
        panic!()
    };
    assert_eq!(e.medium, Medium::Cpu);
    assert_eq!(e.block_hashes, vec![BlockHash(1), BlockHash(2)]);
    assert!(e.token_ids.is_empty());
    assert_eq!(e.kv_cache_spec_sliding_window, Some(4096));
}

#[test]
fn unknown_event_types_are_skipped_and_counted() {
    let known = Value::Map(vec![(s("type"), s("AllBlocksCleared"))]);
    let unknown = Value::Map(vec![
        (s("type"), s("BlockPinned")),
        (s("x"), Value::from(1)),
    ]);
    let mut stats = DecodeStats::default();
    let b = decode_batch_with_stats(&batch_of(vec![unknown, known]), &mut stats).unwrap();
    assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
    assert_eq!(stats.unknown_events, 1);
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let cases: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xc1],
        pack(&Value::from(5)),
        pack(&Value::Array(vec![Value::F64(1.0)])),
        batch_of(vec![Value::from(3)]),
        batch_of(vec![Value::Map(vec![(
            s("block_hashes"),
            Value::Array(vec![]),
        )])]),
        batch_of(vec![Value::Map(vec![(s("type"), s("BlockStored"))])]),
        batch_of(vec![Value::Array(vec![])]),
        batch_of(vec![Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::Boolean(true)]),
        ])]),
        batch_of(vec![Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![])),
            (s("token_ids"), Value::Array(vec![Value::from(-1)])),
        ])]),
    ];
    for c in cases {
        assert!(decode_batch(&c).is_err(), "{c:02x?}");
    }
}

#[test]
fn forged_huge_lengths_fail_fast_without_allocating() {
    // [1.0, array32(4_294_967_295) ...nothing]
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(
        decode_batch(&p),
        Err(EventDecodeError::Msgpack(_))
    ));
    // A map32 of 4 billion entries inside an event's unknown key.
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.extend_from_slice(&[0x91, 0x81, 0xa1, b'z', 0xdf, 0xff, 0xff, 0xff, 0xff]);
    assert!(decode_batch(&p).is_err());
    // str32 claiming 4 GB.
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.extend_from_slice(&[0x91, 0x81, 0xdb, 0xff, 0xff, 0xff, 0xff]);
    assert!(decode_batch(&p).is_err());
}

#[test]
fn deep_nesting_is_refused() {
    let mut v = Value::Nil;
    for _ in 0..200 {
        v = Value::Array(vec![v]);
    }
    let ev = Value::Map(vec![(s("type"), s("AllBlocksCleared")), (s("deep"), v)]);
    assert!(matches!(
        decode_batch(&batch_of(vec![ev])),
        Err(EventDecodeError::Shape(_))
    ));
}

#[test]
fn map_encoding_has_vllm_field_order() {
    let b = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash(1)],
            medium: Medium::Gpu,
            group_idx: Some(0),
        })],
        data_parallel_rank: None,
    };
    let bytes = encode_batch(&b, EventEncoding::Map);
    let v = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
    let ev = &v[1][0];
    let keys: Vec<&str> = ev
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect();
    assert_eq!(keys, ["type", "block_hashes", "medium", "group_idx"]);
    assert_eq!(v[2], Value::Nil);
}

#[test]
fn frames_parse_three_parts_and_name_what_is_wrong() {
    use kvmesh_core::events::EventFrame;
    let payload = encode_batch(
        &EventBatch {
            ts: 1.0,
            events: vec![KvEvent::AllBlocksCleared],
            data_parallel_rank: Some(0),
        },
        EventEncoding::Map,
    );
    let ok =
        EventFrame::from_parts(&[b"kv".to_vec(), 7u64.to_be_bytes().to_vec(), payload.clone()])
            .unwrap();
    assert_eq!((ok.topic.as_str(), ok.seq), ("kv", 7));
    assert_eq!(ok.decode().unwrap().events, vec![KvEvent::AllBlocksCleared]);
    let again = EventFrame::from_owned_parts(ok.to_parts().to_vec()).unwrap();
    assert_eq!(again, ok);

    let two = EventFrame::from_parts(&[b"kv".to_vec(), payload.clone()]).unwrap_err();
    assert!(two.to_string().contains("got 2"), "{two}");
    let short = EventFrame::from_parts(&[b"kv".to_vec(), vec![0; 7], payload.clone()]).unwrap_err();
    assert!(short.to_string().contains("8 bytes"), "{short}");
    let topic = EventFrame::from_parts(&[vec![0xff, 0xfe], vec![0; 8], payload]).unwrap_err();
    assert!(topic.to_string().contains("utf-8"), "{topic}");
}

/// vLLM publishes a salted or LoRA run's `extra_keys` untagged (`[salt]`, `[name]`,
/// `[name, salt]` in block 0, `[name]` after): for every case vLLM's hasher recorded in
/// `hash_extra_keys.json`, the decoder finds the case's salt, and re-encoding gives vLLM's form.
#[test]
fn cache_salt_is_read_from_vllms_event_extra_keys() {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm/hash_extra_keys.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    fn to_value(j: &serde_json::Value) -> Value {
        match j {
            serde_json::Value::Null => Value::Nil,
            serde_json::Value::String(x) => s(x),
            serde_json::Value::Array(a) => Value::Array(a.iter().map(to_value).collect()),
            other => panic!("unexpected extra key {other}"),
        }
    }
    for case in golden["cases"].as_array().unwrap() {
        let blocks = case["blocks"].as_array().unwrap();
        let lora_name = case["lora"]["name"].as_str();
        let extra = &case["event_extra_keys"];
        let ev = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(
                    blocks
                        .iter()
                        .map(|b| Value::from(b["u64"].as_u64().unwrap()))
                        .collect(),
                ),
            ),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(0)),
            (
                s("lora_id"),
                if lora_name.is_some() {
                    Value::from(1)
                } else {
                    Value::Nil
                },
            ),
            (s("medium"), s("GPU")),
            (s("lora_name"), lora_name.map_or(Value::Nil, s)),
            (s("extra_keys"), to_value(extra)),
        ]);
        let bytes = batch_of(vec![ev]);
        let KvEvent::BlockStored(e) = only_event(&bytes) else {
            panic!()
        };
        assert_eq!(
            e.cache_salt.as_deref(),
            case["cache_salt"].as_str(),
            "{} salt",
            case["name"]
        );
        // Our encoder writes the same extra keys vLLM does.
        let enc = encode_batch(
            &EventBatch {
                ts: 0.0,
                events: vec![KvEvent::BlockStored(e)],
                data_parallel_rank: None,
            },
            EventEncoding::Map,
        );
        let v = rmpv::decode::read_value(&mut enc.as_slice()).unwrap();
        let ev = &v[1][0];
        let Value::Map(fields) = ev else { panic!() };
        let got = fields
            .iter()
            .find(|(k, _)| k.as_str() == Some("extra_keys"))
            .unwrap();
        assert_eq!(got.1, to_value(extra), "{} re-encoded", case["name"]);
    }
}
