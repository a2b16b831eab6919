//! Authenticated TCP mesh between ranks, and framed, signature-checked messages over it.
//!
//! [`TcpMesh::connect`] links this rank with each rank in `peers` (the lower rank connects,
//! the higher accepts; both run the HMAC handshake of [`super::auth`]). Every socket is
//! non-blocking and every read and write waits in poll(2) against the caller's deadline.
//! Messages are one `Data` frame header followed by the payload, read straight into the
//! caller's buffer.

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::connect;
pub use super::connect::{Cancel, LinkOptions, TcpListenerHandle, SOCKET_BUFFER_BYTES};
use super::frame::{self, FrameType, Header, HEADER_BYTES};
use super::sockio::{self, read_some, Fail};
use crate::error::{Error, ErrorKind, Result, LONGER_TIMEOUT};
use crate::signature::OpSig;

mod draining;
mod transfer;
pub use draining::{Drain, Parking, ParkingMesh};

/// How long [`TcpMesh::abort_all`] spends telling each peer why.
const ABORT_TIMEOUT: Duration = Duration::from_millis(200);
struct Link {
    stream: TcpStream,
    addr: String,
    /// A frame is partly written: an abort frame now would corrupt the stream.
    tx_dirty: bool,
    /// The next frame's header as far as it has arrived (`rx_have` bytes), read ahead by
    /// [`TcpMesh::peek`]; the next receive from this peer starts from it.
    rx_head: [u8; HEADER_BYTES],
    rx_have: usize,
}

/// Authenticated TCP connections from this rank to its peers; implements [`P2p`](super::p2p::P2p).
///
/// Any failed send/recv/exchange breaks the mesh (later calls fail with `Closed`). The caller
/// should then call [`TcpMesh::abort_all`], so peers waiting on this rank fail at once with the
/// same error kind ("rank R aborted: ...") instead of waiting for their deadline.
pub struct TcpMesh {
    rank: usize,
    world: usize,
    group: u64,
    links: Vec<Option<Link>>,
    broken: Option<Error>,
    /// How long a stalled receive retries its socket before sleeping in poll(2).
    spin: Duration,
    /// The keep-alive bound the links were set up with (for messages).
    keepalive: Duration,
}

/// A shared reference to a stream usable where the helpers want `Read + Write + AsRawFd`.
struct Shared<'a>(&'a TcpStream);

impl std::io::Read for Shared<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&mut &*self.0).read(buf)
    }
}

impl std::io::Write for Shared<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (&mut &*self.0).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        (&mut &*self.0).write_vectored(bufs)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Shared<'_> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl TcpMesh {
    /// Links this rank to every rank in `peers` (authenticated with `secret`, for process group
    /// `group`), accepting on `listener`, before `deadline`. `addrs[r]` is rank r's listener
    /// address; `opts` sets the keep-alive and what may cancel the setup.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        rank: usize,
        world: usize,
        addrs: &[String],
        peers: &[usize],
        listener: TcpListenerHandle,
        secret: &[u8],
        group: &str,
        deadline: Instant,
        opts: &LinkOptions,
    ) -> Result<TcpMesh> {
        if rank >= world || addrs.len() != world {
            return Err(Error::invalid(format!(
                "TcpMesh::connect: rank {rank}, world size {world} and {} addresses disagree",
                addrs.len()
            )));
        }
        if let Some(p) = peers.iter().find(|&&p| p >= world || p == rank) {
            return Err(Error::invalid(format!(
                "rank {rank}: peer {p} is out of range or this rank itself (world size {world})"
            )));
        }
        if secret.is_empty() {
            return Err(Error::invalid(
                "the shared secret is empty; set SHARDLINE_SECRET (the same value on every rank)",
            ));
        }
        let tag = frame::group_tag(group);
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        let streams =
            connect::link_all(rank, addrs, peers, &listener, secret, tag, deadline, opts)?;
        for (p, stream) in streams {
            links[p] = Some(Link {
                stream,
                addr: addrs[p].clone(),
                tx_dirty: false,
                rx_head: [0; HEADER_BYTES],
                rx_have: 0,
            });
        }
        Ok(TcpMesh {
            rank,
            world,
            group: tag,
            links,
            broken: None,
            spin: Duration::ZERO,
            keepalive: opts.keepalive,
        })
    }

    /// Lets a stalled receive retry its socket for up to `spin` before sleeping in poll(2)
    /// (a message about to arrive then costs no wake-up); worth it only when every rank on
    /// the machine has a core to spin on (`SpinPolicy::for_ranks`).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// How long a stalled receive retries its socket before it sleeps (see
    /// [`TcpMesh::set_spin`]).
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// The world size the mesh was built for.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The address of `peer`, if this rank is linked to it.
    pub fn peer_address(&self, peer: usize) -> Option<&str> {
        self.links.get(peer)?.as_ref().map(|l| l.addr.as_str())
    }

    /// Tells every peer (best effort, briefly) that this rank failed with `err`, then shuts
    /// every socket; later calls fail with `Closed`.
    pub fn abort_all(&mut self, err: &Error) {
        let payload = frame::encode_abort(err.kind, self.rank as u32, &err.message);
        let header = Header {
            frame_type: FrameType::Abort,
            flags: 0,
            group: self.group,
            sig: None,
            payload_len: payload.len() as u64,
        };
        let hb = frame::encode_header(&header);
        let deadline = Instant::now() + ABORT_TIMEOUT;
        for link in self.links.iter_mut().flatten() {
            if !link.tx_dirty {
                let _ = sockio::write_full(&mut Shared(&link.stream), &hb, &payload, deadline);
            }
            let _ = link.stream.shutdown(std::net::Shutdown::Both);
        }
        if self.broken.is_none() {
            self.broken = Some(err.clone());
        }
    }

    /// Whether this mesh links this rank with `peer`.
    pub fn linked(&self, peer: usize) -> bool {
        peer != self.rank && self.links.get(peer).is_some_and(Option::is_some)
    }

    fn link(&self, peer: usize) -> &Link {
        self.links[peer].as_ref().expect("peer checked by transfer")
    }

    fn fail(&self, f: Fail, peer: usize, sig: &OpSig, doing: &str) -> Error {
        let (me, addr) = (self.rank, &self.link(peer).addr);
        match f {
            Fail::Closed(why) => Error::new(
                ErrorKind::PeerLost,
                format!(
                    "rank {peer} ({addr}) closed the connection during {sig} (seen by rank {me}: \
                     {why}); it probably exited or crashed — check its log"
                ),
            ),
            Fail::Timeout => Error::new(
                ErrorKind::Timeout,
                format!(
                    "rank {me} timed out {doing} rank {peer} ({addr}) during {sig}; that rank may \
                     be stuck in another op or hung — check its log, or {LONGER_TIMEOUT}"
                ),
            ),
            Fail::Unanswered(why) => {
                let bound = if self.keepalive.is_zero() {
                    "the kernel's TCP keep-alive (SHARDLINE_KEEPALIVE is 0)".to_string()
                } else {
                    format!(
                        "the keep-alive bound of {:.1} s (SHARDLINE_KEEPALIVE)",
                        self.keepalive.as_secs_f64()
                    )
                };
                Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {peer} ({addr}) stopped answering during {sig}: rank {me} got no \
                         acknowledgement from its host within {bound} ({why}); that host is \
                         down or the network between them is cut — check the link, then \
                         restart the job"
                    ),
                )
            }
            Fail::Os(e) => Error::io(
                format!("rank {me} {doing} rank {peer} ({addr}) during {sig}"),
                e,
            ),
            Fail::Interrupted => crate::interrupt::interrupted(me, sig),
        }
    }

    /// The error of a write to `to` that failed with `f` during `sig`: a peer that aborted
    /// closed its end, and its abort frame, read where `abort_readable` (no message from it is
    /// half read), says why.
    fn send_failed(&self, f: Fail, to: usize, sig: &OpSig, abort_readable: bool) -> Error {
        match f {
            Fail::Closed(_) if abort_readable => self
                .pending_abort(to)
                .unwrap_or_else(|| self.fail(f, to, sig, "sending to")),
            f => self.fail(f, to, sig, "sending to"),
        }
    }

    /// An abort frame `peer` left unread before closing, if any (the mesh is failing anyway, so
    /// consuming whatever else arrived is harmless).
    fn pending_abort(&self, peer: usize) -> Option<Error> {
        let deadline = Instant::now() + Duration::from_millis(100);
        let mut s = Shared(&self.link(peer).stream);
        let mut skip_budget: u64 = 16 << 20;
        for _ in 0..4 {
            let mut hb = [0u8; HEADER_BYTES];
            sockio::read_full(&mut s, &mut hb, deadline).ok()?;
            let h = frame::decode_header(&hb).ok()?;
            if h.frame_type == FrameType::Abort {
                let mut payload = vec![0u8; h.payload_len as usize];
                sockio::read_full(&mut s, &mut payload, deadline).ok()?;
                return Some(frame::abort_error(&payload));
            }
            // Skip data the peer sent before it aborted, within a budget.
            skip_budget = skip_budget.checked_sub(h.payload_len)?;
            let mut left = h.payload_len as usize;
            let mut sink = [0u8; 16 * 1024];
            while left > 0 {
                let n = left.min(sink.len());
                sockio::read_full(&mut s, &mut sink[..n], deadline).ok()?;
                left -= n;
            }
        }
        None
    }

    /// Checks a complete incoming header against what this rank expects.
    fn check(
        &self,
        peer: usize,
        hb: &[u8; HEADER_BYTES],
        sig: &OpSig,
        len: usize,
        deadline: Instant,
    ) -> Result<()> {
        let (me, addr) = (self.rank, &self.link(peer).addr);
        let h = frame::decode_header(hb).map_err(|e| {
            e.context(format!(
                "rank {me}: bad frame from rank {peer} ({addr}) during {sig}"
            ))
        })?;
        if h.frame_type == FrameType::Abort {
            // payload_len is capped at 64 KiB + 5 by decode_header.
            let mut payload = vec![0u8; h.payload_len as usize];
            sockio::read_full(&mut Shared(&self.link(peer).stream), &mut payload, deadline)
                .map_err(|f| self.fail(f, peer, sig, "reading an abort from"))?;
            return Err(frame::abort_error(&payload));
        }
        if h.frame_type != FrameType::Data || h.group != self.group {
            return Err(self.out_of_sync(peer, &h, sig));
        }
        let theirs = h.sig.expect("data frames carry a signature");
        sig.check_against(me, &theirs, peer)?;
        if h.payload_len != len as u64 {
            return Err(Error::protocol(format!(
                "rank {peer} sent {} bytes for {sig} but rank {me} expected {len}; check that \
                 every rank passes buffers of the same size",
                h.payload_len
            )));
        }
        Ok(())
    }

    /// Fails when the mesh is broken or a peer of `peers` is not linked to this rank.
    fn usable(&self, mut peers: impl Iterator<Item = usize>, sig: &OpSig) -> Result<()> {
        if let Some(e) = &self.broken {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "rank {}: {sig} on a TCP mesh broken by an earlier error ({}); create a new \
                     communicator",
                    self.rank, e.message
                ),
            ));
        }
        match peers.find(|&p| self.links.get(p).is_none_or(|l| l.is_none())) {
            Some(p) => Err(Error::invalid(format!(
                "rank {}: {sig} addresses rank {p}, which this mesh is not linked to",
                self.rank
            ))),
            None => Ok(()),
        }
    }

    /// The signature and payload length of the next frame from `peer`, without taking it:
    /// `None` if its header has not fully arrived and `deadline` is `None` (a look that does
    /// not wait), else waits for it until `deadline`. `expected` names, in errors, what this
    /// rank waits for. An abort frame is the error it carries. A look that does not wait and
    /// finds the peer gone fails with `PeerLost` but leaves the mesh usable.
    pub fn peek(
        &mut self,
        peer: usize,
        expected: &OpSig,
        deadline: Option<Instant>,
    ) -> Result<Option<(OpSig, u64)>> {
        self.usable(std::iter::once(peer), expected)?;
        let r = self.peek_inner(peer, expected, deadline);
        match &r {
            // A look that does not wait finds a peer that left: the links to the others stay
            // usable (a receive from any source passes over it).
            Err(e) if deadline.is_none() && e.kind == ErrorKind::PeerLost => {}
            Err(e) => self.broken = Some(e.clone()),
            Ok(_) => {}
        }
        r
    }

    fn peek_inner(
        &mut self,
        peer: usize,
        expected: &OpSig,
        deadline: Option<Instant>,
    ) -> Result<Option<(OpSig, u64)>> {
        let mut spin_until: Option<Instant> = None;
        loop {
            let link = self.links[peer].as_mut().expect("checked by usable");
            if link.rx_have < HEADER_BYTES {
                let n = read_some(&link.stream, &mut link.rx_head[link.rx_have..])
                    .map_err(|f| self.fail(f, peer, expected, "receiving from"))?;
                let link = self.links[peer].as_mut().expect("checked by usable");
                link.rx_have += n;
                if n == 0 {
                    let Some(deadline) = deadline else {
                        return Ok(None);
                    };
                    // As a receive does: retry for a while before sleeping in poll(2).
                    let now = Instant::now();
                    if now < *spin_until.get_or_insert(now + self.spin) {
                        std::hint::spin_loop();
                        continue;
                    }
                    let fd = link.stream.as_raw_fd();
                    sockio::wait_fd(fd, libc::POLLIN, deadline)
                        .map_err(|f| self.fail(f, peer, expected, "waiting for data from"))?;
                }
                continue;
            }
            let (me, addr) = (self.rank, &link.addr);
            let h = frame::decode_header(&link.rx_head).map_err(|e| {
                e.context(format!(
                    "rank {me}: bad frame from rank {peer} ({addr}) while waiting for {expected}"
                ))
            })?;
            if h.frame_type == FrameType::Abort {
                let head = link.rx_head;
                link.rx_have = 0;
                let until = deadline.unwrap_or_else(|| Instant::now() + ABORT_TIMEOUT);
                return Err(self
                    .check(peer, &head, expected, 0, until)
                    .expect_err("an abort"));
            }
            if h.frame_type != FrameType::Data || h.group != self.group {
                return Err(self.out_of_sync(peer, &h, expected));
            }
            return Ok(Some((
                h.sig.expect("data frames carry a signature"),
                h.payload_len,
            )));
        }
    }

    fn out_of_sync(&self, peer: usize, h: &Header, sig: &OpSig) -> Error {
        Error::protocol(format!(
            "rank {}: rank {peer} ({}) sent a {:?} frame for group tag {:#x} during {sig} \
             (expected data for {:#x}); the streams are out of sync",
            self.rank,
            self.link(peer).addr,
            h.frame_type,
            h.group,
            self.group
        ))
    }
}
