//! Collectives on symmetric memory: no copy through the slots.
//!
//! Every rank of the host maps every rank's segment ([`crate::transport::shm::segment`]).
//! When every rank passes a buffer at the same offset of the same allocation, each rank reads
//! its peers' data straight from their segments:
//!
//! - all-reduce: rank `i` reduces part `i` of the buffer from the N segments and writes the
//!   result into the N segments;
//! - reduce-scatter (inputs in symmetric memory, on any ranks and at any offsets): rank `i`
//!   reduces block `i` of every input into its own output, reading each symmetric input where
//!   it is and the others from the slots (`super::reduce_scatter`);
//! - all-gather, the input in symmetric memory: every rank copies every rank's input from
//!   that rank's segment into its own output;
//! - all-gather, the output in symmetric memory: every rank puts its input into its own
//!   block of its output, then copies every peer's block from that peer's segment.
//!
//! Each byte of input is read once and each byte of output written once, the least memory
//! traffic these ops can have (the bound `bench_collectives.py` prints), where the slots add
//! a copy in and (all-reduce) a copy out. Two phases order every op: the first says every
//! input is ready (and carries where the buffer is, so that ranks that disagree fail instead
//! of reading garbage), the second that every rank is done reading and writing, so the caller
//! may reuse the buffer as soon as the op returns. Reductions run in rank order, so the
//! results have the same bits as the other algorithms'.

use std::sync::Arc;
use std::time::Instant;

use super::ArenaComm;
use crate::collectives::comm_threads;
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::memcpy::copy_piece_to_shared;
use crate::reduce::{self, ReduceOp};
use crate::signature::OpSig;
use crate::transport::shm::segment::Segment;

/// Bytes reduced at a time per thread: N blocks of inputs and one of output stay in L2.
const BLOCK_BYTES: usize = 32 * 1024;

/// Marks the phase word of an op on symmetric memory (with the segment and offset).
const SYMMETRIC: u64 = 1 << 63;
/// Marks a place word that names the op's input where the op could name either buffer
/// (all-gather), so that ranks that put different buffers there disagree.
const INPUT: u64 = 1 << 62;

/// The segments of one symmetric allocation: every local rank's, by local index.
pub(super) struct Allocation {
    files: Vec<Arc<Segment>>,
}

/// The registered allocations, by the index every local rank gave them (released ones stay
/// as empty entries, so the indices, published with every op, keep meaning the same).
pub(super) type Allocations = Vec<Option<Allocation>>;

/// Where a buffer lies in symmetric memory: which allocation, at which offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    alloc: usize,
    offset: usize,
}

impl Place {
    /// The word published with the op's signature: equal on every rank or the op fails.
    pub(super) fn word(self) -> u64 {
        SYMMETRIC | ((self.alloc as u64 + 1) << 40) | self.offset as u64
    }

    /// The word of an all-gather whose input is at this place.
    fn input_word(self) -> u64 {
        self.word() | INPUT
    }
}

/// A pointer that may cross into the helper threads (they touch disjoint blocks).
#[derive(Clone, Copy)]
pub(super) struct Base(pub(super) *mut u8);
// SAFETY: the pointers are bases of mappings that outlive the op; the helpers each work on
// their own byte ranges of them (see `all_reduce_symmetric`).
unsafe impl Send for Base {}
// SAFETY: as above.
unsafe impl Sync for Base {}

impl ArenaComm {
    /// Maps every local rank's segment file of one symmetric allocation (`paths` by local
    /// index, each `len` bytes) and remembers them; returns the allocation's index and this
    /// rank's segment. Every local rank registers its allocations in the same order.
    pub fn register_symmetric(
        &mut self,
        paths: &[String],
        len: usize,
    ) -> Result<(usize, Arc<Segment>)> {
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
        self.symmetric.push(Some(Allocation { files }));
        Ok((self.symmetric.len() - 1, mine))
    }

    /// Forgets allocation `index` (this rank no longer uses it): its mappings of every rank's
    /// segment go once nothing else holds them. Ranks may release at different times; no op
    /// may name the allocation afterwards (its buffers are gone on this rank).
    pub fn release_symmetric(&mut self, index: usize) -> Result<()> {
        match self.symmetric.get_mut(index) {
            Some(entry @ Some(_)) => {
                *entry = None;
                Ok(())
            }
            _ => Err(Error::invalid(format!(
                "no symmetric allocation #{index} is registered on this group (released twice?)"
            ))),
        }
    }

    /// Where `buf` lies in this rank's symmetric memory, if it does.
    pub(super) fn symmetric_place(&self, buf: &[u8]) -> Option<Place> {
        if buf.is_empty() {
            return None;
        }
        let me = self.arena.me();
        self.symmetric.iter().enumerate().find_map(|(alloc, a)| {
            a.as_ref()?.files[me]
                .offset_of(buf.as_ptr(), buf.len())
                .map(|offset| Place { alloc, offset })
        })
    }

    /// Where rank `r`'s buffer of `len` bytes is, from the word it published: `None` for a
    /// buffer outside symmetric memory; an error for a place this rank cannot read (an
    /// allocation it released, or bytes past the segment's end).
    pub(super) fn base_of_word(
        &self,
        r: usize,
        word: u64,
        len: usize,
        sig: &OpSig,
    ) -> Result<Option<Base>> {
        if word & SYMMETRIC == 0 {
            return Ok(None);
        }
        let alloc = (((word & !(SYMMETRIC | INPUT)) >> 40) as usize).wrapping_sub(1);
        let offset = (word & ((1 << 40) - 1)) as usize;
        let file = self
            .symmetric
            .get(alloc)
            .and_then(Option::as_ref)
            .map(|a| &a.files[r])
            .filter(|f| offset.checked_add(len).is_some_and(|end| end <= f.len()));
        match file {
            Some(f) => Ok(Some(Base(f.ptr().wrapping_add(offset)))),
            None => Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "{sig}: rank {} passed symmetric allocation #{alloc} at byte {offset}, which \
                     rank {} does not hold (released, or too short for {len} bytes); every \
                     rank must keep a symmetric allocation while any rank uses it",
                    self.arena.global(r),
                    self.arena.global(self.arena.me())
                ),
            )),
        }
    }

    /// Every rank's base address of the buffer at `place`, by local index.
    fn bases(&self, place: Place) -> Vec<Base> {
        self.symmetric[place.alloc]
            .as_ref()
            .expect("a place names a registered allocation")
            .files
            .iter()
            .map(|f| Base(f.ptr().wrapping_add(place.offset)))
            .collect()
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
                            "{}symmetric allocation #{} at byte {}",
                            if w & INPUT != 0 { "an input in " } else { "" },
                            ((w & !(SYMMETRIC | INPUT)) >> 40) - 1,
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
        let bases = self.bases(place);
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

    /// The all-gather into `out` (at `place` of this rank's symmetric memory, `n` blocks of
    /// `inp.len()` bytes): `inp` goes to this rank's own block, then every peer's block is
    /// copied from the same block of that peer's segment.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn all_gather_symmetric(
        &mut self,
        place: Place,
        out: &mut [u8],
        inp: &[u8],
        sig: &OpSig,
        deadline: Instant,
        ways: usize,
    ) -> Result<()> {
        let (n, me, block) = (self.n(), self.arena.me(), inp.len());
        debug_assert_eq!(out.len(), n * block);
        out[me * block..(me + 1) * block].copy_from_slice(inp);
        let parity = self.step(sig, Some(place.word()), deadline, |_| {})?;
        self.check_place_word(parity, place.word(), sig)?;
        let bases = self.bases(place);
        let stream = self.stream.gather_streams(out.len(), n);
        comm_threads::split(out, ways, |a, dst| {
            let b = a + dst.len();
            for (r, p) in bases.iter().enumerate() {
                let (x, y) = ((r * block).max(a), ((r + 1) * block).min(b));
                if r == me || x >= y {
                    continue;
                }
                // SAFETY: `base + x .. base + y` lies inside rank `r`'s segment (every segment
                // of the allocation has the length of this rank's, which holds `out` at the
                // same offset). Rank `r` wrote its block `r` before the first phase and writes
                // none of it before the second; this rank reads only peers' segments here and
                // writes only its own `out`.
                let src = unsafe { std::slice::from_raw_parts(p.0.add(x), y - x) };
                copy_piece_to_shared(&mut dst[x - a..y - a], src, stream);
            }
        });
        self.step(sig, None, deadline, |_| {})?;
        Ok(())
    }

    /// The all-gather of the `n * inp.len()` bytes into `out`, `inp` at `place` of this
    /// rank's symmetric memory: block `r` of `out` is copied from rank `r`'s segment.
    pub(super) fn all_gather_symmetric_input(
        &mut self,
        place: Place,
        out: &mut [u8],
        block: usize,
        sig: &OpSig,
        deadline: Instant,
        ways: usize,
    ) -> Result<()> {
        let parity = self.step(sig, Some(place.input_word()), deadline, |_| {})?;
        self.check_place_word(parity, place.input_word(), sig)?;
        let bases = self.bases(place);
        let stream = self.stream.gather_streams(out.len(), self.n());
        comm_threads::split(out, ways, |a, dst| {
            let b = a + dst.len();
            for (r, p) in bases.iter().enumerate() {
                let (x, y) = ((r * block).max(a), ((r + 1) * block).min(b));
                if x >= y {
                    continue;
                }
                // SAFETY: rank `r`'s input, `block` bytes at the place word's offset, lies in
                // its segment (each segment of the allocation is as long as this rank's, which
                // holds this rank's input there). No rank writes its input between the two
                // phases, and `out` (private to this rank) is no input of this op.
                let src = unsafe { std::slice::from_raw_parts(p.0.add(x - r * block), y - x) };
                copy_piece_to_shared(&mut dst[x - a..y - a], src, stream);
            }
        });
        self.step(sig, None, deadline, |_| {})?;
        Ok(())
    }

    /// Fails unless no peer's word of this phase names symmetric memory: for ops through the
    /// slots whose first word is not a place word (all-gather publishes its input's length).
    pub(super) fn check_no_symmetric_peer(&self, parity: usize, sig: &OpSig) -> Result<()> {
        let me = self.arena.me();
        for r in 0..self.n() {
            if r == me {
                continue;
            }
            let (_, theirs) = self.arena.sig_of(r, parity)?;
            if theirs & SYMMETRIC != 0 {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!(
                        "{sig}: rank {} passed a buffer in symmetric memory while rank {} \
                         passed tensors outside it; on a host every rank must pass the same \
                         place of its symmetric memory (shardline.symmetric_empty), or every \
                         rank tensors outside it",
                        self.arena.global(r),
                        self.arena.global(me)
                    ),
                ));
            }
        }
        Ok(())
    }
}
