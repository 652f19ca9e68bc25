//! Placement: which tier a swap-out lands in, the spills that make room in the host
//! tier, and releasing a copy's slots.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::{Kind, Placement, SeqPhase, SwapEngine, TicketState};
use crate::error::KvSwapError;
use crate::tier::{SlotSpace, TierKind};
use crate::worker::{Job, JobOp, JOB_BLOCKS_MAX};
use crate::SeqId;

impl SwapEngine {
    pub(super) fn space(&mut self, t: TierKind) -> Option<&mut SlotSpace> {
        self.workers[t.index()].as_mut().map(|w| &mut w.space)
    }

    pub(super) fn free_bytes(&self, t: TierKind) -> u64 {
        self.workers[t.index()]
            .as_ref()
            .map_or(0, |w| w.space.free_slots() * self.block_bytes as u64)
    }

    /// Chooses where `n` blocks of `seq` go. Returns the tier, the extents allocated now, and
    /// the spills started to make room (spill ticket, host extents taken from its victim).
    #[allow(clippy::type_complexity)]
    pub(super) fn place(
        &mut self,
        seq: SeqId,
        n: u64,
        cancel: &Arc<AtomicBool>,
    ) -> Result<(TierKind, Vec<(u64, u64)>, Vec<(u64, Vec<(u64, u64)>)>), KvSwapError> {
        let _ = cancel;
        let mut own = Vec::new();
        if let Some(h) = self.space(TierKind::Host) {
            if h.alloc(n, &mut own) {
                return Ok((TierKind::Host, own, Vec::new()));
            }
        }
        let host_slots = self.workers[0].as_ref().map_or(0, |w| w.space.slots());
        let spill_order = self.spill.order();
        if n <= host_slots && !spill_order.is_empty() {
            if let Some(r) = self.place_with_spills(seq, n) {
                return Ok(r);
            }
        }
        let mut last = (TierKind::Host, self.free_bytes(TierKind::Host));
        for &t in spill_order {
            if let Some(sp) = self.space(t) {
                if sp.alloc(n, &mut own) {
                    return Ok((t, own, Vec::new()));
                }
                last = (t, self.free_bytes(t));
            }
        }
        Err(KvSwapError::TierFull {
            tier: last.0,
            needed_bytes: n * self.block_bytes as u64,
            free_bytes: last.1,
        })
    }

    #[allow(clippy::type_complexity)]
    pub(super) fn place_with_spills(
        &mut self,
        seq: SeqId,
        n: u64,
    ) -> Option<(TierKind, Vec<(u64, u64)>, Vec<(u64, Vec<(u64, u64)>)>)> {
        let host_free = self.workers[0].as_ref()?.space.free_slots();
        let mut victims: Vec<(u64, SeqId)> = self
            .seqs
            .iter()
            .filter(|(id, s)| {
                **id != seq
                    && !s.dropped
                    && s.active.is_none()
                    && s.phase == SeqPhase::Out(TierKind::Host)
            })
            .map(|(id, s)| (s.last_use, *id))
            .collect();
        victims.sort();
        // Reserve spill space for victims until enough host slots would be free.
        let mut chosen: Vec<(SeqId, TierKind, Vec<(u64, u64)>)> = Vec::new();
        let mut gain = 0u64;
        for (_, v) in victims {
            if host_free + gain >= n {
                break;
            }
            let need = self.seqs[&v].copy.as_ref().expect("Out has a copy").slots();
            for &t in self.spill.order() {
                let mut ext = Vec::new();
                if self.space(t).is_some_and(|sp| sp.alloc(need, &mut ext)) {
                    chosen.push((v, t, ext));
                    gain += need;
                    break;
                }
            }
        }
        if host_free + gain < n {
            for (_, t, ext) in chosen {
                let sp = self.space(t).expect("allocated there");
                for (a, l) in ext {
                    sp.release(a, l);
                }
            }
            return None;
        }
        let mut own = Vec::new();
        let take_free = host_free.min(n);
        let ok = self.space(TierKind::Host).expect("host").alloc(take_free, &mut own);
        debug_assert!(ok);
        let mut left = n - take_free;
        let mut spills = Vec::new();
        for (v, t, ext) in chosen {
            let host_ext = self.seqs[&v].copy.as_ref().expect("copy").extents.clone();
            // Take the prefix of the victim's host extents that this sequence needs.
            let mut taken = Vec::new();
            for &(a, l) in &host_ext {
                if left == 0 {
                    break;
                }
                let k = l.min(left);
                taken.push((a, k));
                left -= k;
            }
            let st = self.start_spill(v, t, host_ext, ext);
            spills.push((st, taken));
        }
        Some((TierKind::Host, own, spills))
    }

    pub(super) fn start_spill(
        &mut self,
        victim: SeqId,
        tier: TierKind,
        host_ext: Vec<(u64, u64)>,
        spill_ext: Vec<(u64, u64)>,
    ) -> u64 {
        let ticket = self.new_ticket();
        let cancel = Arc::new(AtomicBool::new(false));
        // Walk both extent lists in lockstep, cutting jobs at either's boundaries.
        let mut jobs = Vec::new();
        let (mut hi, mut ho, mut si, mut so) = (0usize, 0u64, 0usize, 0u64);
        let mut index = 0u32;
        while hi < host_ext.len() && si < spill_ext.len() {
            let hl = host_ext[hi].1 - ho;
            let sl = spill_ext[si].1 - so;
            let k = hl.min(sl).min(self.job_blocks as u64);
            jobs.push(Job {
                ticket,
                op: JobOp::Migrate,
                slot: spill_ext[si].0 + so,
                src_slot: host_ext[hi].0 + ho,
                index,
                count: k as u32,
                blocks: [0; JOB_BLOCKS_MAX],
                cancel: cancel.clone(),
            });
            index += k as u32;
            ho += k;
            so += k;
            if ho == host_ext[hi].1 {
                hi += 1;
                ho = 0;
            }
            if so == spill_ext[si].1 {
                si += 1;
                so = 0;
            }
        }
        let s = self.seqs.get_mut(&victim).expect("victim");
        s.phase = SeqPhase::Spilling;
        s.active = Some(ticket);
        let bytes = u64::from(index) * self.block_bytes as u64;
        self.tickets.insert(
            ticket,
            TicketState {
                seq: victim,
                kind: Kind::Spill { parent: 0 },
                jobs_left: jobs.len() as u32,
                failed: None,
                cancel,
                pinned: Vec::new(),
                target: Some(Placement { tier, extents: spill_ext }),
                held: Vec::new(),
                bytes,
            },
        );
        self.stats.spills += 1;
        for j in jobs {
            self.push_job(tier, j);
        }
        ticket
    }

    pub(super) fn release(&mut self, p: &Placement) {
        let sp = self.space(p.tier).expect("placement in a configured tier");
        for &(a, l) in &p.extents {
            sp.release(a, l);
        }
    }
}
