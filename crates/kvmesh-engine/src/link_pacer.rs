//! The async side of the sim engine's modelled link ([`crate::link`]): [`LinkHandle`] wraps one
//! node's [`LinkModel`] for the tasks that move blocks, and [`BlockPacer`] adapts it to the
//! transfer crate's [`LinkPacer`] seam, so the P2P producer paces what it serves (egress) and the
//! pull client what it receives (ingress) by the same link (`docs/architecture.md#sim-link-model`).
//!
//! Every transfer carries a [`TrafficClass`]: demand (a request waits for it) or background (a
//! prefetch), which the model serves only while no demand transfer moves bytes. A prefetch a
//! request starts waiting for is promoted ([`LinkTransfer::promote`]), which wakes every waiter
//! on the link to predict again.
//!
//! Modelled time runs `time_scale` times faster than the wall clock from the handle's creation:
//! a transfer sleeps until its predicted finish (converted to wall time), and wakes early to
//! predict again whenever a transfer starts or ends on the link. The lock is never held across
//! an `.await`; a transfer deregisters when dropped, so a cancelled pull or fetch frees its
//! share at once.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kvmesh_transfer::{LinkPacer, PacedTransfer, TrafficClass};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::link::{FlowId, LinkModel, LinkParams};

/// One node's modelled link, shared by its producer and its consumer. Cheap to clone.
#[derive(Clone)]
pub struct LinkHandle {
    shared: Arc<Shared>,
}

struct Shared {
    model: Mutex<LinkModel>,
    /// Modelled time 0.
    epoch: Instant,
    time_scale: f64,
    /// Bumped at every start, removal, truncation or promotion: waiters predict again.
    changed: watch::Sender<u64>,
}

impl std::fmt::Debug for LinkHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkHandle")
            .field("params", &self.params())
            .field("time_scale", &self.shared.time_scale)
            .finish_non_exhaustive()
    }
}

impl LinkHandle {
    /// A link of `params` whose modelled time runs `time_scale` × wall time (≤ 0 means 1).
    pub fn new(params: LinkParams, time_scale: f64) -> Self {
        let time_scale = if time_scale.is_finite() && time_scale > 0.0 {
            time_scale
        } else {
            1.0
        };
        Self {
            shared: Arc::new(Shared {
                model: Mutex::new(LinkModel::new(params)),
                epoch: Instant::now(),
                time_scale,
                changed: watch::Sender::new(0),
            }),
        }
    }

    pub fn params(&self) -> LinkParams {
        self.shared.model.lock().params()
    }

    fn model_now(&self) -> f64 {
        self.shared.epoch.elapsed().as_secs_f64() * self.shared.time_scale
    }

    /// The wall instant modelled time `t` is reached (far future for absurd values).
    fn wall_at(&self, t: f64) -> Instant {
        let secs = (t / self.shared.time_scale).clamp(0.0, 1e9);
        self.shared.epoch + Duration::from_secs_f64(secs)
    }

    fn bump(&self) {
        self.shared.changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// Registers a transfer of `bytes` modelled bytes of `class`, starting now.
    pub fn start(&self, bytes: f64, class: TrafficClass) -> LinkTransfer {
        let id = self
            .shared
            .model
            .lock()
            .start(self.model_now(), bytes, class);
        // Subscribed after our own start: only later changes wake us.
        let changed = self.shared.changed.subscribe();
        self.bump();
        LinkTransfer {
            link: self.clone(),
            id,
            changed,
        }
    }

    /// Moves `bytes` modelled bytes of `class` over the link: registers, waits until done,
    /// deregisters.
    pub async fn transfer(&self, bytes: f64, class: TrafficClass) {
        self.start(bytes, class).finish().await;
    }

    /// Transfers registered right now (tests, debugging).
    pub fn registered(&self) -> usize {
        self.shared.model.lock().registered()
    }
}

/// One transfer on a [`LinkHandle`]; dropping it deregisters it.
pub struct LinkTransfer {
    link: LinkHandle,
    id: FlowId,
    changed: watch::Receiver<u64>,
}

impl LinkTransfer {
    /// Waits until this transfer has delivered `bytes` (its total at most) on the modelled link.
    /// Cancel safe.
    pub async fn reach(&mut self, bytes: f64) {
        loop {
            self.changed.borrow_and_update();
            let at = {
                let mut m = self.link.shared.model.lock();
                m.advance(self.link.model_now());
                m.time_of(self.id, bytes)
            };
            let Some(at) = at else {
                return;
            };
            let wake = self.link.wall_at(at);
            if wake <= Instant::now() {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                r = self.changed.changed() => {
                    if r.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// Waits until the whole transfer is done.
    pub async fn finish(&mut self) {
        self.reach(f64::INFINITY).await;
    }

    /// Shrinks the transfer to `bytes`.
    pub fn truncate(&mut self, bytes: f64) {
        let now = self.link.model_now();
        self.link.shared.model.lock().truncate(now, self.id, bytes);
        self.changed.borrow_and_update();
        self.link.bump();
    }
}

impl LinkTransfer {
    /// Makes this transfer a demand one from now on (a request now waits for what is left of
    /// it); the other transfers on the link predict again. No-op if it already is.
    pub fn promote(&mut self) {
        let now = self.link.model_now();
        {
            let mut m = self.link.shared.model.lock();
            if m.class(self.id) != Some(TrafficClass::Background) {
                return;
            }
            m.promote(now, self.id);
        }
        self.changed.borrow_and_update();
        self.link.bump();
    }

    /// This transfer's class right now.
    pub fn class(&self) -> Option<TrafficClass> {
        self.link.shared.model.lock().class(self.id)
    }
}

impl Drop for LinkTransfer {
    fn drop(&mut self) {
        let now = self.link.model_now();
        self.link.shared.model.lock().remove(now, self.id);
        self.link.bump();
    }
}

/// A [`LinkHandle`] in blocks: each block is `bytes_per_block` modelled bytes (block size × the
/// profile's real KV bytes per token, not the scaled-down wire payload).
#[derive(Debug, Clone)]
pub struct BlockPacer {
    pub link: LinkHandle,
    pub bytes_per_block: u64,
}

struct PacedBlocks {
    transfer: LinkTransfer,
    bytes_per_block: f64,
}

impl LinkPacer for BlockPacer {
    fn begin(&self, blocks: usize, class: TrafficClass) -> Box<dyn PacedTransfer> {
        let bytes_per_block = self.bytes_per_block as f64;
        Box::new(PacedBlocks {
            transfer: self.link.start(blocks as f64 * bytes_per_block, class),
            bytes_per_block,
        })
    }

    fn modelled_bytes_per_block(&self) -> u64 {
        self.bytes_per_block
    }
}

impl PacedTransfer for PacedBlocks {
    fn reached(&mut self, blocks: usize) -> BoxFuture<'_, ()> {
        let bytes = blocks as f64 * self.bytes_per_block;
        Box::pin(self.transfer.reach(bytes))
    }

    fn truncate(&mut self, blocks: usize) {
        self.transfer.truncate(blocks as f64 * self.bytes_per_block);
    }

    fn promote(&mut self) {
        self.transfer.promote();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const D: TrafficClass = TrafficClass::Demand;
    const B: TrafficClass = TrafficClass::Background;

    /// 1 GB/s, 10 ms setup; 100 MB alone = 110 ms of modelled time.
    fn link(time_scale: f64) -> LinkHandle {
        LinkHandle::new(
            LinkParams {
                bytes_per_sec: 1e9,
                setup_s: 0.010,
            },
            time_scale,
        )
    }

    async fn timed(link: &LinkHandle, bytes: f64) -> Duration {
        let t0 = Instant::now();
        link.transfer(bytes, D).await;
        t0.elapsed()
    }

    fn near(d: Duration, ms: f64) -> bool {
        (d.as_secs_f64() * 1000.0 - ms).abs() < 2.0
    }

    #[tokio::test(start_paused = true)]
    async fn a_transfer_sleeps_its_modelled_time_divided_by_the_time_scale() {
        assert!(near(timed(&link(1.0), 1e8).await, 110.0));
        assert!(near(timed(&link(10.0), 1e8).await, 11.0));
    }

    /// Two concurrent transfers on one link each take setup + 2 × bytes/bandwidth.
    #[tokio::test(start_paused = true)]
    async fn concurrent_transfers_share_the_link() {
        let l = link(1.0);
        let (a, b) = tokio::join!(timed(&l, 1e8), timed(&l, 1e8));
        assert!(near(a, 210.0) && near(b, 210.0), "{a:?} {b:?}");
        assert_eq!(l.registered(), 0);
    }

    /// A transfer started later wakes the running one, which re-predicts (slower), and the
    /// short late one finishes first.
    #[tokio::test(start_paused = true)]
    async fn a_start_mid_transfer_slows_the_running_one() {
        let l = link(1.0);
        let long = {
            let l = l.clone();
            tokio::spawn(async move { timed(&l, 4e8).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let short = timed(&l, 1e8).await;
        let long = long.await.unwrap();
        assert!(near(short, 210.0), "{short:?}");
        assert!(near(long, 510.0), "{long:?}");
    }

    /// Acceptance (issue 17): dropping a transfer (a cancelled pull) deregisters it and the
    /// others speed up.
    #[tokio::test(start_paused = true)]
    async fn dropping_a_transfer_deregisters_it() {
        let l = link(1.0);
        let mut a = l.start(1e8, D);
        let b = l.start(1e8, D);
        assert_eq!(l.registered(), 2);
        let t0 = Instant::now();
        let cancel = async {
            tokio::time::sleep(Duration::from_millis(60)).await;
            drop(b);
        };
        tokio::join!(a.finish(), cancel);
        // 25 MB by 60 ms at half rate, the remaining 75 MB alone: 135 ms, not 210.
        assert!(near(t0.elapsed(), 135.0), "{:?}", t0.elapsed());
        drop(a);
        assert_eq!(l.registered(), 0);
        // A future dropped mid-wait deregisters too.
        let fut = l.transfer(1e9, D);
        let _ = tokio::time::timeout(Duration::from_millis(5), fut).await;
        assert_eq!(l.registered(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_block_pacer_counts_blocks_in_modelled_bytes() {
        let p = BlockPacer {
            link: link(1.0),
            bytes_per_block: 1_000_000,
        };
        let mut t = p.begin(100, D);
        let t0 = Instant::now();
        t.reached(50).await;
        assert!(near(t0.elapsed(), 60.0), "{:?}", t0.elapsed());
        t.truncate(60);
        t.reached(100).await;
        assert!(near(t0.elapsed(), 70.0), "{:?}", t0.elapsed());
        assert_eq!(p.modelled_bytes_per_block(), 1_000_000);
    }

    /// A background transfer (a prefetch) does not slow a demand one started meanwhile: the
    /// demand transfer takes its uncontended time, and the background one finishes after.
    #[tokio::test(start_paused = true)]
    async fn a_background_transfer_yields_to_a_demand_one() {
        let l = link(1.0);
        let bg = {
            let l = l.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                l.transfer(4e8, B).await;
                t0.elapsed()
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let demand = timed(&l, 1e8).await;
        assert!(near(demand, 110.0), "{demand:?}");
        // 100 MB by 110 ms, stalled for 100 ms, then its last 300 MB alone.
        let bg = bg.await.unwrap();
        assert!(near(bg, 510.0), "{bg:?}");
    }

    /// Promoting a stalled background transfer wakes it (and the others) to predict again: from
    /// then on it shares the link like a demand transfer.
    #[tokio::test(start_paused = true)]
    async fn a_promoted_transfer_wakes_and_shares() {
        let l = link(1.0);
        let demand = {
            let l = l.clone();
            tokio::spawn(async move { timed(&l, 4e8).await })
        };
        tokio::task::yield_now().await;
        let mut bg = l.start(1e8, B);
        assert_eq!(bg.class(), Some(B));
        let t0 = Instant::now();
        let promote_at_110ms = tokio::time::sleep(Duration::from_millis(110));
        tokio::pin!(promote_at_110ms);
        tokio::select! {
            () = bg.finish() => panic!("a stalled background transfer finished"),
            () = &mut promote_at_110ms => {}
        }
        bg.promote();
        assert_eq!(bg.class(), Some(D));
        bg.finish().await;
        // From 110 ms both at half rate: its 100 MB end at 310 ms; the demand one at 510.
        assert!(near(t0.elapsed(), 310.0), "{:?}", t0.elapsed());
        let demand = demand.await.unwrap();
        assert!(near(demand, 510.0), "{demand:?}");
        drop(bg);
        assert_eq!(l.registered(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_block_pacer_passes_the_class_and_promotes() {
        let p = BlockPacer {
            link: link(1.0),
            bytes_per_block: 1_000_000,
        };
        let _demand = p.begin(1000, D); // 1 s of demand work
        let mut bg = p.begin(100, B);
        let t0 = Instant::now();
        let early = tokio::time::timeout(Duration::from_millis(500), bg.reached(1)).await;
        assert!(early.is_err(), "moved behind demand work");
        bg.promote();
        bg.reached(100).await;
        // From 500 ms at half rate: 100 MB in 200 ms.
        assert!(near(t0.elapsed(), 700.0), "{:?}", t0.elapsed());
    }
}
