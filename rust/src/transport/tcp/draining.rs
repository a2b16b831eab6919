//! Reading while waiting: what other ranks send to this one is taken in while a TCP operation
//! of this rank waits, so that no rank waits for another that waits for it.
//!
//! - [`TcpMesh::send_draining`]: a send that waits for room in its socket takes in the
//!   messages other ranks send to this one meanwhile. Ranks that each send before they
//!   receive (a pair, or a ring) then never wait for each other, whatever the size of their
//!   messages.
//! - [`TcpMesh::parking`]: a collective takes in the messages sent to this rank ahead of, or
//!   beside, the collective's own. A rank that sends a message and then enters a collective,
//!   while its receiver enters the collective before it receives, then gets through both: the
//!   receiver keeps the message for its receive, and the sender's send, no longer waiting for
//!   room, lets its collective start.
//! - [`Drain::poll`]: the same for a wait outside TCP (on the shared memory of a host, in a
//!   group across hosts), which polls at its checks.

use std::os::fd::AsRawFd;
use std::time::Instant;

use super::frame::{self, FrameType, Header, HEADER_BYTES};
use super::sockio::{poll_until, pollfd, read_some, write_some};
use super::TcpMesh;
use crate::error::{ErrorKind, Result};
use crate::signature::OpSig;
use crate::transport::p2p::P2p;

/// Where an operation that waits puts the messages it takes in meanwhile
/// ([`TcpMesh::send_draining`], [`TcpMesh::parking`]).
pub trait Parking {
    /// Whether to take in `peer`'s next message, signed `sig`, of `len` bytes, now: the
    /// memory to read it into (`len` bytes), or `None`. An error fails the operation.
    fn accepts(&mut self, peer: usize, sig: &OpSig, len: u64) -> Result<Option<Vec<u8>>>;

    /// Keeps a message taken in.
    fn park(&mut self, peer: usize, sig: OpSig, data: Vec<u8>);
}

/// A message taken in while waiting, as far as it has arrived.
pub(super) struct Incoming {
    pub(super) sig: OpSig,
    pub(super) data: Vec<u8>,
    pub(super) got: usize,
}

/// The ranks a waiting operation takes messages in from, and how far it got with each.
///
/// Also for a wait outside TCP (on its host's shared memory, inside a collective of a group
/// across hosts), which polls it ([`Drain::poll`]) at its checks and [`Drain::finish`]es it
/// once over.
pub struct Drain {
    others: Vec<usize>,
    incoming: Vec<Option<Incoming>>,
    /// Nothing more is taken from the rank during this operation: its next message is not
    /// one the parking accepts (a collective's), or it has left.
    settled: Vec<bool>,
}

impl Drain {
    /// Takes in from the ranks of `others`.
    pub fn new(others: impl IntoIterator<Item = usize>) -> Self {
        let others: Vec<usize> = others.into_iter().collect();
        Drain {
            incoming: others.iter().map(|_| None).collect(),
            settled: vec![false; others.len()],
            others,
        }
    }

    /// Reads what has arrived of the messages being taken in, and keeps those complete; with
    /// `look`, first looks (without waiting) at the next message of each rank not settled,
    /// and starts taking it in where `parking` accepts it. Whether anything was read.
    pub(super) fn step(
        &mut self,
        mesh: &mut TcpMesh,
        sig: &OpSig,
        look: bool,
        parking: &mut dyn Parking,
    ) -> Result<bool> {
        let mut progress = false;
        for k in 0..self.others.len() {
            if look && self.incoming[k].is_none() && !self.settled[k] {
                progress |= self.look(k, mesh, sig, parking)?;
            }
            let from = self.others[k];
            if let Some(m) = self.incoming[k].as_mut() {
                let n = read_some(&mesh.link(from).stream, &mut m.data[m.got..])
                    .map_err(|f| mesh.fail(f, from, &m.sig, "receiving from"))?;
                m.got += n;
                progress |= n > 0;
                if m.got == m.data.len() {
                    let m = self.incoming[k].take().expect("read above");
                    parking.park(from, m.sig, m.data);
                    progress = true;
                }
            }
        }
        Ok(progress)
    }

    /// Looks (as `step` does) at the next message of each rank not settled whose socket
    /// `fds`, as a poll(2) returned them, say has something to read: a wait that polls the
    /// others' sockets beside its own looks only at those with news.
    pub(super) fn look_ready(
        &mut self,
        mesh: &mut TcpMesh,
        sig: &OpSig,
        fds: &[libc::pollfd],
        parking: &mut dyn Parking,
    ) -> Result<()> {
        for k in 0..self.others.len() {
            if self.incoming[k].is_some() || self.settled[k] {
                continue;
            }
            let fd = mesh.link(self.others[k]).stream.as_raw_fd();
            if fds.iter().any(|f| f.fd == fd && f.revents != 0) {
                self.look(k, mesh, sig, parking)?;
            }
        }
        Ok(())
    }

    /// Looks, without waiting, at the next message of `others[k]`, and starts taking it in
    /// where `parking` accepts it; settles the rank where it does not, or where it has left.
    fn look(
        &mut self,
        k: usize,
        mesh: &mut TcpMesh,
        sig: &OpSig,
        parking: &mut dyn Parking,
    ) -> Result<bool> {
        let from = self.others[k];
        match mesh.peek_inner(from, sig, None) {
            Ok(Some((theirs, len))) => match parking.accepts(from, &theirs, len)? {
                Some(data) => {
                    mesh.links[from].as_mut().expect("checked").rx_have = 0;
                    self.incoming[k] = Some(Incoming {
                        sig: theirs,
                        data,
                        got: 0,
                    });
                    return Ok(true);
                }
                None => self.settled[k] = true,
            },
            Ok(None) => {}
            Err(e) if e.kind == ErrorKind::PeerLost => self.settled[k] = true,
            Err(e) => return Err(e),
        }
        Ok(false)
    }

    /// The first rank whose message is being taken in.
    pub(super) fn reading(&self) -> Option<usize> {
        let k = self.incoming.iter().position(Option::is_some)?;
        Some(self.others[k])
    }

    /// Adds to `fds` the sockets to wait on for reading: those of the messages being taken
    /// in, and with `look` those of the ranks not settled.
    pub(super) fn watch(&self, mesh: &TcpMesh, fds: &mut Vec<libc::pollfd>, look: bool) {
        for (k, &from) in self.others.iter().enumerate() {
            if self.incoming[k].is_some() || (look && !self.settled[k]) {
                let fd = mesh.link(from).stream.as_raw_fd();
                match fds.iter_mut().find(|f| f.fd == fd) {
                    Some(f) => f.events |= libc::POLLIN,
                    None => fds.push(pollfd(fd, libc::POLLIN)),
                }
            }
        }
    }

    /// Reads, without waiting, what has arrived of the messages the ranks send to this one
    /// and `parking` accepts, for the op `sig`, as long as there is something to read;
    /// whether a message is still arriving (poll again soon).
    pub fn poll(
        &mut self,
        mesh: &mut TcpMesh,
        sig: &OpSig,
        parking: &mut dyn Parking,
    ) -> Result<bool> {
        while self.step(mesh, sig, true, parking)? {}
        Ok(self.reading().is_some())
    }

    /// Reads the messages still arriving to their end (their senders are writing them), by
    /// `deadline`; nothing new is taken in.
    pub fn finish(
        &mut self,
        mesh: &mut TcpMesh,
        sig: &OpSig,
        parking: &mut dyn Parking,
        deadline: Instant,
    ) -> Result<()> {
        while let Some(from) = self.reading() {
            if self.step(mesh, sig, false, parking)? {
                continue;
            }
            let mut fds = Vec::with_capacity(1);
            self.watch(mesh, &mut fds, false);
            poll_until(&mut fds, deadline)
                .map_err(|f| mesh.fail(f, from, sig, "waiting for data from"))?;
        }
        Ok(())
    }
}

impl TcpMesh {
    /// Sends one message to `peer`, as [`P2p::send`] does, taking in meanwhile what the ranks
    /// of `others` send to this rank while `parking` accepts it: each of their next messages,
    /// read as it arrives, beside the write. Ranks that each send before they receive then
    /// never wait for each other, whatever the size of their messages. A message still
    /// arriving when the send is done is read to its end (its sender is writing it).
    pub fn send_draining(
        &mut self,
        peer: usize,
        sig: &OpSig,
        payload: &[u8],
        deadline: Instant,
        others: &[usize],
        parking: &mut dyn Parking,
    ) -> Result<()> {
        self.usable(std::iter::once(peer).chain(others.iter().copied()), sig)?;
        let r = self.send_draining_inner(peer, sig, payload, deadline, others, parking);
        if let Err(e) = &r {
            self.broken.get_or_insert_with(|| e.clone());
        }
        r
    }

    fn send_draining_inner(
        &mut self,
        peer: usize,
        sig: &OpSig,
        payload: &[u8],
        deadline: Instant,
        others: &[usize],
        parking: &mut dyn Parking,
    ) -> Result<()> {
        let header = Header {
            frame_type: FrameType::Data,
            flags: 0,
            group: self.group,
            sig: Some(*sig),
            payload_len: payload.len() as u64,
        };
        let ohdr = frame::encode_header(&header);
        let (mut sent, total) = (0usize, HEADER_BYTES + payload.len());
        let mut drain = Drain::new(others.iter().copied());
        self.links[peer].as_mut().expect("checked").tx_dirty = true;
        loop {
            let (h, b) = if sent < HEADER_BYTES {
                (&ohdr[sent..], payload)
            } else {
                (&[][..], &payload[sent - HEADER_BYTES..])
            };
            let n = write_some(&self.link(peer).stream, h, b)
                .map_err(|f| self.send_failed(f, peer, sig, true))?;
            sent += n;
            if sent == total {
                self.links[peer].as_mut().expect("checked").tx_dirty = false;
                return drain.finish(self, sig, parking, deadline);
            }
            // The socket has no room for more of this message: look at the others meanwhile.
            let stalled = n == 0;
            if drain.step(self, sig, stalled, parking)? || !stalled {
                continue;
            }
            let mut fds = vec![pollfd(self.link(peer).stream.as_raw_fd(), libc::POLLOUT)];
            drain.watch(self, &mut fds, true);
            poll_until(&mut fds, deadline).map_err(|f| self.fail(f, peer, sig, "sending to"))?;
        }
    }

    /// This mesh, whose collectives take in the messages the ranks of `others` send to this
    /// rank while they run, where `parking` accepts them: those ahead of the collective's own
    /// on its links, and, while it waits, those on the others'. Without this, a message sent
    /// before a collective to a rank that enters the collective before it receives stops the
    /// collective: as a mismatch where it comes first on the collective's link, and until the
    /// deadline where the sender's send waits for room that only a receive would make.
    pub fn parking<'a>(
        &'a mut self,
        others: Vec<usize>,
        parking: &'a mut dyn Parking,
    ) -> ParkingMesh<'a> {
        ParkingMesh {
            mesh: self,
            others,
            parking,
        }
    }
}

/// A [`TcpMesh`] whose collectives take in the messages sent to this rank meanwhile
/// ([`TcpMesh::parking`]).
pub struct ParkingMesh<'a> {
    mesh: &'a mut TcpMesh,
    others: Vec<usize>,
    parking: &'a mut dyn Parking,
}

impl P2p for ParkingMesh<'_> {
    fn rank(&self) -> usize {
        self.mesh.rank
    }

    fn transfer(
        &mut self,
        out: Option<(usize, &[u8])>,
        inp: Option<(usize, &mut [u8])>,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        // The link the collective reads from is read by the transfer itself.
        let reading = inp.as_ref().map(|i| i.0);
        let drain = Drain::new(self.others.iter().copied().filter(|&p| Some(p) != reading));
        let parking: &mut dyn Parking = &mut *self.parking;
        self.mesh
            .transfer_with(out, inp, sig, deadline, Some((parking, drain)))
    }
}
