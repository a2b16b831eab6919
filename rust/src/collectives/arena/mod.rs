//! Every collective on the shared-memory arena of one host.
//!
//! The protocol is a sequence of *phases*. In phase k a rank fills its slot `k % 2`, posts k,
//! waits until every rank posted k, then reads whatever slots it needs. Because a rank posts
//! k+1 only after it finished reading the slots of phase k, and writes slot `k % 2` again only
//! in phase k+2 (after seeing everyone post k+1), two slots per rank are enough and no barrier
//! is ever added. Every op's first phase also publishes the op's signature, which every rank
//! compares with everybody else's before touching data.
//!
//! All-reduce, one-shot or two-phase, is in `all_reduce`, reduce-scatter in
//! `reduce_scatter`, the ops on symmetric memory in [`symmetric`]; the other ops are here.

use std::time::Instant;

use crate::collectives::comm_threads::{self, CommThreads};
use crate::error::{Error, ErrorKind, Result};
use crate::memcpy::StreamMode;
use crate::signature::OpSig;
use std::sync::Arc;

use crate::transport::shm::{Arena, Meanwhile};

mod all_reduce;
mod reduce_scatter;
pub mod symmetric;
pub use all_reduce::AllReduceAlgo;

/// Size up to which all-reduce is one-shot where nothing was measured (ranks outnumber the
/// cores), and the largest one-shot all-reduce a measurement may choose.
pub const DEFAULT_ONESHOT_BYTES: usize = 256 * 1024;

/// The arena plus the phase counter.
pub struct ArenaComm {
    arena: Arc<Arena>,
    phase: u32,
    oneshot_bytes: usize,
    /// Whether the first all-reduce measures `oneshot_bytes` first ([`super::tuning`]).
    tune_oneshot: bool,
    comm_threads: CommThreads,
    /// Which copies into the slots use streaming stores.
    stream: StreamMode,
    /// Whether the op in progress may use the comm_threads (see [`ArenaComm::allow_helpers`]).
    helpers: bool,
    /// Symmetric allocations, in the order every local rank registered them.
    symmetric: symmetric::Allocations,
    /// What the ops' waits do meanwhile, while set ([`ArenaComm::set_meanwhile`]).
    meanwhile: Option<Arc<Meanwhile>>,
}

/// Bytes of a per-destination piece when a slot is split `n` ways (element and cache aligned).
fn piece_bytes(slot: usize, n: usize, es: usize) -> usize {
    let p = slot / n;
    let p = p - p % 64.max(es);
    p.max(es)
}

impl ArenaComm {
    /// Wraps a mapped arena: all-reduces up to `oneshot_bytes` are one-shot, large ops split
    /// their memory passes over `comm_threads`, and `stream` says which copies into the slots use
    /// streaming stores.
    pub fn new(
        arena: Arc<Arena>,
        oneshot_bytes: usize,
        comm_threads: CommThreads,
        stream: StreamMode,
    ) -> Self {
        ArenaComm {
            arena,
            phase: 0,
            oneshot_bytes,
            tune_oneshot: false,
            comm_threads,
            stream,
            helpers: true,
            symmetric: Vec::new(),
            meanwhile: None,
        }
    }

    /// Has the waits of the ops that follow run `meanwhile` at their checks (until set to
    /// `None`): a rank of a group across hosts reads its TCP links there.
    pub fn set_meanwhile(&mut self, meanwhile: Option<Arc<Meanwhile>>) {
        self.meanwhile = meanwhile;
    }

    /// Has the first all-reduce measure where one-shot stops paying, before it runs (every
    /// rank of the arena must ask for it). Measured then rather than when the communicator is
    /// made: the ranks are all running by then, a peer that fails stops it like any op, and
    /// groups that never all-reduce cost nothing.
    pub fn tune_oneshot_at_first_use(&mut self) {
        self.tune_oneshot = true;
    }

    /// All-reduces up to this many bytes are one-shot.
    pub fn oneshot_bytes(&self) -> usize {
        self.oneshot_bytes
    }

    /// Sets the size up to which all-reduces are one-shot (every rank must set the same).
    pub fn set_oneshot_bytes(&mut self, bytes: usize) {
        self.oneshot_bytes = bytes;
    }

    /// Which copies into the slots use streaming stores.
    pub fn stream_mode(&self) -> StreamMode {
        self.stream
    }

    /// The helper threads.
    pub fn comm_threads(&self) -> &CommThreads {
        &self.comm_threads
    }

    /// Whether the next ops may split their passes over the helper threads: yes for ops the
    /// caller waits for, no for async ops that overlap the caller's compute.
    pub fn allow_helpers(&mut self, on: bool) {
        self.helpers = on;
    }

    /// Runs `body(self, ways)`: on the helper pool, split `ways` ways, for an op of `bytes`
    /// that is large enough, else on this thread with `ways` = 1.
    fn with_comm_threads<R: Send>(
        &mut self,
        bytes: usize,
        body: impl FnOnce(&mut Self, usize) -> R + Send,
    ) -> R {
        let pool = if self.helpers {
            self.comm_threads.pool_for(bytes)
        } else {
            None
        };
        match pool {
            Some(pool) => {
                let ways = self.comm_threads.threads();
                pool.install(|| body(self, ways))
            }
            None => body(self, 1),
        }
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
        let k = self.phase.wrapping_add(1);
        let parity = (k % 2) as usize;
        fill(self.arena.my_slot(parity));
        if let Some(extra) = publish {
            self.arena.set_sig(parity, sig, extra);
        }
        self.arena.post(k);
        self.phase = k;
        self.arena
            .wait_all(k, deadline, sig, self.meanwhile.as_deref())?;
        if publish.is_some() {
            let mine = sig;
            let me = self.arena.me();
            for r in 0..self.n() {
                if r != me {
                    let (theirs, _) = self.arena.sig_of(r, parity)?;
                    mine.check_against(self.arena.global(me), &theirs, self.arena.global(r))?;
                }
            }
        }
        Ok(parity)
    }

    /// Fails the arena for every rank.
    pub fn abort(&self, err: &Error) {
        self.arena.abort(err);
    }

    /// All-gather (or gather to `only_root`) of unequal byte counts `counts[r]` into `out`
    /// (concatenated in rank order); `out` may be empty on non-roots when gathering. An
    /// all-gather of equal counts whose input (or else output) is in symmetric memory reads
    /// every block where its rank put it ([`symmetric`]).
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
        let equal = only_root.is_none()
            && counts.iter().all(|&c| c == inp.len())
            && out.len() == counts.len() * inp.len();
        if equal {
            if let Some(place) = self.symmetric_place(inp) {
                return self.with_comm_threads(out.len(), |c, ways| {
                    c.all_gather_symmetric_input(place, out, inp.len(), sig, deadline, ways)
                });
            }
            if let Some(place) = self.symmetric_place(out) {
                return self.with_comm_threads(out.len(), |c, ways| {
                    c.all_gather_symmetric(place, out, inp, sig, deadline, ways)
                });
            }
        }
        self.with_comm_threads(out.len().max(inp.len()), |c, ways| {
            c.all_gather_ways(out, inp, counts, sig, only_root, deadline, ways)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn all_gather_ways(
        &mut self,
        out: &mut [u8],
        inp: &[u8],
        counts: &[usize],
        sig: &OpSig,
        only_root: Option<usize>,
        deadline: Instant,
        ways: usize,
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
                // A rank whose block ends before this round's offset sends nothing.
                let src = &inp[off.min(inp.len())..][..mine];
                comm_threads::copy(&mut s[..mine], src, ways, <[u8]>::copy_from_slice);
            })?;
            if it == 0 {
                if !self.symmetric.is_empty() {
                    self.check_no_symmetric_peer(parity, sig)?;
                }
                for (r, &expect) in counts.iter().enumerate() {
                    let (_, got) = self.arena.sig_of(r, parity)?;
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
            }
            if only_root.is_none_or(|root| root == me) {
                // This round's window of each rank's block: disjoint and in order in `out`.
                let arena = &*self.arena;
                let mut regions = Vec::with_capacity(n);
                let mut rest: &mut [u8] = &mut out[..];
                let mut at = 0;
                for r in 0..n {
                    let (start, len) = (disp[r] + off.min(counts[r]), span(counts[r]));
                    let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
                    let (region, tail) = tail.split_at_mut(len);
                    regions.push((region, &arena.slot(r, parity)[..len]));
                    rest = tail;
                    at = start + len;
                }
                comm_threads::each(regions, ways, |_, (dst, src)| {
                    comm_threads::copy(dst, src, ways, <[u8]>::copy_from_slice);
                });
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
        self.with_comm_threads(buf.len(), |c, ways| {
            c.broadcast_ways(buf, root, sig, deadline, ways)
        })
    }

    fn broadcast_ways(
        &mut self,
        buf: &mut [u8],
        root: usize,
        sig: &OpSig,
        deadline: Instant,
        ways: usize,
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
                    comm_threads::copy(&mut s[..len], src, ways, <[u8]>::copy_from_slice);
                }
            })?;
            first = false;
            if me != root {
                let slot = &self.arena.slot(root, parity)[..len];
                comm_threads::copy(
                    &mut buf[off..off + len],
                    slot,
                    ways,
                    <[u8]>::copy_from_slice,
                );
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
    fn pieces_are_aligned() {
        assert_eq!(piece_bytes(1 << 20, 3, 4) % 64, 0);
        for n in 1..=64 {
            assert!(piece_bytes(4096, n, 8) * n <= 4096, "n={n}");
        }
    }
}
