//! Job building: a transfer's extents cut into worker jobs of at most
//! [`JOB_BLOCKS_MAX`] blocks, and handing them to the tier's worker ring.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::{SwapEngine, WorkerHandle};
use crate::tier::TierKind;
use crate::worker::{Job, JobOp, JOB_BLOCKS_MAX};
use crate::BlockId;

impl SwapEngine {
    /// Jobs for `extents` in order, over `blocks` from position `*idx` on (advanced past them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build_extent_jobs(
        &self,
        ticket: u64,
        op: JobOp,
        extents: &[(u64, u64)],
        blocks: &[BlockId],
        idx: &mut usize,
        cancel: &Arc<AtomicBool>,
        out: &mut Vec<Job>,
    ) {
        for &(start, len) in extents {
            let i = *idx;
            self.build_jobs(
                ticket,
                op,
                start,
                len,
                &blocks[i..i + len as usize],
                i as u32,
                cancel,
                out,
            );
            *idx += len as usize;
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn build_jobs(
        &self,
        ticket: u64,
        op: JobOp,
        start: u64,
        len: u64,
        blocks: &[BlockId],
        index: u32,
        cancel: &Arc<AtomicBool>,
        out: &mut Vec<Job>,
    ) {
        let mut off = 0u64;
        while off < len {
            let k = (len - off).min(self.job_blocks as u64) as usize;
            let mut ids = [0u32; JOB_BLOCKS_MAX];
            for (d, b) in ids.iter_mut().zip(&blocks[off as usize..off as usize + k]) {
                *d = b.0;
            }
            out.push(Job {
                ticket,
                op,
                slot: start + off,
                src_slot: 0,
                index: index + off as u32,
                count: k as u32,
                blocks: ids,
                cancel: cancel.clone(),
            });
            off += k as u64;
        }
    }

    pub(super) fn push_job(&mut self, tier: TierKind, job: Job) {
        let w = self.workers[tier.index()].as_mut().expect("job for a configured tier");
        w.pending.push_back(job);
        Self::flush(w);
    }

    pub(super) fn flush(w: &mut WorkerHandle) {
        while w.outstanding < w.capacity {
            let Some(j) = w.pending.pop_front() else { break };
            match w.jobs.push(j) {
                Ok(()) => w.outstanding += 1,
                Err(e) => {
                    w.pending.push_front(e.into_inner());
                    break;
                }
            }
        }
    }
}
