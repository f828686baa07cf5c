//! vLLM's hybrid KV cache groups (HMA) as the index sees them: what a group is, how an endpoint's
//! group layout is learned from its events, and vLLM's prefix-hit rule over the groups.
//!
//! With HMA on, vLLM 0.32 keeps one KV-cache group per attention type and layer set (gemma3:
//! sliding(64), sliding(64), full; gpt-oss: sliding(128), full; Qwen3-Next: mamba ×3, full) and
//! publishes every group's stores separately (`group_idx`, `kv_cache_spec_kind`,
//! `kv_cache_spec_sliding_window`). A prefix of `k` blocks is a hit only when every
//! full-attention group holds blocks `0..k`, every sliding-window group the last
//! `need = cdiv(window − 1, block_size)` of them, and every mamba group the state at block `k − 1`
//! (docs/notes-vllm-models.md §5). [`hybrid_hit`] is that rule; it is a pure function so the fast
//! index and the reference model share nothing but it and the event classification.

use kvmesh_core::ChainKey;
use kvmesh_core::events::{BlockRemoved, BlockStored};

/// Groups an endpoint may have: group membership is a `u64` bit set per tier.
pub(crate) const MAX_GROUPS: usize = 64;

/// How a group takes part in a prefix hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum GroupKind {
    /// Every block of the prefix (vLLM's full attention, MLA, attention with sinks).
    Full,
    /// The last `cdiv(window − 1, block_size)` blocks before the hit's end.
    Sliding { window: u32 },
    /// The state block at the hit's last block.
    Mamba,
}

impl GroupKind {
    /// The kind of a `kv_cache_spec_kind`, or `None` for kinds whose hit rule the index does not
    /// model (chunked local attention, encoder-only, cross attention, unknown): their events are
    /// ignored, and such groups take no part in the prediction.
    fn parse(kind: &str, window: Option<u32>) -> Option<GroupKind> {
        match kind {
            "full_attention" | "mla_attention" | "sink_full_attention" => Some(GroupKind::Full),
            // Without its window the rule cannot be applied; a window of 0 is not a window.
            "sliding_window" | "sliding_window_mla" => window
                .filter(|w| *w > 0)
                .map(|window| GroupKind::Sliding { window }),
            "mamba" => Some(GroupKind::Mamba),
            _ => None,
        }
    }
}

/// What a stored event says about its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreGroup {
    /// No group information (kvmesh's own engines before groups, older vLLM): the event belongs
    /// to the endpoint's one and only group, as before HMA.
    Ungrouped,
    /// A group the index models; `block_size` is 0 when the event carries no tokens.
    Grouped {
        idx: u8,
        kind: GroupKind,
        block_size: u32,
    },
    /// Not indexed: a non-zero group without a kind, a kind the index does not model, or a group
    /// index past [`MAX_GROUPS`].
    Unsupported,
}

/// Classifies a stored event by its group fields.
pub(crate) fn store_group(ev: &BlockStored) -> StoreGroup {
    let idx = ev.group_idx.unwrap_or(0);
    let Some(kind) = ev.kv_cache_spec_kind.as_deref() else {
        return if idx == 0 {
            StoreGroup::Ungrouped
        } else {
            StoreGroup::Unsupported
        };
    };
    let (Ok(idx), Some(kind)) = (
        u8::try_from(idx),
        GroupKind::parse(kind, ev.kv_cache_spec_sliding_window),
    ) else {
        return StoreGroup::Unsupported;
    };
    if usize::from(idx) >= MAX_GROUPS {
        return StoreGroup::Unsupported;
    }
    StoreGroup::Grouped {
        idx,
        kind,
        block_size: if ev.token_ids.is_empty() {
            0
        } else {
            ev.block_size
        },
    }
}

/// The group index a removal names, if it is a modelled one (`None` group → `Some(None)`).
pub(crate) fn remove_group(ev: &BlockRemoved) -> Option<Option<u8>> {
    match ev.group_idx {
        None => Some(None),
        Some(g) => u8::try_from(g)
            .ok()
            .filter(|g| usize::from(*g) < MAX_GROUPS)
            .map(Some),
    }
}

/// One group of an endpoint, as learned from its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupSpec {
    pub kind: GroupKind,
    /// Engine block size in tokens; 0 until an event with tokens told it.
    pub block_size: u32,
}

/// An endpoint's groups, learned from the events it publishes (vLLM does not announce them
/// otherwise). Dense endpoints (no group fields, or one full-attention group) stay
/// [`GroupLayout::is_hybrid`] false and are indexed exactly as before groups existed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GroupLayout {
    groups: Vec<Option<GroupSpec>>,
}

/// Why an event's group does not fit the layout learned so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayoutConflict {
    /// The group was learned with another kind or window (a restarted engine with another model
    /// is cleared by its publisher's restart first, so this is an odd event).
    Kind,
    /// The event's block size is not the layout's (vLLM's finer partial entries, or a
    /// corrupt event): the rule needs one block size for every group.
    BlockSize,
}

impl GroupLayout {
    pub fn get(&self, idx: u8) -> Option<GroupSpec> {
        self.groups.get(usize::from(idx)).copied().flatten()
    }

    /// More than one group, or any group that is not full attention: the index then tracks which
    /// group holds which block and applies [`hybrid_hit`].
    pub fn is_hybrid(&self) -> bool {
        let mut known = self.groups.iter().flatten();
        let first = known.next();
        first.is_some_and(|g| g.kind != GroupKind::Full) || known.next().is_some()
    }

    /// The group a dense endpoint's events name: its one known group, 0 before any is known.
    pub fn dense_group(&self) -> u8 {
        self.groups
            .iter()
            .position(Option::is_some)
            .and_then(|i| u8::try_from(i).ok())
            .unwrap_or(0)
    }

    /// Bit set of the full-attention groups.
    pub fn full_mask(&self) -> u64 {
        self.mask_of(|k| k == GroupKind::Full)
    }

    fn mask_of(&self, pred: impl Fn(GroupKind) -> bool) -> u64 {
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, g)| g.is_some_and(|g| pred(g.kind)))
            .fold(0, |m, (i, _)| m | (1u64 << i))
    }

    /// The block size every known group agrees on (0 if none is known yet).
    pub fn block_size(&self) -> u32 {
        self.groups
            .iter()
            .flatten()
            .map(|g| g.block_size)
            .find(|bs| *bs != 0)
            .unwrap_or(0)
    }

    /// Records group `idx` as `kind` with `block_size` (0 = unknown). Returns whether the group
    /// is new, or why the event does not fit.
    pub fn learn(
        &mut self,
        idx: u8,
        kind: GroupKind,
        block_size: u32,
    ) -> Result<bool, LayoutConflict> {
        let agreed = self.block_size();
        if block_size != 0 && agreed != 0 && block_size != agreed {
            return Err(LayoutConflict::BlockSize);
        }
        let i = usize::from(idx);
        if self.groups.len() <= i {
            self.groups.resize(i + 1, None);
        }
        match &mut self.groups[i] {
            Some(g) if g.kind != kind => Err(LayoutConflict::Kind),
            Some(g) => {
                if g.block_size == 0 {
                    g.block_size = block_size;
                }
                Ok(false)
            }
            slot @ None => {
                *slot = Some(GroupSpec { kind, block_size });
                Ok(true)
            }
        }
    }

    /// The rule's input for lookups: the non-full specs with their groups, and the block size.
    pub fn rule(&self) -> HybridRule {
        let block_size = self.block_size();
        let mut specs: Vec<SpecGroups> = Vec::new();
        for (i, g) in self.groups.iter().enumerate() {
            let Some(g) = g else { continue };
            let need = match g.kind {
                GroupKind::Full => continue,
                GroupKind::Mamba => SpecNeed::State,
                GroupKind::Sliding { window } => {
                    SpecNeed::Window((window - 1).div_ceil(block_size.max(1)) as usize)
                }
            };
            // vLLM checks a spec's blocks "in every group of that spec": groups of one kind and
            // window share the check.
            match specs.iter_mut().find(|s| s.kind == g.kind) {
                Some(s) => s.groups |= 1 << i,
                None => specs.push(SpecGroups {
                    kind: g.kind,
                    need,
                    groups: 1 << i,
                }),
            }
        }
        HybridRule {
            engine_block_size: block_size as usize,
            specs,
        }
    }
}

/// What a non-full spec needs at a hit's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpecNeed {
    /// This many consecutive blocks ending at the hit's last block.
    Window(usize),
    /// The state block at the hit's last block.
    State,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SpecGroups {
    pub kind: GroupKind,
    pub need: SpecNeed,
    /// Bit set of the spec's groups.
    pub groups: u64,
}

/// A hybrid endpoint's rule, published for lock-free lookups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HybridRule {
    /// Engine block size in tokens (0 while unknown: the endpoint then matches nothing).
    pub engine_block_size: usize,
    pub specs: Vec<SpecGroups>,
}

/// vLLM's prefix hit, in engine blocks (`HybridKVCacheCoordinator.find_longest_cache_hit`):
/// `full_run` is the run of blocks from block 0 that every full-attention group holds (already
/// capped by the caller); `held(groups, j)` says whether block `j` is held in every group of the
/// bit set `groups`. Each spec may shorten the candidate; repeated until none does.
pub(crate) fn hybrid_hit(
    full_run: usize,
    specs: &[SpecGroups],
    mut held: impl FnMut(u64, usize) -> bool,
) -> usize {
    let mut hit = full_run;
    loop {
        let before = hit;
        for spec in specs {
            hit = match spec.need {
                SpecNeed::Window(need) => sliding_hit(hit, need, |j| held(spec.groups, j)),
                SpecNeed::State => (0..hit)
                    .rev()
                    .find(|j| held(spec.groups, *j))
                    .map_or(0, |j| j + 1),
            };
        }
        if hit == before {
            return hit;
        }
    }
}

/// `SlidingWindowManager.find_longest_cache_hit`: scanning right to left below `max`, the first
/// `need` consecutive held blocks end the hit; without such a run, the run held from block 0
/// (shorter than `need`) is the hit.
fn sliding_hit(max: usize, need: usize, mut held: impl FnMut(usize) -> bool) -> usize {
    let mut run = 0;
    for j in (0..max).rev() {
        if held(j) {
            run += 1;
            if run >= need {
                return j + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

/// The table key under which a non-full group's membership of the block keyed `key` is kept: a
/// bijective mix of the key with the group, so it never equals the block's own key's use for
/// the full-attention groups and stays as collision-free as chain keys.
pub(crate) fn group_key(key: ChainKey, group: u8) -> ChainKey {
    let mut z = key.0 ^ 0x6772_6f75_7000_0000_u64.wrapping_add(u64::from(group) + 1);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ChainKey(z ^ (z >> 31))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: GroupKind, need: SpecNeed, groups: u64) -> SpecGroups {
        SpecGroups { kind, need, groups }
    }

    #[test]
    fn sliding_hit_is_the_rightmost_window_else_the_run_from_block_0() {
        let held = |set: &'static [usize]| move |j: usize| set.contains(&j);
        // Window held at the end.
        assert_eq!(sliding_hit(10, 2, held(&[8, 9])), 10);
        // Only the far end's window: a shorter candidate cannot use it.
        assert_eq!(sliding_hit(9, 2, held(&[8, 9])), 0);
        // A window in the middle.
        assert_eq!(sliding_hit(10, 2, held(&[3, 4, 9])), 5);
        // No window anywhere: the run from block 0, shorter than `need`.
        assert_eq!(sliding_hit(10, 4, held(&[0, 1, 2, 5, 6])), 3);
        assert_eq!(sliding_hit(0, 2, held(&[])), 0);
    }

    #[test]
    fn the_rule_repeats_until_no_spec_shortens_the_hit() {
        let sliding = spec(GroupKind::Sliding { window: 64 }, SpecNeed::Window(2), 0b01);
        let mamba = spec(GroupKind::Mamba, SpecNeed::State, 0b10);
        // Sliding keeps blocks 3, 4, 6, 7; mamba has states at 4 and 6; the full run is 9.
        let held = |groups: u64, j: usize| match groups {
            0b01 => [3, 4, 6, 7].contains(&j),
            0b10 => [4, 6].contains(&j),
            _ => false,
        };
        // Full 9 → sliding 8 → mamba 7 → sliding (6 alone is not a window; 3,4) 5 → mamba 5.
        assert_eq!(hybrid_hit(9, &[sliding, mamba], held), 5);
    }

    #[test]
    fn layout_is_learned_and_conflicts_are_refused() {
        let mut l = GroupLayout::default();
        assert!(!l.is_hybrid());
        assert_eq!(l.learn(0, GroupKind::Full, 32), Ok(true));
        assert!(!l.is_hybrid(), "one full group is dense");
        assert_eq!(l.learn(0, GroupKind::Full, 0), Ok(false));
        assert_eq!(
            l.learn(0, GroupKind::Sliding { window: 64 }, 32),
            Err(LayoutConflict::Kind)
        );
        assert_eq!(
            l.learn(1, GroupKind::Sliding { window: 64 }, 16),
            Err(LayoutConflict::BlockSize)
        );
        assert_eq!(l.learn(2, GroupKind::Sliding { window: 128 }, 32), Ok(true));
        assert!(l.is_hybrid());
        assert_eq!(l.full_mask(), 0b001);
        let rule = l.rule();
        assert_eq!(rule.engine_block_size, 32);
        assert_eq!(rule.specs.len(), 1);
        assert_eq!(
            rule.specs[0].need,
            SpecNeed::Window(4),
            "gpt-oss: cdiv(127, 32)"
        );
    }

    #[test]
    fn event_kinds_map_to_group_kinds() {
        assert_eq!(
            GroupKind::parse("mla_attention", None),
            Some(GroupKind::Full)
        );
        assert_eq!(GroupKind::parse("sliding_window", None), None);
        assert_eq!(GroupKind::parse("sliding_window", Some(0)), None);
        assert_eq!(
            GroupKind::parse("sliding_window", Some(64)),
            Some(GroupKind::Sliding { window: 64 })
        );
        assert_eq!(GroupKind::parse("chunked_local_attention", Some(64)), None);
        assert_eq!(GroupKind::parse("mamba", None), Some(GroupKind::Mamba));
    }

    #[test]
    fn group_keys_differ_per_group_and_from_the_block_key() {
        let k = ChainKey(12345);
        assert_ne!(group_key(k, 0), k);
        assert_ne!(group_key(k, 0), group_key(k, 1));
        assert_ne!(group_key(k, 0), group_key(ChainKey(12346), 0));
    }
}
