//! A send that reads while it waits: [`TcpMesh::send_draining`] takes in what other ranks
//! send to this one while its own message waits for room in the socket, so that ranks that
//! each send before they receive (a pair, or a ring) never wait for each other, whatever the
//! size of their messages.

use std::os::fd::AsRawFd;
use std::time::Instant;

use super::frame::{self, FrameType, Header, HEADER_BYTES};
use super::sockio::{poll_until, pollfd, read_some, write_some};
use super::TcpMesh;
use crate::error::{ErrorKind, Result};
use crate::signature::OpSig;

/// Where a send that waits for room puts the messages it takes in meanwhile
/// ([`TcpMesh::send_draining`]).
pub trait Parking {
    /// Whether to take in `peer`'s next message, signed `sig`, of `len` bytes, now: the
    /// memory to read it into (`len` bytes), or `None`. An error fails the send.
    fn accepts(&mut self, peer: usize, sig: &OpSig, len: u64) -> Result<Option<Vec<u8>>>;

    /// Keeps a message taken in.
    fn park(&mut self, peer: usize, sig: OpSig, data: Vec<u8>);
}

/// A message a send takes in while it waits for room, as far as it has arrived.
struct Incoming {
    sig: OpSig,
    data: Vec<u8>,
    got: usize,
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
        // Per rank of `others`: its message being read, and whether nothing more is taken
        // from it during this send (its next message is not one `parking` accepts).
        let mut incoming: Vec<Option<Incoming>> = others.iter().map(|_| None).collect();
        let mut settled = vec![false; others.len()];
        self.links[peer].as_mut().expect("checked").tx_dirty = true;
        loop {
            let mut progress = false;
            let mut stalled = false; // the socket had no room for more of this message
            if sent < total {
                let (h, b) = if sent < HEADER_BYTES {
                    (&ohdr[sent..], payload)
                } else {
                    (&[][..], &payload[sent - HEADER_BYTES..])
                };
                let n = write_some(&self.link(peer).stream, h, b)
                    .map_err(|f| self.send_failed(f, peer, sig, true))?;
                sent += n;
                progress |= n > 0;
                stalled = n == 0;
                if sent == total {
                    self.links[peer].as_mut().expect("checked").tx_dirty = false;
                }
            }
            for (k, &from) in others.iter().enumerate() {
                if incoming[k].is_none() && !settled[k] && stalled {
                    // A look that does not wait; a rank that left is not waited for.
                    match self.peek_inner(from, sig, None) {
                        Ok(Some((theirs, len))) => match parking.accepts(from, &theirs, len)? {
                            Some(data) => {
                                self.links[from].as_mut().expect("checked").rx_have = 0;
                                incoming[k] = Some(Incoming {
                                    sig: theirs,
                                    data,
                                    got: 0,
                                });
                            }
                            None => settled[k] = true,
                        },
                        Ok(None) => {}
                        Err(e) if e.kind == ErrorKind::PeerLost => settled[k] = true,
                        Err(e) => return Err(e),
                    }
                }
                if let Some(m) = incoming[k].as_mut() {
                    let n = read_some(&self.link(from).stream, &mut m.data[m.got..])
                        .map_err(|f| self.fail(f, from, &m.sig, "receiving from"))?;
                    m.got += n;
                    progress |= n > 0;
                    if m.got == m.data.len() {
                        let m = incoming[k].take().expect("read above");
                        parking.park(from, m.sig, m.data);
                        progress = true;
                    }
                }
            }
            let reading = incoming.iter().any(Option::is_some);
            if sent == total && !reading {
                return Ok(());
            }
            if progress {
                continue;
            }
            let mut fds = Vec::with_capacity(1 + others.len());
            if sent < total {
                fds.push(pollfd(self.link(peer).stream.as_raw_fd(), libc::POLLOUT));
            }
            for (k, &from) in others.iter().enumerate() {
                if incoming[k].is_some() || (!settled[k] && sent < total) {
                    let fd = self.link(from).stream.as_raw_fd();
                    match fds.iter_mut().find(|f| f.fd == fd) {
                        Some(f) => f.events |= libc::POLLIN,
                        None => fds.push(pollfd(fd, libc::POLLIN)),
                    }
                }
            }
            if let Err(f) = poll_until(&mut fds, deadline) {
                return Err(match incoming.iter().position(Option::is_some) {
                    Some(k) if sent == total => {
                        self.fail(f, others[k], sig, "waiting for data from")
                    }
                    _ => self.fail(f, peer, sig, "sending to"),
                });
            }
        }
    }
}
