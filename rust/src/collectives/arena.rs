//! Every collective on the shared-memory arena of one host.
//!
//! The protocol is a sequence of *phases*. In phase k a rank fills its slot `k % 2`, posts k,
//! waits until every rank posted k, then reads whatever slots it needs. Because a rank posts
//! k+1 only after it finished reading the slots of phase k, and writes slot `k % 2` again only
//! in phase k+2 (after seeing everyone post k+1), two slots per rank are enough and no barrier
//! is ever added. Every op's first phase also publishes the op's signature, which every rank
//! compares with everybody else's before touching data.
//!
//! Small all-reduces are one-shot (one phase; every rank reduces all slots). Large ones are
//! chunked and two-phase: each rank reduces its 1/N of the chunk from every slot, publishes
//! the result, and every rank copies the others' reduced parts.
//!
//! All-reduces and reduce-scatters of at least `cma_bytes` read their inputs in place where
//! the ranks may read each other's memory (`process_vm_readv`, see
//! [`crate::transport::cma`]): the first phase publishes the address of each rank's buffer,
//! each rank reads its part of every peer's input straight into the reduction, and the inputs
//! are never copied into the arena. Every rank reads distinct pages of a peer: ops where many
//! ranks would read the same pages (broadcast, all-gather) stay on the slots, because pinning
//! shared pages from many processes serialises in the kernel (measured: 3-10x slower at 8-16
//! ranks). Whether the ranks may read each other is decided together, at the first such op:
//! every rank tries to read every peer, then all publish the outcome and use the single-copy
//! path only if every rank succeeded.

use std::time::Instant;

use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::memcpy::{copy_to_shared, reduce_to_shared};
use crate::op::OpSig;
use crate::reduce::{self, ReduceOp};
use std::sync::Arc;

use crate::transport::cma;
use crate::transport::shm::{pid_alive, Arena};

/// Default size up to which all-reduce is one-shot.
pub const DEFAULT_ONESHOT_BYTES: usize = 256 * 1024;

/// Default size from which ops read peers' buffers directly (0 turns that off).
pub const DEFAULT_CMA_BYTES: usize = 1 << 20;

/// Bytes of scratch a single-copy reduction stages peers' pieces in (all ranks together),
/// and the smallest piece: a read of less than a few hundred KiB costs more in the kernel
/// (pinning the peer's pages) than it copies.
const CMA_SCRATCH_BYTES: usize = 4 << 20;
const CMA_MIN_PIECE: usize = 256 << 10;

/// Protocol words published with an op's first phase.
const PROTO_SLOTS: u32 = 0;
const PROTO_CMA: u32 = 1;

/// The arena plus the phase counter.
pub struct ArenaComm {
    arena: Arc<Arena>,
    phase: u32,
    oneshot_bytes: usize,
    cma_bytes: usize,
    /// Whether every rank may read every other's memory: `None` until the first op that
    /// would (all ranks decide at the same op, so they always agree).
    cma: Option<bool>,
    /// Report a failed probe whatever it finds (to test the fallback).
    cma_refuse: bool,
    scratch: Vec<u8>,
}

/// Splits `len` bytes of `es`-byte elements into `n` nearly equal parts; part `i`'s range.
fn part(len: usize, es: usize, n: usize, i: usize) -> (usize, usize) {
    let elems = len / es;
    let base = elems / n;
    let rem = elems % n;
    let lo = i * base + i.min(rem);
    let hi = lo + base + usize::from(i < rem);
    (lo * es, hi * es)
}

/// Bytes of a per-destination piece when a slot is split `n` ways (element and cache aligned).
fn piece_bytes(slot: usize, n: usize, es: usize) -> usize {
    let p = slot / n;
    let p = p - p % 64.max(es);
    p.max(es)
}

impl ArenaComm {
    /// Wraps a mapped arena; ops of at least `cma_bytes` go single-copy where allowed
    /// (0: never); with `cma_refuse` this rank acts as if it were not allowed.
    pub fn new(
        arena: Arc<Arena>,
        oneshot_bytes: usize,
        cma_bytes: usize,
        cma_refuse: bool,
    ) -> Self {
        if cma_bytes > 0 {
            cma::allow_siblings();
        }
        ArenaComm {
            arena,
            phase: 0,
            oneshot_bytes,
            cma_bytes,
            cma: (cma_bytes == 0).then_some(false),
            cma_refuse,
            scratch: Vec::new(),
        }
    }

    /// Whether ops of at least the threshold read peers' memory directly (`None`: not
    /// decided yet, no op was large enough).
    pub fn single_copy(&self) -> Option<bool> {
        self.cma
    }

    /// The arena.
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Ranks on the arena.
    pub fn n(&self) -> usize {
        self.arena.ranks()
    }

    /// One phase: `fill` writes this rank's slot, then every rank's publication is awaited.
    /// With `publish`, the signature (and the extra word) is published and compared first.
    fn step(
        &mut self,
        sig: &OpSig,
        publish: Option<u64>,
        deadline: Instant,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<usize> {
        self.step_with(sig, publish.map(|e| (e, 0, PROTO_SLOTS)), deadline, fill)
    }

    /// [`Self::step`] publishing (extra, buffer address, protocol), all compared across ranks.
    fn step_with(
        &mut self,
        sig: &OpSig,
        publish: Option<(u64, u64, u32)>,
        deadline: Instant,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<usize> {
        let k = self.phase.wrapping_add(1);
        let parity = (k % 2) as usize;
        fill(self.arena.my_slot(parity));
        if let Some((extra, addr, proto)) = publish {
            self.arena.set_sig(parity, sig, extra);
            self.arena.set_addr(parity, addr, proto);
        }
        self.arena.post(k);
        self.phase = k;
        self.arena.wait_all(k, deadline, sig)?;
        if publish.is_some() {
            let mine = sig;
            let me = self.arena.me();
            for r in 0..self.n() {
                if r != me {
                    let (theirs, _) = self.arena.sig_of(r, parity)?;
                    mine.check_against(self.arena.global(me), &theirs, self.arena.global(r))?;
                }
            }
            let my_proto = self.arena.addr_of(me, parity).1;
            for r in 0..self.n() {
                let proto = self.arena.addr_of(r, parity).1;
                if proto != my_proto {
                    let (cma, slots) = if my_proto == PROTO_CMA {
                        (me, r)
                    } else {
                        (r, me)
                    };
                    return Err(Error::new(
                        ErrorKind::Mismatch,
                        format!(
                            "rank {} reads peers' memory directly in {sig} but rank {} copies \
                             through shared memory: the ranks were started with different \
                             SHARDLINE_CMA_BYTES; set it equally on every rank",
                            self.arena.global(cma),
                            self.arena.global(slots)
                        ),
                    ));
                }
            }
        }
        Ok(parity)
    }

    /// Whether an op moving `bytes` (the same number on every rank) goes single-copy.
    fn wants_cma(&self, bytes: usize) -> bool {
        self.cma != Some(false) && bytes >= self.cma_bytes && self.n() > 1
    }

    /// The first phase of a single-copy op: publishes the signature, `extra` and the address
    /// of this rank's buffer; at the communicator's first such op, also decides with every
    /// rank whether single-copy reads work. Returns every rank's (address, extra), or `None`
    /// when the ranks must use the slots instead (then every rank returns `None` here).
    fn cma_begin(
        &mut self,
        sig: &OpSig,
        extra: u64,
        addr: *const u8,
        deadline: Instant,
    ) -> Result<Option<Vec<(u64, u64)>>> {
        let p1 = self.step_with(sig, Some((extra, addr as u64, PROTO_CMA)), deadline, |_| {})?;
        // Read now: a rank writes this parity again two phases on, which the probe phase
        // below would allow.
        let mut words = Vec::with_capacity(self.n());
        for r in 0..self.n() {
            words.push((self.arena.addr_of(r, p1).0, self.arena.sig_of(r, p1)?.1));
        }
        if self.cma.is_none() {
            let me = self.arena.me();
            let ok = !self.cma_refuse
                && (0..self.n())
                    .filter(|&r| r != me)
                    .all(|r| self.arena.probe(r).is_ok());
            let p2 = self.step(sig, Some(u64::from(ok)), deadline, |_| {})?;
            let mut all = true;
            for r in 0..self.n() {
                all &= self.arena.sig_of(r, p2)?.1 == 1;
            }
            self.cma = Some(all);
            if !all {
                return Ok(None);
            }
        }
        Ok(Some(words))
    }

    /// Reads `dst.len()` bytes at `addr` in local rank `r`'s memory.
    fn read_peer(&self, r: usize, addr: u64, dst: &mut [u8], sig: &OpSig) -> Result<()> {
        let pid = self.arena.pid_of(r);
        cma::read(pid, addr, dst).map_err(|e| {
            let (me, them) = (self.arena.global(self.arena.me()), self.arena.global(r));
            if let Some(first) = self.arena.aborted() {
                // The peer failed first and may have let go of its buffer: its error is the
                // one that explains this.
                first
            } else if !pid_alive(pid) {
                Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {me} lost rank {them} (pid {pid}) during {sig}: the process exited; \
                         check that rank's log for the root cause"
                    ),
                )
            } else {
                Error::io(
                    format!(
                        "rank {me} could not read {} bytes of rank {them}'s buffer (pid {pid}, \
                         address {addr:#x}) during {sig}; SHARDLINE_CMA_BYTES=0 copies through \
                         shared memory instead",
                        dst.len()
                    ),
                    e,
                )
            }
        })
    }

    /// Reduces every rank's piece into `dst`, staging peers' pieces in `scratch` a `piece`
    /// at a time: rank r's piece starts at `addrs[r]` in its memory; this rank's is `own`, or
    /// what `dst` holds when `own` is `None`. Sources are reduced in rank order, as on the
    /// slots, so both paths give the same bits.
    #[allow(clippy::too_many_arguments)]
    fn cma_reduce(
        &self,
        scratch: &mut [u8],
        piece: usize,
        dst: &mut [u8],
        own: Option<&[u8]>,
        addrs: &[u64],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
    ) -> Result<()> {
        let (n, me) = (self.n(), self.arena.me());
        let mut off = 0;
        while off < dst.len() {
            let len = piece.min(dst.len() - off);
            for r in 0..n {
                let s = &mut scratch[r * piece..r * piece + len];
                if r != me {
                    self.read_peer(r, addrs[r] + off as u64, s, sig)?;
                } else if own.is_none() {
                    s.copy_from_slice(&dst[off..off + len]);
                }
            }
            let srcs: Vec<&[u8]> = (0..n)
                .map(|r| match own {
                    Some(o) if r == me => &o[off..off + len],
                    _ => &scratch[r * piece..r * piece + len],
                })
                .collect();
            reduce::reduce_slices(&mut dst[off..off + len], &srcs, dtype, op);
            off += len;
        }
        Ok(())
    }

    /// Single-copy all-reduce. Chunks of `n` slots: each rank reduces its part of the chunk
    /// from every rank's buffer (read in place) into its slot, then every rank copies all
    /// reduced parts out of the slots. One phase per chunk; no input is ever copied into the
    /// arena, and no two ranks read the same pages of a peer (which would contend in the
    /// kernel), so the result goes out through the slots rather than from the owner's buffer.
    /// The last chunk's phase is also the end: after it nobody reads a peer's buffer.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_cma(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        words: &[(u64, u64)],
        deadline: Instant,
    ) -> Result<()> {
        let (n, me, es) = (self.n(), self.arena.me(), dtype.size());
        let total = buf.len();
        let per = self.arena.slot_bytes() - self.arena.slot_bytes() % (64 * es);
        let chunk = per * n;
        let piece = self.cma_piece(es);
        let mut off = 0;
        while off < total {
            let len = chunk.min(total - off);
            let (lo, hi) = part(len, es, n, me);
            let addrs: Vec<u64> = words.iter().map(|w| w.0 + (off + lo) as u64).collect();
            let parity = (self.phase.wrapping_add(1) % 2) as usize;
            let mut scratch = std::mem::take(&mut self.scratch);
            let reduced = self.cma_reduce(
                &mut scratch,
                piece,
                &mut self.arena.my_slot(parity)[..hi - lo],
                Some(&buf[off + lo..off + hi]),
                &addrs,
                dtype,
                op,
                sig,
            );
            self.scratch = scratch;
            reduced?;
            let p = self.step(sig, None, deadline, |_| {})?;
            debug_assert_eq!(p, parity);
            for r in 0..n {
                let (lo, hi) = part(len, es, n, r);
                buf[off + lo..off + hi].copy_from_slice(&self.arena.slot(r, parity)[..hi - lo]);
            }
            off += len;
        }
        Ok(())
    }

    /// The last phase of a single-copy op: once every rank passed it, nobody reads this
    /// rank's buffer any more, so the caller may have it back.
    fn cma_end(&mut self, sig: &OpSig, deadline: Instant) -> Result<()> {
        self.step(sig, None, deadline, |_| {}).map(|_| ())
    }

    /// Checks that rank r passed `counts[r]` bytes (`got(r)`) to an all-gather or gather.
    fn check_counts(
        &self,
        counts: &[usize],
        got: impl Fn(usize) -> u64,
        sig: &OpSig,
    ) -> Result<()> {
        let me = self.arena.me();
        for (r, &expect) in counts.iter().enumerate() {
            let got = got(r);
            if got as usize != expect {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!(
                        "rank {} passed {got} bytes to {sig} but rank {} expected {expect} bytes \
                         from it; every rank must pass the same list of sizes",
                        self.arena.global(r),
                        self.arena.global(me)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Scratch for `n` staged pieces of `piece` bytes each; returns `piece` for `es`-byte
    /// elements.
    fn cma_piece(&mut self, es: usize) -> usize {
        let n = self.n();
        let piece = (CMA_SCRATCH_BYTES / n).max(CMA_MIN_PIECE);
        let piece = piece - piece % (64 * es);
        if self.scratch.len() < n * piece {
            self.scratch = vec![0u8; n * piece];
        }
        piece
    }

    /// Fails the arena for every rank.
    pub fn abort(&self, err: &Error) {
        self.arena.abort(err);
    }

    /// In-place all-reduce of `buf`; with `only_root`, only that local index gets the result.
    pub fn all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        only_root: Option<usize>,
        deadline: Instant,
    ) -> Result<()> {
        let (n, me, es) = (self.n(), self.arena.me(), dtype.size());
        let total = buf.len();
        // Reduce keeps non-roots' buffers untouched, which the single-copy path does not.
        if only_root.is_none() && self.wants_cma(total) {
            if let Some(words) = self.cma_begin(sig, 0, buf.as_ptr(), deadline)? {
                return self.all_reduce_cma(buf, dtype, op, sig, &words, deadline);
            }
        }
        let slot = self.arena.slot_bytes();
        if total <= self.oneshot_bytes.min(slot) {
            let parity = self.step(sig, Some(0), deadline, |s| s[..total].copy_from_slice(buf))?;
            if only_root.is_none_or(|r| r == me) {
                let srcs: Vec<&[u8]> = (0..n)
                    .map(|r| &self.arena.slot(r, parity)[..total])
                    .collect();
                reduce::reduce_slices(buf, &srcs, dtype, op);
            }
            return Ok(());
        }
        let chunk = slot - slot % (es * 64);
        let mut off = 0;
        let mut first = true;
        while first || off < total {
            let len = chunk.min(total - off);
            let (lo, hi) = part(len, es, n, me);
            let src = &buf[off..off + len];
            // Peers need every part of this chunk but ours, which only we reduce.
            let parity = self.step(sig, first.then_some(0), deadline, |s| {
                copy_to_shared(&mut s[..lo], &src[..lo]);
                copy_to_shared(&mut s[hi..len], &src[hi..len]);
            })?;
            first = false;
            // Reduce our part straight into the slot of the next phase: it was last read in
            // the previous phase, which every rank finished before posting this one.
            let next = 1 - parity;
            {
                let srcs: Vec<&[u8]> = (0..n)
                    .map(|r| {
                        if r == me {
                            &src[lo..hi]
                        } else {
                            &self.arena.slot(r, parity)[lo..hi]
                        }
                    })
                    .collect();
                reduce_to_shared(&mut self.arena.my_slot(next)[lo..hi], &srcs, dtype, op);
            }
            let parity = self.step(sig, None, deadline, |_| {})?;
            debug_assert_eq!(parity, next);
            if only_root.is_none_or(|r| r == me) {
                for r in 0..n {
                    let (lo, hi) = part(len, es, n, r);
                    buf[off + lo..off + hi].copy_from_slice(&self.arena.slot(r, parity)[lo..hi]);
                }
            }
            off += len;
        }
        Ok(())
    }

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
        let (n, me) = (self.n(), self.arena.me());
        let block = out.len();
        if self.wants_cma(inp.len()) {
            if let Some(words) = self.cma_begin(sig, 0, inp.as_ptr(), deadline)? {
                let addrs: Vec<u64> = words.iter().map(|w| w.0 + (me * block) as u64).collect();
                let piece = self.cma_piece(dtype.size());
                let mut scratch = std::mem::take(&mut self.scratch);
                let own = &inp[me * block..(me + 1) * block];
                let reduced =
                    self.cma_reduce(&mut scratch, piece, out, Some(own), &addrs, dtype, op, sig);
                self.scratch = scratch;
                reduced?;
                return self.cma_end(sig, deadline);
            }
        }
        let piece = piece_bytes(self.arena.slot_bytes(), n, dtype.size());
        let mut off = 0;
        let mut first = true;
        while first || off < block {
            let len = piece.min(block - off);
            let parity = self.step(sig, first.then_some(0), deadline, |s| {
                for d in 0..n {
                    s[d * piece..d * piece + len]
                        .copy_from_slice(&inp[d * block + off..d * block + off + len]);
                }
            })?;
            first = false;
            let srcs: Vec<&[u8]> = (0..n)
                .map(|r| &self.arena.slot(r, parity)[me * piece..me * piece + len])
                .collect();
            reduce::reduce_slices(&mut out[off..off + len], &srcs, dtype, op);
            off += len;
        }
        Ok(())
    }

    /// All-gather (or gather to `only_root`) of unequal byte counts `counts[r]` into `out`
    /// (concatenated in rank order); `out` may be empty on non-roots when gathering.
    #[allow(clippy::too_many_arguments)]
    pub fn all_gather(
        &mut self,
        out: &mut [u8],
        inp: &[u8],
        counts: &[usize],
        sig: &OpSig,
        only_root: Option<usize>,
        deadline: Instant,
    ) -> Result<()> {
        let (n, me) = (self.n(), self.arena.me());
        let chunk = self.arena.slot_bytes();
        let disp: Vec<usize> = counts
            .iter()
            .scan(0, |acc, &c| Some(std::mem::replace(acc, *acc + c)))
            .collect();
        let rounds = counts
            .iter()
            .map(|c| c.div_ceil(chunk))
            .max()
            .unwrap_or(0)
            .max(1);
        for it in 0..rounds {
            let off = it * chunk;
            let span = |c: usize| c.saturating_sub(off).min(chunk);
            let mine = span(inp.len());
            let parity = self.step(sig, (it == 0).then_some(inp.len() as u64), deadline, |s| {
                s[..mine].copy_from_slice(&inp[off..off + mine])
            })?;
            if it == 0 {
                let mut got = Vec::with_capacity(n);
                for r in 0..n {
                    got.push(self.arena.sig_of(r, parity)?.1);
                }
                self.check_counts(counts, |r| got[r], sig)?;
            }
            if only_root.is_none_or(|root| root == me) {
                for r in 0..n {
                    let len = span(counts[r]);
                    out[disp[r] + off..disp[r] + off + len]
                        .copy_from_slice(&self.arena.slot(r, parity)[..len]);
                }
            }
        }
        Ok(())
    }

    /// Broadcast of `buf` from local index `root`.
    pub fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: usize,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let me = self.arena.me();
        let chunk = self.arena.slot_bytes();
        let total = buf.len();
        let mut off = 0;
        let mut first = true;
        while first || off < total {
            let len = chunk.min(total - off);
            let src = &buf[off..off + len];
            let parity = self.step(sig, first.then_some(0), deadline, |s| {
                if me == root {
                    s[..len].copy_from_slice(src)
                }
            })?;
            first = false;
            if me != root {
                buf[off..off + len].copy_from_slice(&self.arena.slot(root, parity)[..len]);
            }
            off += len;
        }
        Ok(())
    }

    /// Scatter (`pieces_of` = block per destination) or all-to-all, one exchange loop:
    /// every sender fills `n` pieces per phase; receiver r reads piece r from each sender.
    /// `inp` is read only on senders (`root` for scatter, everyone for all-to-all);
    /// `out` gets one block per sender that is read.
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &mut self,
        out: &mut [u8],
        inp: &[u8],
        block: usize,
        root: Option<usize>,
        es: usize,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let (n, me) = (self.n(), self.arena.me());
        let piece = piece_bytes(self.arena.slot_bytes(), n, es);
        let sends = root.is_none_or(|r| r == me);
        let mut off = 0;
        let mut first = true;
        while first || off < block {
            let len = piece.min(block - off);
            let parity = self.step(sig, first.then_some(0), deadline, |s| {
                if sends {
                    for d in 0..n {
                        s[d * piece..d * piece + len]
                            .copy_from_slice(&inp[d * block + off..d * block + off + len]);
                    }
                }
            })?;
            first = false;
            match root {
                Some(r) => out[off..off + len]
                    .copy_from_slice(&self.arena.slot(r, parity)[me * piece..me * piece + len]),
                None => {
                    for r in 0..n {
                        out[r * block + off..r * block + off + len].copy_from_slice(
                            &self.arena.slot(r, parity)[me * piece..me * piece + len],
                        );
                    }
                }
            }
            off += len;
        }
        Ok(())
    }

    /// Scatter from local index `root`: `inp` (root only) holds n blocks of `out.len()`.
    pub fn scatter(
        &mut self,
        out: &mut [u8],
        inp: &[u8],
        root: usize,
        es: usize,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let block = out.len();
        self.exchange(out, inp, block, Some(root), es, sig, deadline)
    }

    /// All-to-all with equal blocks: block j of `inp` goes to rank j, block i of `out` came from i.
    pub fn all_to_all(
        &mut self,
        out: &mut [u8],
        inp: &[u8],
        es: usize,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let block = inp.len() / self.n();
        self.exchange(out, inp, block, None, es, sig, deadline)
    }

    /// Barrier: one phase with nothing but the signature.
    pub fn barrier(&mut self, sig: &OpSig, deadline: Instant) -> Result<()> {
        self.step(sig, Some(0), deadline, |_| {}).map(|_| ())
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

    #[test]
    fn pieces_are_aligned() {
        assert_eq!(piece_bytes(1 << 20, 3, 4) % 64, 0);
        for n in 1..=64 {
            assert!(piece_bytes(4096, n, 8) * n <= 4096, "n={n}");
        }
    }
}
