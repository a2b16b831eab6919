//! Ring reduce-scatter / all-gather / all-reduce over any [`P2p`].
//!
//! Conventions shared with [`super::direct`]: `members` lists the ranks taking part, in ring
//! order; this rank is the member equal to `p.rank()`. Buffers are bytes holding whole `dtype`
//! elements. Every message carries the caller's `sig`; every call honours `deadline`.
//!
//! Large buffers go around the ring in `n - 1` reduce-scatter steps and `n - 1` all-gather
//! steps, each block moved in chunks so scratch stays small; blocks may differ by one element
//! (any element count works, zero included). Buffers up to [`RingOpts::small_bytes`] take a
//! latency path instead: every member exchanges its whole buffer with every other one and
//! reduces locally, in member order, so every rank ends with bitwise identical results.

use std::ops::Range;
use std::time::Instant;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::{premultiplied_avg, reduce_into, reduce_slices, scale, ReduceOp};
use crate::signature::OpSig;
use crate::transport::p2p::P2p;

/// Tuning for the ring algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingOpts {
    /// Buffers of at most this many bytes take the one-round latency path.
    pub small_bytes: usize,
    /// Largest piece moved per ring step (rounded down to whole elements).
    pub chunk_bytes: usize,
}

impl Default for RingOpts {
    fn default() -> Self {
        RingOpts {
            small_bytes: 64 * 1024,
            chunk_bytes: 1 << 20,
        }
    }
}

/// Ring collectives with reusable scratch buffers.
#[derive(Debug, Default)]
pub struct Ring {
    opts: RingOpts,
    scratch: Vec<u8>,
    work: Vec<u8>,
}

/// Index of this rank in `members`, or an error naming the op.
pub(crate) fn position(rank: usize, members: &[usize], sig: &OpSig) -> Result<usize> {
    members.iter().position(|&m| m == rank).ok_or_else(|| {
        Error::invalid(format!(
            "rank {rank} called {sig} on a group it is not a member of ({members:?})"
        ))
    })
}

/// Byte ranges of `counts[i]` elements each, laid end to end.
fn ranges(counts: impl Iterator<Item = usize>, size: usize) -> Vec<Range<usize>> {
    let mut at = 0;
    counts
        .map(|c| {
            let r = at..at + c * size;
            at = r.end;
            r
        })
        .collect()
}

/// `count` elements split into `n` blocks that differ by at most one element.
fn even_blocks(count: usize, n: usize, size: usize) -> Vec<Range<usize>> {
    ranges((0..n).map(|i| count / n + usize::from(i < count % n)), size)
}

/// Piece `c` of `r` in chunks of `chunk` bytes, if there is one.
fn piece(r: &Range<usize>, c: usize, chunk: usize) -> Option<Range<usize>> {
    let start = r.start + c * chunk;
    (start < r.end).then(|| start..(start + chunk).min(r.end))
}

/// A shared view of `s` and a mutable view of `r`, two disjoint ranges of `buf`.
fn split_pair(buf: &mut [u8], s: Range<usize>, r: Range<usize>) -> (&[u8], &mut [u8]) {
    if s.end <= r.start {
        let (a, b) = buf.split_at_mut(r.start);
        (&a[s], &mut b[..r.len()])
    } else {
        assert!(r.end <= s.start, "ring blocks overlap");
        let (a, b) = buf.split_at_mut(s.start);
        (&b[..s.len()], &mut a[r])
    }
}

impl Ring {
    /// Ring collectives tuned by `opts`.
    pub fn new(opts: RingOpts) -> Self {
        Ring {
            opts,
            scratch: Vec::new(),
            work: Vec::new(),
        }
    }

    fn chunk(&self, dtype: DType) -> usize {
        (self.opts.chunk_bytes / dtype.size()).max(1) * dtype.size()
    }

    /// Reduce-scatter in place over `blocks`: afterwards member `me` holds the reduction of block
    /// `(me + shift) % n` (avg still unscaled).
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_in_place<P: P2p>(
        &mut self,
        p: &mut P,
        members: &[usize],
        me: usize,
        buf: &mut [u8],
        blocks: &[Range<usize>],
        shift: usize,
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let n = members.len();
        let (right, left) = (members[(me + 1) % n], members[(me + n - 1) % n]);
        let chunk = self.chunk(dtype);
        self.scratch.resize(chunk.min(buf.len()), 0);
        for s in 0..n - 1 {
            let sb = (me + 2 * n + shift - 1 - s) % n;
            let (sr, rr) = (&blocks[sb], &blocks[(sb + n - 1) % n]);
            for c in 0..sr.len().div_ceil(chunk).max(rr.len().div_ceil(chunk)) {
                match (piece(sr, c, chunk), piece(rr, c, chunk)) {
                    (Some(sp), Some(rp)) => {
                        let tmp = &mut self.scratch[..rp.len()];
                        p.exchange(right, &buf[sp], left, tmp, sig, deadline)?;
                        reduce_into(&mut buf[rp], tmp, dtype, op);
                    }
                    (Some(sp), None) => p.send(right, sig, &buf[sp], deadline)?,
                    (None, Some(rp)) => {
                        let tmp = &mut self.scratch[..rp.len()];
                        p.recv(left, sig, tmp, deadline)?;
                        reduce_into(&mut buf[rp], tmp, dtype, op);
                    }
                    (None, None) => {}
                }
            }
        }
        Ok(())
    }

    /// All-gather in place over `blocks`, member `me` starting with block `(me + shift) % n`.
    #[allow(clippy::too_many_arguments)]
    fn all_gather_in_place<P: P2p>(
        &self,
        p: &mut P,
        members: &[usize],
        me: usize,
        buf: &mut [u8],
        blocks: &[Range<usize>],
        shift: usize,
        dtype: DType,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let n = members.len();
        let (right, left) = (members[(me + 1) % n], members[(me + n - 1) % n]);
        let chunk = self.chunk(dtype);
        for s in 0..n - 1 {
            let sb = (me + 2 * n + shift - s) % n;
            let (sr, rr) = (&blocks[sb], &blocks[(sb + n - 1) % n]);
            for c in 0..sr.len().div_ceil(chunk).max(rr.len().div_ceil(chunk)) {
                match (piece(sr, c, chunk), piece(rr, c, chunk)) {
                    (Some(sp), Some(rp)) => {
                        let (out, into) = split_pair(buf, sp, rp);
                        p.exchange(right, out, left, into, sig, deadline)?;
                    }
                    (Some(sp), None) => p.send(right, sig, &buf[sp], deadline)?,
                    (None, Some(rp)) => p.recv(left, sig, &mut buf[rp], deadline)?,
                    (None, None) => {}
                }
            }
        }
        Ok(())
    }

    /// Every member exchanges `block(j)` with member j and reduces what arrives in member order
    /// into `out`; `own` is this member's contribution.
    #[allow(clippy::too_many_arguments)]
    fn direct_reduce<'a, P: P2p>(
        &mut self,
        p: &mut P,
        members: &[usize],
        me: usize,
        out: &mut [u8],
        block: impl Fn(usize) -> &'a [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let (n, len) = (members.len(), out.len());
        self.scratch.resize(n * len, 0);
        self.scratch[me * len..(me + 1) * len].copy_from_slice(block(me));
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            let dst = &mut self.scratch[from * len..(from + 1) * len];
            p.exchange(members[to], block(to), members[from], dst, sig, deadline)?;
        }
        let srcs: Vec<&[u8]> = self.scratch.chunks_exact(len.max(1)).take(n).collect();
        if len > 0 {
            reduce_slices(out, &srcs, dtype, op);
        }
        Ok(())
    }

    /// Reduces `buf` across `members` in place; every member ends with the result.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce<P: P2p>(
        &mut self,
        p: &mut P,
        members: &[usize],
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let me = position(p.rank(), members, sig)?;
        let count = dtype.count_of(buf.len(), "all_reduce")?;
        op.validate(dtype)?;
        let n = members.len();
        if n == 1 {
            return Ok(());
        }
        if buf.len() <= self.opts.small_bytes {
            let own = buf.to_vec();
            return self.direct_reduce(p, members, me, buf, |_| &own, dtype, op, sig, deadline);
        }
        let blocks = even_blocks(count, n, dtype.size());
        let premul = premultiplied_avg(dtype, op);
        if premul {
            scale(buf, dtype, n); // the result overwrites it: scaled in place
        }
        let sum = if premul { ReduceOp::Sum } else { op };
        self.reduce_scatter_in_place(p, members, me, buf, &blocks, 1, dtype, sum, sig, deadline)?;
        if sum == ReduceOp::Avg {
            scale(&mut buf[blocks[(me + 1) % n].clone()], dtype, n);
        }
        self.all_gather_in_place(p, members, me, buf, &blocks, 1, dtype, sig, deadline)
    }

    /// Reduces `inp` (one equal block per member, in member order) across `members`; member i
    /// ends with block i of the result in `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter<P: P2p>(
        &mut self,
        p: &mut P,
        members: &[usize],
        out: &mut [u8],
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let me = position(p.rank(), members, sig)?;
        let n = members.len();
        let count = dtype.count_of(out.len(), "reduce_scatter")?;
        op.validate(dtype)?;
        if inp.len() != n * out.len() {
            return Err(Error::invalid(format!(
                "rank {}: {sig} needs an input of {} x {} bytes for {n} members, got {} bytes",
                p.rank(),
                n,
                out.len(),
                inp.len()
            )));
        }
        let blocks = ranges(std::iter::repeat_n(count, n), dtype.size());
        if n == 1 {
            out.copy_from_slice(inp);
            return Ok(());
        }
        if inp.len() <= self.opts.small_bytes {
            let block = |j: usize| &inp[blocks[j].clone()];
            return self.direct_reduce(p, members, me, out, block, dtype, op, sig, deadline);
        }
        let mut work = std::mem::take(&mut self.work);
        work.clear();
        work.extend_from_slice(inp);
        let premul = premultiplied_avg(dtype, op);
        if premul {
            scale(&mut work, dtype, n); // a copy: the input stays as it was
        }
        let sum = if premul { ReduceOp::Sum } else { op };
        let r = self.reduce_scatter_in_place(
            p, members, me, &mut work, &blocks, 0, dtype, sum, sig, deadline,
        );
        out.copy_from_slice(&work[blocks[me].clone()]);
        self.work = work;
        r?;
        if sum == ReduceOp::Avg {
            scale(out, dtype, n);
        }
        Ok(())
    }

    /// Concatenates every member's `inp` (member i holds `counts[i]` elements) into `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_gather<P: P2p>(
        &mut self,
        p: &mut P,
        members: &[usize],
        out: &mut [u8],
        inp: &[u8],
        counts: &[usize],
        dtype: DType,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let me = position(p.rank(), members, sig)?;
        let n = members.len();
        let total: usize = counts.iter().sum();
        if counts.len() != n
            || total * dtype.size() != out.len()
            || counts[me] * dtype.size() != inp.len()
        {
            return Err(Error::invalid(format!(
                "rank {}: {sig} got counts {counts:?} for {n} members, an input of {} bytes and an \
                 output of {} bytes ({dtype}); the output must hold every member's input",
                p.rank(),
                inp.len(),
                out.len()
            )));
        }
        let blocks = ranges(counts.iter().copied(), dtype.size());
        out[blocks[me].clone()].copy_from_slice(inp);
        if n == 1 {
            return Ok(());
        }
        self.all_gather_in_place(p, members, me, out, &blocks, 0, dtype, sig, deadline)
    }
}

/// [`Ring::all_reduce`] with default options.
#[allow(clippy::too_many_arguments)]
pub fn all_reduce<P: P2p>(
    p: &mut P,
    members: &[usize],
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Ring::default().all_reduce(p, members, buf, dtype, op, sig, deadline)
}

/// [`Ring::reduce_scatter`] with default options.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    dtype: DType,
    op: ReduceOp,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Ring::default().reduce_scatter(p, members, out, inp, dtype, op, sig, deadline)
}

/// [`Ring::all_gather`] with default options.
#[allow(clippy::too_many_arguments)]
pub fn all_gather<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    counts: &[usize],
    dtype: DType,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Ring::default().all_gather(p, members, out, inp, counts, dtype, sig, deadline)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_ragged_counts() {
        for count in 0..20 {
            for n in 1..6 {
                let b = even_blocks(count, n, 4);
                assert_eq!(b.len(), n);
                assert_eq!(b.last().unwrap().end, count * 4);
                assert!(b.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(piece(&(10..25), 1, 10), Some(20..25));
        assert_eq!(piece(&(10..25), 2, 10), None);
    }

    #[test]
    fn split_pair_either_order() {
        let mut b: Vec<u8> = (0..10).collect();
        let (s, r) = split_pair(&mut b, 6..8, 1..3);
        assert_eq!(s, &[6, 7]);
        r.copy_from_slice(&[0, 0]);
        let (s, r) = split_pair(&mut b, 0..2, 4..5);
        assert_eq!((s, r.len()), (&[0u8, 0][..], 1));
    }
}
