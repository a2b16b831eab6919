//! All-reduce on the arena.
//!
//! Small all-reduces are one-shot (one phase; every rank reduces all slots). Large ones are
//! chunked and two-phase: each rank reduces its 1/N of the chunk from every slot, publishes
//! the result, and every rank copies the others' reduced parts. Where one becomes the other
//! is measured by the first all-reduce ([`crate::collectives::tuning`]).

use std::time::Instant;

use super::ArenaComm;
use crate::collectives::{comm_threads, tuning};
use crate::dtype::DType;
use crate::error::Result;
use crate::memcpy::{copy_piece_to_shared, reduce_piece_to_shared};
use crate::reduce::{self, ReduceOp};
use crate::signature::OpSig;

/// How an all-reduce runs on the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllReduceAlgo {
    /// One phase: every rank publishes its input and reduces every rank's slot.
    OneShot,
    /// Chunked reduce-scatter then all-gather through the slots (on the helpers when large).
    TwoPhase,
}

/// Splits `len` bytes of `es`-byte elements into `n` nearly equal parts; part `i`'s range.
pub(super) fn part(len: usize, es: usize, n: usize, i: usize) -> (usize, usize) {
    let elems = len / es;
    let base = elems / n;
    let rem = elems % n;
    let lo = i * base + i.min(rem);
    let hi = lo + base + usize::from(i < rem);
    (lo * es, hi * es)
}

impl ArenaComm {
    /// In-place all-reduce of `buf`; with `only_root`, only that local index gets the result.
    /// `algo`: `None` chooses by size (one-shot up to [`ArenaComm::oneshot_bytes`]); a given
    /// one must be the same on every rank, and a one-shot `buf` must fit a slot. Both add in
    /// rank order, so both give the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        algo: Option<AllReduceAlgo>,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        only_root: Option<usize>,
        deadline: Instant,
    ) -> Result<()> {
        let algo = match algo {
            Some(algo) => algo,
            None => {
                if std::mem::take(&mut self.tune_oneshot) {
                    tuning::tune_oneshot(self, sig, deadline)?;
                }
                if let Some(place) = only_root
                    .is_none()
                    .then(|| self.symmetric_place(buf))
                    .flatten()
                {
                    let len = buf.len();
                    return self.with_comm_threads(len, |c, ways| {
                        c.all_reduce_symmetric(place, len, dtype, op, sig, deadline, ways)
                    });
                }
                if buf.len() <= self.oneshot_bytes.min(self.arena.slot_bytes()) {
                    AllReduceAlgo::OneShot
                } else {
                    AllReduceAlgo::TwoPhase
                }
            }
        };
        if algo == AllReduceAlgo::TwoPhase {
            return self.with_comm_threads(buf.len(), |c, ways| {
                c.all_reduce_chunked(buf, dtype, op, sig, only_root, deadline, ways)
            });
        }
        let (n, me) = (self.n(), self.arena.me());
        let total = buf.len();
        debug_assert!(total <= self.arena.slot_bytes());
        let parity = self.step(sig, Some(0), deadline, |s| s[..total].copy_from_slice(buf))?;
        if !self.symmetric.is_empty() {
            self.check_place_word(parity, 0, sig)?;
        }
        if only_root.is_none_or(|r| r == me) {
            let srcs: Vec<&[u8]> = (0..n)
                .map(|r| &self.arena.slot(r, parity)[..total])
                .collect();
            reduce::reduce_slices(buf, &srcs, dtype, op);
        }
        Ok(())
    }

    /// The chunked two-phase all-reduce, each memory pass split `ways` ways.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_chunked(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        only_root: Option<usize>,
        deadline: Instant,
        ways: usize,
    ) -> Result<()> {
        let (n, me, es) = (self.n(), self.arena.me(), dtype.size());
        let total = buf.len();
        let slot = self.arena.slot_bytes();
        let chunk = slot - slot % (es * 64);
        let mut off = 0;
        let mut first = true;
        while first || off < total {
            let len = chunk.min(total - off);
            let (lo, hi) = part(len, es, n, me);
            let src = &buf[off..off + len];
            // Peers need every part of this chunk but ours, which only we reduce. Split over
            // helpers, the copies stay ordinary: streaming stores send every line to DRAM
            // and back, which 4 threads per rank cannot afford (measured on a 16-core host:
            // 2-rank 64 MiB all_reduce 10.4 ms streamed, 7.1 ms not).
            let (stream_lo, stream_hi) = (
                ways == 1 && self.stream.streams_to_shared(lo),
                ways == 1 && self.stream.streams_to_shared(len - hi),
            );
            let parity = self.step(sig, first.then_some(0), deadline, |s| {
                // The two runs around our part, each split over the helpers.
                let (head, rest) = s[..len].split_at_mut(lo);
                let tail = &mut rest[hi - lo..];
                let runs = vec![(head, 0, stream_lo), (tail, hi, stream_hi)];
                comm_threads::each(runs, ways, |_, (dst, at, stream)| {
                    let from = &src[at..at + dst.len()];
                    comm_threads::copy(dst, from, ways, |d, s| copy_piece_to_shared(d, s, stream));
                });
            })?;
            if first && !self.symmetric.is_empty() {
                self.check_place_word(parity, 0, sig)?;
            }
            first = false;
            // Reduce our part straight into the slot of the next phase: it was last read in
            // the previous phase, which every rank finished before posting this one.
            let next = 1 - parity;
            {
                let arena = &*self.arena;
                let srcs: Vec<&[u8]> = (0..n)
                    .map(|r| {
                        if r == me {
                            &src[lo..hi]
                        } else {
                            &arena.slot(r, parity)[lo..hi]
                        }
                    })
                    .collect();
                let stream = ways == 1 && self.stream.reduction_streams_to_shared(hi - lo);
                comm_threads::reduce(&mut arena.my_slot(next)[lo..hi], &srcs, ways, |d, ss| {
                    reduce_piece_to_shared(d, ss, dtype, op, stream);
                });
            }
            let parity = self.step(sig, None, deadline, |_| {})?;
            debug_assert_eq!(parity, next);
            if only_root.is_none_or(|r| r == me) {
                let arena = &*self.arena;
                let slots: Vec<&[u8]> = (0..n).map(|r| arena.slot(r, parity)).collect();
                comm_threads::split(&mut buf[off..off + len], ways, |a, d| {
                    let b = a + d.len();
                    for (r, slot) in slots.iter().enumerate() {
                        let (lo, hi) = part(len, es, n, r);
                        let (x, y) = (lo.max(a), hi.min(b));
                        if x < y {
                            d[x - a..y - a].copy_from_slice(&slot[x..y]);
                        }
                    }
                });
            }
            off += len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_range_without_overlap() {
        for len_elems in [0usize, 1, 5, 7, 64, 1001] {
            for n in 1..6 {
                let mut next = 0;
                for i in 0..n {
                    let (lo, hi) = part(len_elems * 4, 4, n, i);
                    assert_eq!(lo, next);
                    assert!(hi >= lo && (hi - lo) % 4 == 0);
                    next = hi;
                }
                assert_eq!(next, len_elems * 4);
            }
        }
    }
}
