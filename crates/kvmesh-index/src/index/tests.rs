use kvmesh_core::chain::chain_keys;
use kvmesh_core::events::{BlockRemoved, BlockStored, Medium};

use super::*;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: Medium) -> KvEvent {
    let bs = if hashes.is_empty() {
        0
    } else {
        tokens.len() / hashes.len()
    };
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| BlockHash(*h)).collect(),
        parent_block_hash: parent.map(BlockHash),
        token_ids: tokens.to_vec(),
        block_size: bs as u32,
        lora_id: None,
        medium,
        lora_name: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        cache_salt: None,
    })
}

fn removed(hashes: &[u64], medium: Medium) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| BlockHash(*h)).collect(),
        medium,
        group_idx: None,
    })
}

fn idx(bs: usize) -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        block_size: bs,
        ..IndexConfig::default()
    })
}

fn one(m: &[EndpointMatch], e: u32) -> (usize, usize, usize) {
    m.iter()
        .find(|x| x.endpoint == EndpointId(e))
        .map_or((0, 0, 0), |x| (x.gpu_blocks, x.cpu_blocks, x.any_blocks))
}

#[test]
fn stores_removals_and_tiers() {
    let index = idx(4);
    let tokens: Vec<u32> = (0..16).collect();
    let keys = chain_keys(&tokens, 4);
    index
        .apply_event(
            EndpointId(1),
            &stored(&[10, 11], None, &tokens[..8], Medium::Gpu),
        )
        .unwrap();
    index
        .apply_event(
            EndpointId(1),
            &stored(&[12, 13], Some(11), &tokens[8..], Medium::Gpu),
        )
        .unwrap();
    index
        .apply_event(
            EndpointId(2),
            &stored(&[20], None, &tokens[..4], Medium::Gpu),
        )
        .unwrap();
    // CPU copies of the first three blocks, carried without tokens.
    index
        .apply_event(
            EndpointId(1),
            &stored(&[10, 11, 12], None, &[], Medium::Cpu),
        )
        .unwrap();
    let m = index.find_matches(&keys);
    assert_eq!(one(&m, 1), (4, 3, 4));
    assert_eq!(one(&m, 2), (1, 0, 1));
    // GPU loses block 2 (index 1): GPU run 1, CPU still 3, any 4.
    index
        .apply_event(EndpointId(1), &removed(&[11], Medium::Gpu))
        .unwrap();
    let m = index.find_matches(&keys);
    assert_eq!(one(&m, 1), (1, 3, 4));
    index
        .apply_event(EndpointId(1), &removed(&[11], Medium::Cpu))
        .unwrap();
    assert_eq!(one(&index.find_matches(&keys), 1), (1, 1, 1));
    // The engine hash 11 is forgotten once no tier holds it: a CPU store of it cannot resolve.
    let err = index
        .apply_event(EndpointId(1), &stored(&[11], None, &[], Medium::Cpu))
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::UnresolvedHashes {
            unresolved: 1,
            total: 1
        }
    );
    index
        .apply_event(EndpointId(1), &KvEvent::AllBlocksCleared)
        .unwrap();
    assert_eq!(one(&index.find_matches(&keys), 1), (0, 0, 0));
    assert_eq!(one(&index.find_matches(&keys), 2), (1, 0, 1));
    let s = index.stats();
    assert_eq!((s.blocks, s.memberships), (1, 1));
}

#[test]
fn orphans_are_skipped_and_counted() {
    let index = idx(4);
    let tokens: Vec<u32> = (0..8).collect();
    let err = index.apply_event(
        EndpointId(1),
        &stored(&[2], Some(1), &tokens[4..], Medium::Gpu),
    );
    assert!(matches!(err, Err(IndexError::UnknownParent { .. })));
    assert_eq!(index.stats().orphan_events, 1);
    assert_eq!(index.stats().blocks, 0);
}

#[test]
fn engine_blocks_larger_than_router_blocks_split() {
    let index = idx(4);
    let tokens: Vec<u32> = (100..132).collect();
    let keys = chain_keys(&tokens, 4);
    index
        .apply_event(
            EndpointId(3),
            &stored(&[1, 2], None, &tokens[..32], Medium::Gpu),
        )
        .unwrap();
    assert_eq!(one(&index.find_matches(&keys), 3), (8, 0, 8));
    // Prompt ending mid engine block still matches the router blocks it covers.
    assert_eq!(one(&index.find_matches(&keys[..5]), 3), (5, 0, 5));
    index
        .apply_event(EndpointId(3), &stored(&[2], None, &[], Medium::Cpu))
        .unwrap();
    index
        .apply_event(EndpointId(3), &removed(&[1], Medium::Gpu))
        .unwrap();
    assert_eq!(one(&index.find_matches(&keys), 3), (0, 0, 0));
    assert_eq!(
        index.stats().memberships,
        8,
        "engine block 2 stays in GPU and CPU"
    );
    let err = index.apply_event(
        EndpointId(3),
        &stored(&[9], None, &tokens[..6], Medium::Gpu),
    );
    assert_eq!(
        err,
        Err(IndexError::BlockSizeMismatch {
            engine: 6,
            router: 4
        })
    );
}

#[test]
fn storage_lora_and_other_groups_are_ignored() {
    let index = idx(4);
    let tokens: Vec<u32> = (0..4).collect();
    index
        .apply_event(EndpointId(1), &stored(&[1], None, &tokens, Medium::Storage))
        .unwrap();
    let KvEvent::BlockStored(mut ev) = stored(&[1], None, &tokens, Medium::Gpu) else {
        unreachable!()
    };
    ev.group_idx = Some(1);
    index
        .apply_event(EndpointId(1), &KvEvent::BlockStored(ev.clone()))
        .unwrap();
    ev.group_idx = None;
    ev.lora_id = Some(3);
    index
        .apply_event(EndpointId(1), &KvEvent::BlockStored(ev))
        .unwrap();
    assert!(index.find_matches(&chain_keys(&tokens, 4)).is_empty());
    assert_eq!(index.stats().ignored_events, 3);
}

#[test]
fn many_endpoints_spill_beyond_64_slots_and_slots_are_reused() {
    let index = idx(4);
    let tokens: Vec<u32> = (0..12).collect();
    let keys = chain_keys(&tokens, 4);
    for e in 0..150u32 {
        let n = (e % 3 + 1) as usize;
        let hashes: Vec<u64> = (0..n as u64).collect();
        index
            .apply_event(
                EndpointId(e),
                &stored(&hashes, None, &tokens[..n * 4], Medium::Gpu),
            )
            .unwrap();
    }
    let m = index.find_matches(&keys);
    assert_eq!(m.len(), 150);
    for x in &m {
        let n = (x.endpoint.0 % 3 + 1) as usize;
        assert_eq!(
            (x.gpu_blocks, x.cpu_blocks, x.any_blocks),
            (n, 0, n),
            "{x:?}"
        );
    }
    index.remove_endpoint(EndpointId(140));
    assert_eq!(index.find_matches(&keys).len(), 149);
    index
        .apply_event(
            EndpointId(999),
            &stored(&[0], None, &tokens[..4], Medium::Cpu),
        )
        .unwrap();
    let m = index.find_matches(&keys);
    assert_eq!(one(&m, 999), (0, 1, 1));
    assert_eq!(one(&m, 140), (0, 0, 0));
    assert_eq!(index.endpoints().len(), 150);
}

#[test]
fn max_blocks_bounds_the_table_and_evicts_oldest() {
    let index = PrefixIndex::new(IndexConfig {
        block_size: 1,
        max_blocks: 1024,
        shards: 4,
        max_endpoints: 8,
    });
    let hot: Vec<u32> = vec![7, 7, 7];
    let hot_keys = chain_keys(&hot, 1);
    index
        .apply_event(EndpointId(0), &stored(&[1, 2, 3], None, &hot, Medium::Gpu))
        .unwrap();
    for i in 0..20_000u32 {
        index
            .apply_event(
                EndpointId(0),
                &stored(&[100 + u64::from(i)], None, &[1000 + i], Medium::Gpu),
            )
            .unwrap();
        // Keep the hot prefix recently used.
        if i % 64 == 0 {
            assert_eq!(
                one(&index.find_matches(&hot_keys), 0),
                (3, 0, 3),
                "hot prefix kept at {i}"
            );
        }
    }
    let s = index.stats();
    assert!(s.blocks <= 1024, "{s:?}");
    assert!(s.evictions >= 20_000 - 1024, "{s:?}");
    assert_eq!(s.memberships, s.blocks);
}

#[test]
fn lookup_of_unknown_or_empty_is_empty() {
    let index = idx(4);
    assert!(index.find_matches(&[]).is_empty());
    assert!(index.find_matches(&[ChainKey(5)]).is_empty());
}

/// Issue 37: a publisher announcing a hundred times the index's bound on one endpoint evicts only
/// that endpoint's blocks; the honest endpoint keeps every block.
#[test]
fn one_endpoints_flood_evicts_only_its_own_blocks() {
    let index = PrefixIndex::new(IndexConfig {
        block_size: 4,
        max_blocks: 1000,
        shards: 4,
        max_endpoints: 8,
    });
    let honest: Vec<u32> = (0..400).collect();
    let hashes: Vec<u64> = (1..=100).collect();
    index
        .apply_event(EndpointId(0), &stored(&hashes, None, &honest, Medium::Gpu))
        .unwrap();
    for e in 0..1000u32 {
        let tokens: Vec<u32> = (0..400).map(|i| 1_000_000 + e * 400 + i).collect();
        let hashes: Vec<u64> = (0..100)
            .map(|i| 1_000_000 + u64::from(e) * 100 + i)
            .collect();
        index
            .apply_event(EndpointId(1), &stored(&hashes, None, &tokens, Medium::Gpu))
            .unwrap();
    }
    assert_eq!(
        one(&index.find_matches(&chain_keys(&honest, 4)), 0),
        (100, 0, 100)
    );
    assert!(index.held_blocks(EndpointId(1)) <= 500);
    let s = index.stats();
    assert!(s.blocks <= 1000, "{s:?}");
    assert!(s.share_evictions >= 100_000 - 500, "{s:?}");
}

/// An endpoint that registers after another filled the whole index gets its share: the largest
/// holder pays for its stores.
#[test]
fn a_newcomer_gets_its_share_from_the_largest_holder() {
    let index = PrefixIndex::new(IndexConfig {
        block_size: 1,
        max_blocks: 100,
        shards: 1,
        max_endpoints: 8,
    });
    let first: Vec<u32> = (0..100).collect();
    let hashes: Vec<u64> = (0..100).collect();
    index
        .apply_event(EndpointId(1), &stored(&hashes, None, &first, Medium::Gpu))
        .unwrap();
    assert_eq!(index.held_blocks(EndpointId(1)), 100);
    let late: Vec<u32> = (1000..1050).collect();
    let hashes: Vec<u64> = (1000..1050).collect();
    index
        .apply_event(EndpointId(2), &stored(&hashes, None, &late, Medium::Gpu))
        .unwrap();
    assert_eq!(
        one(&index.find_matches(&chain_keys(&late, 1)), 2),
        (50, 0, 50)
    );
    assert_eq!(index.held_blocks(EndpointId(1)), 50);
    assert_eq!(index.stats().blocks, 100);
}

/// The eviction order is least recently used: a prefix looked up keeps its blocks while an
/// endpoint churns through its own share.
#[test]
fn an_endpoints_own_eviction_spares_what_lookups_use() {
    let index = PrefixIndex::new(IndexConfig {
        block_size: 1,
        max_blocks: 64,
        shards: 1,
        max_endpoints: 8,
    });
    let hot: Vec<u32> = vec![9, 9, 9, 9];
    index
        .apply_event(
            EndpointId(0),
            &stored(&[1, 2, 3, 4], None, &hot, Medium::Gpu),
        )
        .unwrap();
    for i in 0..5_000u32 {
        index
            .apply_event(
                EndpointId(0),
                &stored(&[100 + u64::from(i)], None, &[1000 + i], Medium::Gpu),
            )
            .unwrap();
        if i % 8 == 0 {
            assert_eq!(
                one(&index.find_matches(&chain_keys(&hot, 1)), 0),
                (4, 0, 4),
                "hot prefix kept at {i}"
            );
        }
    }
    assert!(index.held_blocks(EndpointId(0)) <= 64);
}

#[test]
fn salted_and_lora_runs_are_found_only_by_their_own_tenant() {
    use kvmesh_core::chain::chain_keys_from;
    let index = idx(4);
    let tokens: Vec<u32> = (0..8).collect();
    // Endpoint 1 holds the prompt for tenant-a (salt in block 0, block 1 chained from it).
    let KvEvent::BlockStored(first) = stored(&[1], None, &tokens[..4], Medium::Gpu) else {
        unreachable!()
    };
    let salted = KvEvent::BlockStored(first.with_cache_salt(Some("tenant-a")));
    index.apply_event(EndpointId(1), &salted).unwrap();
    index
        .apply_event(
            EndpointId(1),
            &stored(&[2], Some(1), &tokens[4..], Medium::Gpu),
        )
        .unwrap();
    // Endpoint 2 holds it for LoRA adapter "ad".
    let KvEvent::BlockStored(mut lora) = stored(&[7, 8], None, &tokens, Medium::Gpu) else {
        unreachable!()
    };
    lora.lora_id = Some(1);
    lora.lora_name = Some("ad".into());
    index
        .apply_event(EndpointId(2), &KvEvent::BlockStored(lora))
        .unwrap();

    let only = |root| {
        index
            .find_matches(&chain_keys_from(root, &tokens, 4))
            .into_iter()
            .map(|m| (m.endpoint, m.gpu_blocks))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        only(ChainKey::tenant_root(None, Some("tenant-a"))),
        vec![(EndpointId(1), 2)]
    );
    assert_eq!(
        only(ChainKey::tenant_root(Some("ad"), None)),
        vec![(EndpointId(2), 2)]
    );
    assert!(
        only(ChainKey::ROOT).is_empty(),
        "unsalted base requests match neither"
    );
    assert!(only(ChainKey::tenant_root(None, Some("tenant-b"))).is_empty());
    assert!(only(ChainKey::tenant_root(Some("ad"), Some("tenant-a"))).is_empty());
    assert!(index.find_matches(&chain_keys(&tokens, 4)).is_empty());
}
