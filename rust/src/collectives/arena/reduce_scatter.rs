//! Reduce-scatter on the arena, from the slots or from symmetric memory, rank by rank.
//!
//! Every rank's input holds N equal blocks; rank `i` reduces block `i` of every input into
//! its output, in rank order. A rank whose input is in symmetric memory publishes where it is
//! (its place word, with the op's first phase) and copies nothing; the others copy their
//! inputs through the slots, a chunk per phase, as before. Readers take each rank's chunk
//! from where that rank said: so ranks need not agree on whether, or where, their inputs are
//! in symmetric memory (ZeRO-2/3 with symmetric=True draws gradient buffers from a pool). When
//! every input is in symmetric memory, each rank reduces its whole block at once. A rank
//! whose input was read in place may reuse it only once every reader is done: one phase more
//! at the end, when any input was.

use std::time::Instant;

use super::symmetric::Base;
use super::{piece_bytes, ArenaComm};
use crate::collectives::comm_threads;
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::signature::OpSig;

impl ArenaComm {
    /// Reduce-scatter: `inp` holds n equal blocks; this rank's reduced block goes to `out`.
    pub fn reduce_scatter(
        &mut self,
        out: &mut [u8],
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        self.with_comm_threads(inp.len(), |c, ways| {
            c.reduce_scatter_ways(out, inp, dtype, op, sig, deadline, ways)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_ways(
        &mut self,
        out: &mut [u8],
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
        ways: usize,
    ) -> Result<()> {
        let (n, me) = (self.n(), self.arena.me());
        let block = out.len();
        let piece = piece_bytes(self.arena.slot_bytes(), n, dtype.size());
        let place = self.symmetric_place(inp);
        let word = place.map_or(0, |p| p.word());
        // Each rank's input where it is in symmetric memory (`None`: through the slots).
        let mut sources: Vec<Option<Base>> = Vec::new();
        let mut off = 0;
        let mut first = true;
        while first || off < block {
            let len = piece.min(block - off);
            let parity = self.step(sig, first.then_some(word), deadline, |s| {
                if place.is_some() {
                    return; // read where it is
                }
                // Destination d's piece goes to [d * piece, d * piece + len) of the slot.
                comm_threads::split(&mut s[..n * piece], ways, |a, dst| {
                    let b = a + dst.len();
                    for d in 0..n {
                        let (x, y) = ((d * piece).max(a), (d * piece + len).min(b));
                        if x < y {
                            let from = d * block + off + x - d * piece;
                            dst[x - a..y - a].copy_from_slice(&inp[from..from + y - x]);
                        }
                    }
                });
            })?;
            if first {
                for r in 0..n {
                    let (_, theirs) = self.arena.sig_of(r, parity)?;
                    sources.push(self.base_of_word(r, theirs, inp.len(), sig)?);
                }
                if sources.iter().all(Option::is_some) {
                    return self
                        .reduce_scatter_in_place(&sources, out, dtype, op, sig, deadline, ways);
                }
            }
            first = false;
            let arena = &*self.arena;
            let srcs: Vec<&[u8]> = sources
                .iter()
                .enumerate()
                .map(|(r, src)| match src {
                    // SAFETY: `base_of_word` checked that rank r's input (`inp.len()` bytes,
                    // the same on every rank) lies inside its segment, which this rank maps;
                    // rank r writes none of it before the op's last phase, which follows
                    // this read.
                    Some(base) => unsafe {
                        std::slice::from_raw_parts(base.0.add(me * block + off), len)
                    },
                    None => &arena.slot(r, parity)[me * piece..me * piece + len],
                })
                .collect();
            comm_threads::reduce(&mut out[off..off + len], &srcs, ways, |d, ss| {
                reduce::reduce_slices(d, ss, dtype, op);
            });
            off += len;
        }
        if sources.iter().any(Option::is_some) {
            self.step(sig, None, deadline, |_| {})?; // every reader is done with the inputs
        }
        Ok(())
    }

    /// Every input is in symmetric memory: this rank's whole block from each, then one phase
    /// so that no rank reuses its input while another still reads it.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_in_place(
        &mut self,
        sources: &[Option<Base>],
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
        ways: usize,
    ) -> Result<()> {
        let at = self.arena.me() * out.len();
        let bases: Vec<Base> = sources.iter().flatten().copied().collect();
        comm_threads::split(out, ways, |a, dst| {
            // SAFETY: as in `reduce_scatter_ways`: each base starts an input of `n * block`
            // bytes inside its rank's segment, unwritten until the phase below, and `dst` is
            // this rank's private output.
            let srcs: Vec<&[u8]> = bases
                .iter()
                .map(|p| unsafe { std::slice::from_raw_parts(p.0.add(at + a), dst.len()) })
                .collect();
            reduce::reduce_slices(dst, &srcs, dtype, op);
        });
        self.step(sig, None, deadline, |_| {})?;
        Ok(())
    }
}
