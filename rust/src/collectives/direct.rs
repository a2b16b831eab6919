//! Rooted ops, all-to-all and barrier over any [`P2p`].
//!
//! Conventions as in [`super::ring`]: `members` lists the ranks taking part; this rank is the
//! member equal to `p.rank()`; `root` is an index into `members` (the group rank of the root,
//! as torch.distributed's group-relative `src`/`dst`). Every message carries `sig`.
//!
//! - broadcast: binomial tree; buffers of at least [`CHAIN_BYTES`] on more than two members
//!   flow down a pipelined chain in [`CHUNK_BYTES`] pieces instead;
//! - reduce: binomial tree towards the root (avg is scaled once at the root);
//! - gather / scatter: the root talks to every member directly (equal blocks);
//! - all_to_all: pairwise exchange, step k talks to members `me + k` and `me - k`;
//! - barrier: dissemination, `ceil(log2 n)` rounds of zero-byte messages.

use std::time::Instant;

use super::ring::position;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::{premultiplied_avg, reduce_into, scale, ReduceOp};
use crate::signature::OpSig;
use crate::transport::p2p::P2p;

/// Broadcasts of at least this many bytes use the pipelined chain.
pub const CHAIN_BYTES: usize = 256 * 1024;
/// Piece size of the pipelined chain.
pub const CHUNK_BYTES: usize = 256 * 1024;

fn check_root(rank: usize, members: &[usize], root: usize, sig: &OpSig) -> Result<()> {
    if root >= members.len() {
        return Err(Error::invalid(format!(
            "rank {rank}: {sig} names root {root}, but the group has only {} members",
            members.len()
        )));
    }
    Ok(())
}

fn check_len(rank: usize, sig: &OpSig, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::invalid(format!(
            "rank {rank}: {sig} needs {what} of {want} bytes, got {got}"
        )));
    }
    Ok(())
}

/// Copies the root member's `buf` into every member's `buf`.
pub fn broadcast<P: P2p>(
    p: &mut P,
    members: &[usize],
    buf: &mut [u8],
    root: usize,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    let me = position(p.rank(), members, sig)?;
    check_root(p.rank(), members, root, sig)?;
    let n = members.len();
    let vr = (me + n - root) % n;
    let member = |v: usize| members[(v + root) % n];
    if n > 2 && buf.len() >= CHAIN_BYTES {
        for start in (0..buf.len()).step_by(CHUNK_BYTES) {
            let piece = start..(start + CHUNK_BYTES).min(buf.len());
            if vr > 0 {
                p.recv(member(vr - 1), sig, &mut buf[piece.clone()], deadline)?;
            }
            if vr + 1 < n {
                p.send(member(vr + 1), sig, &buf[piece], deadline)?;
            }
        }
        return Ok(());
    }
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            p.recv(member(vr - mask), sig, buf, deadline)?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n && vr & mask == 0 {
            p.send(member(vr + mask), sig, buf, deadline)?;
        }
        mask >>= 1;
    }
    Ok(())
}

/// Reduces every member's `buf` into the root's `buf`; other members' buffers are unchanged.
#[allow(clippy::too_many_arguments)]
pub fn reduce<P: P2p>(
    p: &mut P,
    members: &[usize],
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    let me = position(p.rank(), members, sig)?;
    check_root(p.rank(), members, root, sig)?;
    dtype.count_of(buf.len(), "reduce")?;
    op.validate(dtype)?;
    let n = members.len();
    let vr = (me + n - root) % n;
    let member = |v: usize| members[(v + root) % n];
    let mut acc: Option<Vec<u8>> = None;
    let premul = premultiplied_avg(dtype, op);
    if premul {
        // Each member's share of the mean, summed up the tree (other members' buffers stay)
        let target = if vr == 0 {
            &mut *buf
        } else {
            acc.get_or_insert_with(|| buf.to_vec())
        };
        scale(target, dtype, n);
    }
    let op = if premul { ReduceOp::Sum } else { op };
    let mut scratch = Vec::new();
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            let data = acc.as_deref().unwrap_or(buf);
            p.send(member(vr - mask), sig, data, deadline)?;
            break;
        }
        if vr + mask < n {
            scratch.resize(buf.len(), 0);
            p.recv(member(vr + mask), sig, &mut scratch, deadline)?;
            let target = if vr == 0 {
                &mut *buf
            } else {
                acc.get_or_insert_with(|| buf.to_vec())
            };
            reduce_into(target, &scratch, dtype, op);
        }
        mask <<= 1;
    }
    if vr == 0 && op == ReduceOp::Avg {
        scale(buf, dtype, n);
    }
    Ok(())
}

/// The root's `out` receives every member's `inp` (equal sizes), in member order; `out` is
/// ignored on other members.
pub fn gather<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    root: usize,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    let me = position(p.rank(), members, sig)?;
    check_root(p.rank(), members, root, sig)?;
    let len = inp.len();
    if me != root {
        return p.send(members[root], sig, inp, deadline);
    }
    check_len(p.rank(), sig, "an output", out.len(), len * members.len())?;
    for (i, block) in out
        .chunks_exact_mut(len.max(1))
        .enumerate()
        .take(members.len())
    {
        if i == me {
            block.copy_from_slice(inp);
        } else {
            p.recv(members[i], sig, block, deadline)?;
        }
    }
    if len == 0 {
        for (i, &m) in members.iter().enumerate() {
            if i != me {
                p.recv(m, sig, &mut [], deadline)?;
            }
        }
    }
    Ok(())
}

/// Member i's `out` receives block i of the root's `inp` (equal blocks); `inp` is ignored on
/// other members.
pub fn scatter<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    root: usize,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    let me = position(p.rank(), members, sig)?;
    check_root(p.rank(), members, root, sig)?;
    let len = out.len();
    if me != root {
        return p.recv(members[root], sig, out, deadline);
    }
    check_len(p.rank(), sig, "an input", inp.len(), len * members.len())?;
    for (i, &m) in members.iter().enumerate() {
        let block = &inp[i * len..(i + 1) * len];
        if i == me {
            out.copy_from_slice(block);
        } else {
            p.send(m, sig, block, deadline)?;
        }
    }
    Ok(())
}

/// Block j of this member's `inp` goes to member j, whose `out` block i receives it (equal
/// blocks: `inp.len() == out.len()`, a multiple of the member count).
pub fn all_to_all<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    let me = position(p.rank(), members, sig)?;
    let n = members.len();
    check_len(p.rank(), sig, "an output", out.len(), inp.len())?;
    let unit = sig.dtype.size() * n;
    if inp.len() % unit != 0 {
        return Err(Error::invalid(format!(
            "rank {}: {sig} splits {} bytes into {n} equal blocks of {} elements; the size must be \
             a multiple of {n} elements",
            p.rank(),
            inp.len(),
            sig.dtype
        )));
    }
    let b = inp.len() / n;
    out[me * b..(me + 1) * b].copy_from_slice(&inp[me * b..(me + 1) * b]);
    for k in 1..n {
        let (to, from) = ((me + k) % n, (me + n - k) % n);
        let dst = &mut out[from * b..(from + 1) * b];
        p.exchange(
            members[to],
            &inp[to * b..(to + 1) * b],
            members[from],
            dst,
            sig,
            deadline,
        )?;
    }
    Ok(())
}

/// Returns once every member has entered the barrier.
pub fn barrier<P: P2p>(p: &mut P, members: &[usize], sig: &OpSig, deadline: Instant) -> Result<()> {
    let me = position(p.rank(), members, sig)?;
    let n = members.len();
    let mut k = 1;
    while k < n {
        p.exchange(
            members[(me + k) % n],
            &[],
            members[(me + n - k) % n],
            &mut [],
            sig,
            deadline,
        )?;
        k <<= 1;
    }
    Ok(())
}
