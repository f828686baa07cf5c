//! Per-block membership: two bitmasks (GPU, CPU) over dense endpoint slots.
//!
//! Slots 0..64 live inline (16 bytes) because most fleets are smaller than that and the inline
//! words keep a block entry at 40 bytes; larger fleets spill the higher words into one boxed slice
//! laid out `[gpu_w1, cpu_w1, gpu_w2, cpu_w2, ...]`, sized to the highest slot set.

use crate::Tier;

#[derive(Debug, Default)]
pub(crate) struct Members {
    gpu: u64,
    cpu: u64,
    extra: Option<Box<[u64]>>,
}

impl Members {
    /// Sets `slot` in `tier`; returns true if it was not set.
    pub(crate) fn set(&mut self, slot: u32, tier: Tier) -> bool {
        let (word, bit) = ((slot / 64) as usize, slot % 64);
        let w = if word == 0 {
            match tier {
                Tier::Gpu => &mut self.gpu,
                Tier::Cpu => &mut self.cpu,
            }
        } else {
            let need = 2 * word;
            let extra = self
                .extra
                .get_or_insert_with(|| vec![0; need].into_boxed_slice());
            if extra.len() < need {
                let mut grown = vec![0; need];
                grown[..extra.len()].copy_from_slice(extra);
                *extra = grown.into_boxed_slice();
            }
            &mut extra[2 * (word - 1) + tier_off(tier)]
        };
        let was = *w & (1 << bit) != 0;
        *w |= 1 << bit;
        !was
    }

    /// Clears `slot` in `tier`; returns true if it was set.
    pub(crate) fn clear(&mut self, slot: u32, tier: Tier) -> bool {
        let Some(w) = self.word_mut(slot, tier) else {
            return false;
        };
        let bit = 1u64 << (slot % 64);
        let was = *w & bit != 0;
        *w &= !bit;
        if was && slot >= 64 {
            self.shrink_extra();
        }
        was
    }

    /// Clears `slot` in both tiers; returns how many memberships were removed.
    pub(crate) fn clear_slot(&mut self, slot: u32) -> u64 {
        u64::from(self.clear(slot, Tier::Gpu)) + u64::from(self.clear(slot, Tier::Cpu))
    }

    pub(crate) fn has(&self, slot: u32, tier: Tier) -> bool {
        self.word(slot, tier) & (1 << (slot % 64)) != 0
    }

    pub(crate) fn has_any(&self, slot: u32) -> bool {
        self.has(slot, Tier::Gpu) || self.has(slot, Tier::Cpu)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.gpu == 0 && self.cpu == 0 && self.extra.is_none()
    }

    /// Number of (slot, tier) memberships.
    pub(crate) fn count(&self) -> u64 {
        let extra: u32 = self
            .extra
            .iter()
            .flat_map(|e| e.iter())
            .map(|w| w.count_ones())
            .sum();
        u64::from(self.gpu.count_ones() + self.cpu.count_ones() + extra)
    }

    /// Heap bytes owned besides the inline words.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.extra.as_ref().map_or(0, |e| e.len() * 8)
    }

    /// Writes the masks into `out` laid out `[gpu_w0, cpu_w0, gpu_w1, cpu_w1, ...]`, zero-filling
    /// words beyond what this block has.
    pub(crate) fn copy_into(&self, out: &mut [u64]) {
        if out.len() >= 2 {
            out[0] = self.gpu;
            out[1] = self.cpu;
        }
        let rest = out.get_mut(2..).unwrap_or_default();
        match &self.extra {
            None => rest.fill(0),
            Some(extra) => {
                let n = extra.len().min(rest.len());
                rest[..n].copy_from_slice(&extra[..n]);
                rest[n..].fill(0);
            }
        }
    }

    fn word(&self, slot: u32, tier: Tier) -> u64 {
        let word = (slot / 64) as usize;
        if word == 0 {
            match tier {
                Tier::Gpu => self.gpu,
                Tier::Cpu => self.cpu,
            }
        } else {
            self.extra
                .as_ref()
                .and_then(|e| e.get(2 * (word - 1) + tier_off(tier)).copied())
                .unwrap_or(0)
        }
    }

    fn word_mut(&mut self, slot: u32, tier: Tier) -> Option<&mut u64> {
        let word = (slot / 64) as usize;
        if word == 0 {
            Some(match tier {
                Tier::Gpu => &mut self.gpu,
                Tier::Cpu => &mut self.cpu,
            })
        } else {
            self.extra
                .as_mut()
                .and_then(|e| e.get_mut(2 * (word - 1) + tier_off(tier)))
        }
    }

    /// Drops trailing all-zero word pairs so `is_empty` stays a cheap check.
    fn shrink_extra(&mut self) {
        let Some(extra) = &self.extra else { return };
        let keep = extra
            .iter()
            .rposition(|w| *w != 0)
            .map_or(0, |i| i / 2 * 2 + 2);
        if keep == 0 {
            self.extra = None;
        } else if keep < extra.len() {
            self.extra = Some(extra[..keep].to_vec().into_boxed_slice());
        }
    }
}

fn tier_off(tier: Tier) -> usize {
    match tier {
        Tier::Gpu => 0,
        Tier::Cpu => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_clear_count_across_words() {
        let mut m = Members::default();
        assert!(m.set(3, Tier::Gpu));
        assert!(!m.set(3, Tier::Gpu));
        assert!(m.set(130, Tier::Cpu));
        assert!(m.has(130, Tier::Cpu) && !m.has(130, Tier::Gpu));
        assert_eq!(m.count(), 2);
        let mut out = [0u64; 8];
        m.copy_into(&mut out);
        assert_eq!(out, [1 << 3, 0, 0, 0, 0, 1 << 2, 0, 0]);
        assert!(m.clear(130, Tier::Cpu));
        assert!(m.extra.is_none(), "extra words dropped once empty");
        assert_eq!(m.clear_slot(3), 1);
        assert!(m.is_empty());
    }
}
