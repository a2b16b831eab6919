//! Point-to-point channels in the arena: one single-producer, single-consumer ring per ordered
//! pair of local ranks, so that a send between two ranks of one host is two memory copies
//! (into the ring, then straight into the receiver's buffer) instead of a trip through
//! loopback TCP.
//!
//! Each channel is a control page and [`CHUNKS`] chunks of [`CHUNK_BYTES`]. The sender owns
//! the `written` counter, the receiver owns `read`; both count chunks and wrap (`u32`, and
//! [`CHUNKS`] divides 2^32, so chunk `n` always lives in ring slot `n % CHUNKS`). The sender
//! fills slot `written % CHUNKS` once `written - read < CHUNKS`, records the message's
//! signature, length and the chunk's index beside it, and posts `written + 1`; the receiver
//! waits for that post, checks the record against its own call, copies out and posts
//! `read + 1`. A message of up to `CHUNKS * CHUNK_BYTES` bytes is therefore buffered and the
//! send completes before the receiver arrives, as over TCP; larger ones stream through the
//! ring. An empty message still moves one chunk, to carry its signature.
//!
//! Only the engine's worker thread of a communicator moves messages, so each end of a channel
//! has one thread; a failed transfer breaks the communicator (the engine aborts the arena), so
//! a channel is never reused in a half-moved state.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{pid_alive, Arena, PAGE};
use crate::error::{Error, ErrorKind, Result, LONGER_TIMEOUT};
use crate::signature::{OpSig, SIG_BYTES};
use crate::wait::{self, Signal, Stop};

/// Ring slots per channel.
pub(super) const CHUNKS: u32 = 4;
/// Bytes per ring slot: the unit the two copies overlap in.
pub(super) const CHUNK_BYTES: usize = 256 << 10;
/// Bytes per channel in the arena file: the control page and the ring.
pub(super) const CHANNEL_BYTES: usize = PAGE + CHUNKS as usize * CHUNK_BYTES;

/// A counter on its own cache lines, so the two ends do not share a line.
#[repr(C, align(128))]
struct Line(Signal);

/// What the sender records beside a chunk: the message it belongs to and its place in it.
#[repr(C)]
struct ChunkMeta {
    sig: [u8; SIG_BYTES],
    total: u64,
    index: u64,
}

#[repr(C)]
struct ChannelCtrl {
    written: Line,
    read: Line,
    meta: [ChunkMeta; CHUNKS as usize],
}

const _: () = assert!(std::mem::size_of::<ChannelCtrl>() <= PAGE);
const _: () = assert!(CHUNKS.is_power_of_two());

/// The error message of a receive by rank `me` of `sig` from rank `peer` that timed out.
fn recv_timeout(me: usize, sig: &OpSig, peer: usize) -> String {
    format!(
        "rank {me} timed out receiving {sig} from rank {peer}, which has not sent it; that rank \
         may be stuck in another op or hung — check its log, or {LONGER_TIMEOUT}"
    )
}

/// Chunks a message of `len` bytes takes (at least one).
fn chunks_of(len: usize) -> usize {
    len.div_ceil(CHUNK_BYTES).max(1)
}

impl Arena {
    /// Offset of the channel from local rank `src` to local rank `dst` (`src != dst`).
    fn channel_ptr(&self, src: usize, dst: usize) -> *mut u8 {
        assert!(src < self.ranks && dst < self.ranks && src != dst);
        let index = src * (self.ranks - 1) + if dst < src { dst } else { dst - 1 };
        // SAFETY: channel `index` lies inside the mapping by the layout checked at open.
        unsafe { self.map.base.add(self.chan_off + index * CHANNEL_BYTES) }
    }

    fn channel_ctrl(&self, src: usize, dst: usize) -> &ChannelCtrl {
        // SAFETY: the control page starts the channel, is page-aligned and was zero-filled
        // at creation (a valid state: both counters 0); it lives as long as the mapping.
        unsafe { &*(self.channel_ptr(src, dst) as *const ChannelCtrl) }
    }

    fn chunk_ptr(&self, src: usize, dst: usize, slot: u32) -> *mut u8 {
        // SAFETY: slot < CHUNKS, so the chunk lies inside the channel.
        unsafe {
            self.channel_ptr(src, dst)
                .add(PAGE + (slot % CHUNKS) as usize * CHUNK_BYTES)
        }
    }

    /// Local index of global rank `rank`, if it shares this arena.
    pub fn local_of(&self, rank: usize) -> Option<usize> {
        self.global.iter().position(|&g| g == rank)
    }

    /// Sends `payload` to local rank `dst` as one message signed `sig`.
    pub fn send_to(
        &self,
        dst: usize,
        sig: &OpSig,
        payload: &[u8],
        deadline: Instant,
    ) -> Result<()> {
        let ctrl = self.channel_ctrl(self.me, dst);
        // Only this thread writes `written` (see the module docs), so a relaxed load is ours.
        let mut w = ctrl.written.0.value.load(Ordering::Relaxed);
        let enc = sig.encode();
        for index in 0..chunks_of(payload.len()) {
            // Room once the receiver has read chunk w - CHUNKS.
            let room = w.wrapping_add(1).wrapping_sub(CHUNKS);
            self.wait_channel(&ctrl.read.0, room, dst, deadline, || {
                format!(
                    "rank {} timed out sending {sig} to rank {}, which has not received it; \
                     check that rank calls recv for every send (or {LONGER_TIMEOUT})",
                    self.global[self.me], self.global[dst]
                )
            })?;
            let slot = w % CHUNKS;
            let part = &payload[(index * CHUNK_BYTES).min(payload.len())
                ..((index + 1) * CHUNK_BYTES).min(payload.len())];
            // SAFETY: the receiver finished with this slot (it posted `read` past it, waited
            // for above), so this rank is its only user until it posts `written` below; the
            // meta record and the chunk both lie inside the channel.
            unsafe {
                let meta = std::ptr::addr_of!(ctrl.meta[slot as usize]) as *mut ChunkMeta;
                std::ptr::write(
                    meta,
                    ChunkMeta {
                        sig: enc,
                        total: payload.len() as u64,
                        index: index as u64,
                    },
                );
                std::ptr::copy_nonoverlapping(
                    part.as_ptr(),
                    self.chunk_ptr(self.me, dst, slot),
                    part.len(),
                );
            }
            w = w.wrapping_add(1);
            ctrl.written.0.post(w); // SeqCst: publishes the record and the chunk.
        }
        Ok(())
    }

    /// Receives one message signed `sig` from local rank `src` into `out` (exactly its size).
    pub fn recv_from(
        &self,
        src: usize,
        sig: &OpSig,
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<()> {
        let ctrl = self.channel_ctrl(src, self.me);
        let (me, peer) = (self.global[self.me], self.global[src]);
        // Only this thread writes `read`.
        let mut r = ctrl.read.0.value.load(Ordering::Relaxed);
        for index in 0..chunks_of(out.len()) {
            self.wait_channel(&ctrl.written.0, r.wrapping_add(1), src, deadline, || {
                recv_timeout(me, sig, peer)
            })?;
            let slot = r % CHUNKS;
            // SAFETY: the sender posted `written` past this slot (acquired by the wait), so
            // the record and the chunk are complete and the sender does not touch them until
            // this rank posts `read` below.
            let meta = unsafe { std::ptr::read(std::ptr::addr_of!(ctrl.meta[slot as usize])) };
            let theirs = OpSig::decode(&meta.sig)?;
            sig.check_against(me, &theirs, peer)?;
            if meta.total != out.len() as u64 || meta.index != index as u64 {
                return Err(Error::protocol(format!(
                    "rank {peer} sent {} bytes for {sig} but rank {me} expected {}; check that \
                     every rank passes buffers of the same size",
                    meta.total,
                    out.len()
                )));
            }
            let start = (index * CHUNK_BYTES).min(out.len());
            let end = ((index + 1) * CHUNK_BYTES).min(out.len());
            // SAFETY: as above; `out` is this rank's own buffer, distinct from the mapping.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.chunk_ptr(src, self.me, slot),
                    out[start..end].as_mut_ptr(),
                    end - start,
                );
            }
            r = r.wrapping_add(1);
            ctrl.read.0.post(r);
        }
        Ok(())
    }

    /// The signature and byte length of the next message from local rank `src`, without
    /// taking it: `None` while none has arrived. Fails when the arena was aborted, or when
    /// `src` is gone with nothing left to read from it.
    pub fn peek_from(&self, src: usize) -> Result<Option<(OpSig, u64)>> {
        let ctrl = self.channel_ctrl(src, self.me);
        // Only this thread writes `read`.
        let r = ctrl.read.0.value.load(Ordering::Relaxed);
        if !wait::reached(
            ctrl.written.0.value.load(Ordering::Acquire),
            r.wrapping_add(1),
        ) {
            if let Some(e) = self.aborted() {
                return Err(e);
            }
            self.peer_still_there(src, &ctrl.written.0, r.wrapping_add(1))?;
            return Ok(None);
        }
        Ok(Some(self.head_of(src, r)?))
    }

    /// Waits for the next message from local rank `src` and returns its signature and byte
    /// length without taking it; `expected` names what this rank waits for, in errors.
    pub fn wait_message_from(
        &self,
        src: usize,
        expected: &OpSig,
        deadline: Instant,
    ) -> Result<(OpSig, u64)> {
        let ctrl = self.channel_ctrl(src, self.me);
        let r = ctrl.read.0.value.load(Ordering::Relaxed);
        let (me, peer) = (self.global[self.me], self.global[src]);
        self.wait_channel(&ctrl.written.0, r.wrapping_add(1), src, deadline, || {
            recv_timeout(me, expected, peer)
        })?;
        self.head_of(src, r)
    }

    /// The record of the chunk at read position `r` of the channel from `src`, which the
    /// caller saw posted: the first chunk of a message.
    fn head_of(&self, src: usize, r: u32) -> Result<(OpSig, u64)> {
        let ctrl = self.channel_ctrl(src, self.me);
        // SAFETY: the sender posted `written` past this slot (the caller acquired it), so the
        // record is complete and the sender does not touch it until this rank reads it.
        let meta = unsafe { std::ptr::read(std::ptr::addr_of!(ctrl.meta[(r % CHUNKS) as usize])) };
        if meta.index != 0 {
            return Err(Error::protocol(format!(
                "rank {}: the channel from rank {} is out of step (chunk {} of a message where a \
                 message starts)",
                self.global[self.me], self.global[src], meta.index
            )));
        }
        Ok((OpSig::decode(&meta.sig)?, meta.total))
    }

    /// Fails when local rank `peer` is gone while `signal`, which it posts, has not reached
    /// `target`: it exited or closed its communicator.
    fn peer_still_there(&self, peer: usize, signal: &Signal, target: u32) -> Result<()> {
        let c = self.ctrl(peer);
        let gone =
            c.departed.load(Ordering::Acquire) != 0 || !pid_alive(c.pid.load(Ordering::Acquire));
        if gone && !wait::reached(signal.value.load(Ordering::Acquire), target) {
            return Err(Error::new(
                ErrorKind::PeerLost,
                format!(
                    "rank {} lost rank {} (pid {}) during a point-to-point transfer: the \
                     process exited or closed its communicator; check that rank's log for \
                     the root cause",
                    self.global[self.me],
                    self.global[peer],
                    c.pid.load(Ordering::Acquire)
                ),
            ));
        }
        Ok(())
    }

    /// Waits until `signal` reaches `target`, owned by local rank `peer`; fails early when the
    /// arena is aborted or the peer is gone without having reached it.
    fn wait_channel(
        &self,
        signal: &Signal,
        target: u32,
        peer: usize,
        deadline: Instant,
        timeout_message: impl Fn() -> String,
    ) -> Result<()> {
        let res = wait::wait_until(signal, target, deadline, self.policy, || {
            if let Some(e) = self.aborted() {
                return Err(e);
            }
            crate::interrupt::poll(self.global[self.me], &"a point-to-point transfer")?;
            self.peer_still_there(peer, signal, target).map(|()| false)
        });
        match res {
            Ok(()) => Ok(()),
            Err(Stop::Check(e)) => Err(e),
            Err(Stop::Deadline) => Err(Error::new(ErrorKind::Timeout, timeout_message())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;
    use crate::dtype::DType;
    use crate::signature::OpKind;
    use crate::transport::shm;

    static NEXT: AtomicUsize = AtomicUsize::new(0);

    /// Runs `body(arena)` on two threads, local ranks 0 and 1 of a fresh arena.
    fn pair<T: Send>(body: impl Fn(Arena) -> T + Sync) -> Vec<T> {
        let path = format!(
            "/dev/shm/shardline-{}-chan{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        shm::create(&path, 2, 1 << 16).unwrap();
        let out = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|me| {
                    let (path, body) = (&path, &body);
                    s.spawn(move || {
                        let a = Arena::open(path, me, vec![10, 11], Duration::ZERO).unwrap();
                        body(a)
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        shm::unlink(&path).unwrap();
        out
    }

    fn sig(bytes: usize) -> OpSig {
        OpSig::new(OpKind::Send, DType::U8, bytes)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    fn pattern(len: usize, salt: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 31 + salt) % 251) as u8).collect()
    }

    #[test]
    fn messages_of_every_size_arrive_whole_and_in_order() {
        // Empty, one byte, one chunk exactly, more than the whole ring, and odd tails.
        let sizes = [
            0,
            1,
            CHUNK_BYTES,
            CHUNK_BYTES + 1,
            CHUNKS as usize * CHUNK_BYTES * 3 + 17,
            5,
        ];
        let got = pair(|a| {
            let mut received = Vec::new();
            for (i, &n) in sizes.iter().enumerate() {
                if a.me() == 0 {
                    a.send_to(1, &sig(n), &pattern(n, i), soon()).unwrap();
                } else {
                    let mut out = vec![0xAAu8; n];
                    a.recv_from(0, &sig(n), &mut out, soon()).unwrap();
                    received.push(out);
                }
            }
            received
        });
        for (i, &n) in sizes.iter().enumerate() {
            assert!(
                got[1][i] == pattern(n, i),
                "message {i} ({n} bytes) differs"
            );
        }
    }

    #[test]
    fn small_sends_complete_before_the_receiver_arrives() {
        // Both ranks send first, then receive: over a rendezvous protocol this deadlocks.
        let n = CHUNK_BYTES * 2;
        let got = pair(|a| {
            let peer = 1 - a.me();
            a.send_to(peer, &sig(n), &pattern(n, a.me()), soon())
                .unwrap();
            let mut out = vec![0u8; n];
            a.recv_from(peer, &sig(n), &mut out, soon()).unwrap();
            out
        });
        assert!(got[0] == pattern(n, 1) && got[1] == pattern(n, 0));
    }

    #[test]
    fn a_size_mismatch_names_both_ranks() {
        let got = pair(|a| {
            if a.me() == 0 {
                a.send_to(1, &sig(8), &[1u8; 8], soon())
                    .map(|_| String::new())
            } else {
                let mut out = [0u8; 16];
                match a.recv_from(0, &sig(16), &mut out, soon()) {
                    Ok(()) => Ok(String::new()),
                    Err(e) => Ok(e.message),
                }
            }
        });
        let msg = got[1].as_ref().unwrap();
        assert!(
            msg.contains("rank 10 called send(uint8, 8)")
                && msg.contains("rank 11 called send(uint8, 16)"),
            "{msg}"
        );
    }

    #[test]
    fn a_receiver_whose_sender_left_fails_at_once() {
        let got = pair(|a| {
            if a.me() == 0 {
                drop(a); // closes without sending: marks this rank departed
                None
            } else {
                let start = Instant::now();
                let mut out = [0u8; 4];
                let err = a.recv_from(0, &sig(4), &mut out, soon()).unwrap_err();
                Some((err, start.elapsed()))
            }
        });
        let (err, took) = got[1].as_ref().unwrap();
        assert_eq!(err.kind, ErrorKind::PeerLost, "{err}");
        assert!(err.message.contains("lost rank 10"), "{err}");
        assert!(*took < Duration::from_secs(5), "took {took:?}");
    }

    #[test]
    fn a_message_nobody_receives_times_out_naming_the_peer() {
        // Larger than the ring, so the send cannot complete by buffering.
        let n = CHUNKS as usize * CHUNK_BYTES + 1;
        let got = pair(|a| {
            if a.me() == 0 {
                let deadline = Instant::now() + Duration::from_millis(200);
                Some(a.send_to(1, &sig(n), &vec![0u8; n], deadline).unwrap_err())
            } else {
                std::thread::sleep(Duration::from_millis(400));
                None
            }
        });
        let err = got[0].as_ref().unwrap();
        assert_eq!(err.kind, ErrorKind::Timeout, "{err}");
        assert!(
            err.message.contains("rank 10 timed out sending send(uint8")
                && err.message.contains("to rank 11"),
            "{err}"
        );
    }
}
