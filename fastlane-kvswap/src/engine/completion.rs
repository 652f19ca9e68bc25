//! Completion: draining the workers' done rings, finishing tickets (and the spills and
//! held jobs behind them), reporting results, and reaping dropped sequences.

use super::{Kind, SeqPhase, SwapEngine, TicketDone, TransferKind};
use crate::error::KvSwapError;
use crate::tier::TierKind;
use crate::worker::{Done, Job, JobFail};
use crate::{SeqId, Ticket};

impl SwapEngine {
    pub(super) fn poll_workers(&mut self) {
        for i in 0..3 {
            while let Some(d) = self.next_done(i) {
                self.on_done(d);
            }
        }
    }

    pub(super) fn next_done(&mut self, i: usize) -> Option<Done> {
        let w = self.workers[i].as_mut()?;
        match w.done.pop() {
            Ok(d) => {
                w.outstanding -= 1;
                Some(d)
            }
            Err(_) => {
                if w.thread.as_ref().is_some_and(|t| t.is_finished()) && w.outstanding > 0 {
                    log::error!("kvswap: worker {i} exited with jobs outstanding");
                }
                Self::flush(w);
                None
            }
        }
    }

    pub(super) fn on_done(&mut self, d: Done) {
        let Some(st) = self.tickets.get_mut(&d.ticket) else { return };
        st.jobs_left -= 1;
        match d.result {
            Ok(()) => match st.kind {
                Kind::Out => self.stats.bytes_out += d.bytes,
                Kind::In => self.stats.bytes_in += d.bytes,
                Kind::Spill { .. } => self.stats.bytes_spilled += d.bytes,
            },
            Err(f) => {
                let tier = self.seqs.get(&st.seq).and_then(|s| s.copy.as_ref().map(|c| c.tier));
                let tier = st.target.as_ref().map(|p| p.tier).or(tier).unwrap_or(TierKind::Host);
                let e = match f {
                    JobFail::Cancelled => KvSwapError::Cancelled,
                    JobFail::Checksum { index } => {
                        self.stats.checksum_failures += 1;
                        KvSwapError::ChecksumMismatch { seq: st.seq, index, tier }
                    }
                    JobFail::Io { errno }
                        if tier == TierKind::Remote && errno == crate::tier::REMOTE_GONE_ERRNO =>
                    {
                        KvSwapError::RemotePeerGone {
                            detail: "the remote pool stopped answering (connection lost)".into(),
                        }
                    }
                    JobFail::Io { errno } => KvSwapError::TierIo { tier, errno },
                };
                if st.failed.is_none()
                    || st.failed == Some(KvSwapError::Cancelled) && e != KvSwapError::Cancelled
                {
                    st.failed = Some(e);
                }
            }
        }
        self.maybe_finish(d.ticket);
    }

    pub(super) fn drop_held(&mut self, ticket: u64) {
        let st = self.tickets.get_mut(&ticket).expect("ticket");
        for (_, _, jobs) in &mut st.held {
            st.jobs_left -= jobs.len() as u32;
            jobs.clear();
        }
    }

    pub(super) fn maybe_finish(&mut self, ticket: u64) {
        let st = self.tickets.get(&ticket).expect("ticket");
        if st.jobs_left > 0 || !st.held.is_empty() {
            return;
        }
        let st = self.tickets.remove(&ticket).expect("ticket");
        let bb = self.block_bytes as u64;
        match st.kind {
            Kind::Out => {
                self.alloc.unpin(&st.pinned);
                let target = st.target.expect("out target");
                let s = self.seqs.get_mut(&st.seq).expect("seq of ticket");
                s.active = None;
                let tenant = s.tenant;
                let result = match st.failed {
                    None => {
                        s.phase = SeqPhase::Out(target.tier);
                        s.copy = Some(target);
                        Ok(())
                    }
                    Some(e) => {
                        s.phase = SeqPhase::Resident;
                        s.blocks_out = 0;
                        self.release(&target);
                        *self.tenant_bytes.entry(tenant).or_insert(0) -= st.bytes;
                        Err(e)
                    }
                };
                self.report(ticket, st.seq, TransferKind::SwapOut, result);
            }
            Kind::In => {
                self.alloc.unpin(&st.pinned);
                let s = self.seqs.get_mut(&st.seq).expect("seq of ticket");
                s.active = None;
                let tenant = s.tenant;
                let result = match st.failed {
                    None => {
                        let copy = s.copy.take().expect("in from a copy");
                        s.phase = SeqPhase::Resident;
                        s.blocks_out = 0;
                        self.release(&copy);
                        *self.tenant_bytes.entry(tenant).or_insert(0) -= st.bytes;
                        Ok(())
                    }
                    Some(e) => {
                        let tier = s.copy.as_ref().expect("copy").tier;
                        s.phase = SeqPhase::Out(tier);
                        Err(e)
                    }
                };
                self.report(ticket, st.seq, TransferKind::SwapIn, result);
            }
            Kind::Spill { parent } => {
                let target = st.target.expect("spill target");
                let s = self.seqs.get_mut(&st.seq).expect("victim");
                s.active = None;
                let ok = st.failed.is_none();
                let old = if ok {
                    let old = s.copy.replace(target).expect("victim copy");
                    s.phase = SeqPhase::Out(s.copy.as_ref().expect("set").tier);
                    Some(old)
                } else {
                    log::warn!(
                        "kvswap: spill of {} failed ({:?}); it stays in host memory",
                        st.seq,
                        st.failed
                    );
                    s.phase = SeqPhase::Out(TierKind::Host);
                    self.release(&target);
                    None
                };
                let _ = bb;
                // Hand the victim's host slots to the parent (or back to the free space).
                #[allow(clippy::type_complexity)]
                let mut hand: Option<(Vec<(u64, u64)>, Vec<Job>)> = None;
                if let Some(p) = self.tickets.get_mut(&parent) {
                    if let Some(i) = p.held.iter().position(|h| h.0 == ticket) {
                        let (_, taken, jobs) = p.held.swap_remove(i);
                        hand = Some((taken, jobs));
                    }
                }
                let parent_ok = self.tickets.get(&parent).is_some_and(|p| p.failed.is_none());
                if let Some(old) = old {
                    let (taken, jobs) = hand.unwrap_or_default();
                    let host = self.workers[0].as_mut().expect("host tier");
                    // Slots of the old copy not taken by the parent go back to free space.
                    for &(a, l) in &old.extents {
                        let mut cur = (a, l);
                        for &(ta, tl) in &taken {
                            if ta == cur.0 && tl <= cur.1 {
                                cur = (cur.0 + tl, cur.1 - tl);
                            }
                        }
                        host.space.release(cur.0, cur.1);
                    }
                    if parent_ok {
                        let p = self.tickets.get_mut(&parent).expect("parent");
                        p.target.as_mut().expect("parent target").extents.extend_from_slice(&taken);
                        for j in jobs {
                            self.push_job(TierKind::Host, j);
                        }
                    } else {
                        if let Some(p) = self.tickets.get_mut(&parent) {
                            p.jobs_left -= jobs.len() as u32;
                        }
                        for (a, l) in taken {
                            host.space.release(a, l);
                        }
                    }
                } else if let Some((_, jobs)) = hand {
                    if let Some(p) = self.tickets.get_mut(&parent) {
                        p.jobs_left -= jobs.len() as u32;
                        p.failed.get_or_insert(st.failed.clone().expect("failed spill"));
                    }
                }
                let seq = st.seq;
                self.reap(seq);
                if self.tickets.contains_key(&parent) {
                    self.maybe_finish(parent);
                }
                return;
            }
        }
        self.reap(st.seq);
    }

    pub(super) fn report(
        &mut self,
        ticket: u64,
        seq: SeqId,
        kind: TransferKind,
        result: Result<(), KvSwapError>,
    ) {
        self.results.insert(ticket, TicketDone { ticket: Ticket(ticket), seq, kind, result });
        self.finished.push_back(ticket);
    }

    /// Removes a dropped sequence once nothing is in flight for it.
    pub(super) fn reap(&mut self, seq: SeqId) {
        let Some(s) = self.seqs.get(&seq) else { return };
        if !s.dropped || s.active.is_some() {
            return;
        }
        let s = self.seqs.remove(&seq).expect("present");
        if let Some(c) = &s.copy {
            self.release(c);
            let bytes = u64::from(s.blocks_out) * self.block_bytes as u64;
            *self.tenant_bytes.entry(s.tenant).or_insert(0) -= bytes;
        }
        let left = self.alloc.free_all_unpinned(seq);
        debug_assert_eq!(left, 0, "dropped sequence still has pinned blocks");
    }
}
