//! All-reduce on symmetric memory: no copy through the slots.
//!
//! Every rank of the host maps every rank's segment ([`crate::transport::shm::segment`]).
//! When every rank all-reduces a buffer at the same offset of the same segment, rank `i`
//! reduces part `i` of the buffer straight from the N ranks' segments and writes the result
//! straight into the N segments: each byte of input is read once and each byte of output
//! written once, the least memory traffic an all-reduce can have (the bound
//! `bench_collectives.py` prints), where the two-phase all-reduce through the slots moves each
//! byte about five times. Two phases order it: the first says every input is ready (and
//! carries where the buffer is, so that ranks that disagree fail instead of reading garbage),
//! the second that every part is written. Between them part `i` of every segment is touched
//! by rank `i` alone. Parts are reduced in blocks small enough to stay in cache, in rank
//! order, so the result has the same bits as the other algorithms'.

use std::sync::Arc;
use std::time::Instant;

use super::ArenaComm;
use crate::collectives::comm_threads;
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::{self, ReduceOp};
use crate::signature::OpSig;
use crate::transport::shm::segment::Segment;

/// Bytes reduced at a time per thread: N blocks of inputs and one of output stay in L2.
const BLOCK_BYTES: usize = 32 * 1024;

/// Marks the phase word of an all-reduce on symmetric memory (with the segment and offset).
const SYMMETRIC: u64 = 1 << 63;

/// The segments of one symmetric allocation: every local rank's, by local index.
pub(super) struct Allocation {
    files: Vec<Arc<Segment>>,
}

/// Where a buffer lies in symmetric memory: which allocation, at which offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    alloc: usize,
    offset: usize,
}

impl Place {
    /// The word published with the op's signature: equal on every rank or the op fails.
    fn word(self) -> u64 {
        SYMMETRIC | ((self.alloc as u64 + 1) << 40) | self.offset as u64
    }
}

/// A pointer that may cross into the helper threads (they touch disjoint blocks).
#[derive(Clone, Copy)]
struct Base(*mut u8);
// SAFETY: the pointers are bases of mappings that outlive the op; the helpers each work on
// their own byte ranges of them (see `all_reduce_symmetric`).
unsafe impl Send for Base {}
// SAFETY: as above.
unsafe impl Sync for Base {}

impl ArenaComm {
    /// Maps every local rank's segment file of one symmetric allocation (`paths` by local
    /// index, each `len` bytes) and remembers them; returns this rank's segment. Every local
    /// rank registers its allocations in the same order.
    pub fn register_symmetric(&mut self, paths: &[String], len: usize) -> Result<Arc<Segment>> {
        if paths.len() != self.n() {
            return Err(Error::invalid(format!(
                "symmetric memory needs one segment per local rank ({}), got {}",
                self.n(),
                paths.len()
            )));
        }
        let files = paths
            .iter()
            .map(|p| Segment::open(p, len).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let mine = files[self.arena.me()].clone();
        self.symmetric.push(Allocation { files });
        Ok(mine)
    }

    /// Where `buf` lies in this rank's symmetric memory, if it does.
    pub(super) fn symmetric_place(&self, buf: &[u8]) -> Option<Place> {
        let me = self.arena.me();
        self.symmetric.iter().enumerate().find_map(|(alloc, a)| {
            a.files[me]
                .offset_of(buf.as_ptr(), buf.len())
                .map(|offset| Place { alloc, offset })
        })
    }

    /// Fails unless every rank published `mine` with this phase (an all-reduce on symmetric
    /// memory at the same place, or 0 for one through the slots).
    pub(super) fn check_place_word(&self, parity: usize, mine: u64, sig: &OpSig) -> Result<()> {
        let me = self.arena.me();
        for r in 0..self.n() {
            if r == me {
                continue;
            }
            let (_, theirs) = self.arena.sig_of(r, parity)?;
            if theirs != mine {
                let says = |w: u64| {
                    if w & SYMMETRIC == 0 {
                        "a tensor outside symmetric memory".to_string()
                    } else {
                        format!(
                            "symmetric allocation #{} at byte {}",
                            ((w & !SYMMETRIC) >> 40) - 1,
                            w & ((1 << 40) - 1)
                        )
                    }
                };
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!(
                        "{sig}: rank {} passed {} while rank {} passed {}; on a host every rank \
                         must all-reduce the same place of its symmetric memory \
                         (shardline.symmetric_empty), or every rank a tensor outside it",
                        self.arena.global(r),
                        says(theirs),
                        self.arena.global(me),
                        says(mine)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The all-reduce of `buf` (at `place` of this rank's symmetric memory) on every rank,
    /// each memory pass split `ways` ways.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn all_reduce_symmetric(
        &mut self,
        place: Place,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
        ways: usize,
    ) -> Result<()> {
        let parity = self.step(sig, Some(place.word()), deadline, |_| {})?;
        self.check_place_word(parity, place.word(), sig)?;
        let (n, me, es) = (self.n(), self.arena.me(), dtype.size());
        let (lo, hi) = super::all_reduce::part(len, es, n, me);
        let bases: Vec<Base> = self.symmetric[place.alloc]
            .files
            .iter()
            .map(|f| Base(f.ptr().wrapping_add(place.offset)))
            .collect();
        // Blocks of our part, whole elements each, spread over the helpers.
        let block = BLOCK_BYTES - BLOCK_BYTES % es;
        let blocks: Vec<(usize, usize)> = (lo..hi)
            .step_by(block)
            .map(|a| (a, (a + block).min(hi)))
            .collect();
        let per_lane = blocks.len().div_ceil(ways.max(1)).max(1);
        let runs: Vec<&[(usize, usize)]> = blocks.chunks(per_lane).collect();
        comm_threads::each(runs, ways, |_, run| {
            let mut tmp = vec![0u8; block];
            for &(a, b) in run {
                let out = &mut tmp[..b - a];
                {
                    // SAFETY: every base maps at least `len` bytes past it (`symmetric_place`
                    // found the buffer inside this rank's segment, and every rank's segment of
                    // one allocation has the same length; the place word check made the
                    // offset equal on every rank). Between this op's two phases, bytes
                    // `lo..hi` of every segment are read and written by this rank only, and
                    // `a..b` by this thread only.
                    let srcs: Vec<&[u8]> = bases
                        .iter()
                        .map(|p| unsafe { std::slice::from_raw_parts(p.0.add(a), b - a) })
                        .collect();
                    reduce::reduce_slices(out, &srcs, dtype, op);
                }
                for p in &bases {
                    // SAFETY: as above; the shared borrows of the sources ended with the block.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.0.add(a), b - a) };
                    dst.copy_from_slice(out);
                }
            }
        });
        self.step(sig, None, deadline, |_| {})?;
        Ok(())
    }
}
