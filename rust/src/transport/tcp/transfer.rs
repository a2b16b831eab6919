//! The transfer every message over the mesh is: a message sent and one received side by
//! side, on non-blocking sockets, until both are done ([`P2p`] for [`TcpMesh`]).

use std::os::fd::AsRawFd;
use std::time::Instant;

use super::draining::{Drain, Incoming, Parking};
use super::frame::{self, FrameType, Header, HEADER_BYTES};
use super::sockio::{poll_until, pollfd, read_some, write_some};
use super::TcpMesh;
use crate::error::Result;
use crate::signature::{OpKind, OpSig};
use crate::transport::p2p::P2p;

impl TcpMesh {
    /// Sends `out`'s message and receives `inp`'s, side by side. With `park` (a collective's
    /// transfer, [`TcpMesh::parking`]): a point-to-point message ahead of the collective's on
    /// `inp`'s link is taken in and kept, and while the transfer waits, so are the messages
    /// on the drain's links.
    pub(super) fn transfer_with(
        &mut self,
        out: Option<(usize, &[u8])>,
        inp: Option<(usize, &mut [u8])>,
        sig: &OpSig,
        deadline: Instant,
        park: Option<(&mut dyn Parking, Drain)>,
    ) -> Result<()> {
        let peers = out.as_ref().map(|o| o.0).into_iter();
        self.usable(peers.chain(inp.as_ref().map(|i| i.0)), sig)?;
        let r = self.transfer_inner(out, inp, sig, deadline, park);
        if let Err(e) = &r {
            self.broken = Some(e.clone());
        }
        r
    }

    fn transfer_inner(
        &mut self,
        out: Option<(usize, &[u8])>,
        inp: Option<(usize, &mut [u8])>,
        sig: &OpSig,
        deadline: Instant,
        mut park: Option<(&mut dyn Parking, Drain)>,
    ) -> Result<()> {
        let payload_len = out.as_ref().map_or(0, |o| o.1.len()) as u64;
        let header = Header {
            frame_type: FrameType::Data,
            flags: 0,
            group: self.group,
            sig: Some(*sig),
            payload_len,
        };
        let ohdr = frame::encode_header(&header);
        let (mut sent, total) = (0usize, HEADER_BYTES + payload_len as usize);
        let (to, body) = out.map_or((usize::MAX, &[][..]), |(p, b)| (p, b));
        let sending = to != usize::MAX;
        let (from, dst) = inp.map_or((usize::MAX, &mut [][..]), |(p, d)| (p, d));
        let receiving = from != usize::MAX;
        // A receive starts from the header `peek` read ahead, if any.
        let (mut ihdr, mut hgot) = ([0u8; HEADER_BYTES], 0usize);
        if receiving {
            let link = self.links[from].as_mut().expect("checked");
            (ihdr, hgot) = (link.rx_head, std::mem::take(&mut link.rx_have));
        }
        let mut got = 0usize;
        let mut checked = false;
        // A point-to-point message ahead of the collective's on `from`'s link, being taken in.
        let mut ahead: Option<Incoming> = None;
        let mut out_done = !sending;
        let mut in_done = !receiving;
        if sending {
            self.links[to].as_mut().expect("checked").tx_dirty = true;
        }
        let mut spin_until: Option<Instant> = None;
        while !(out_done && in_done) {
            let mut progress = false;
            if !out_done {
                let s = &self.link(to).stream;
                let (h, b) = if sent < HEADER_BYTES {
                    (&ohdr[sent..], body)
                } else {
                    (&[][..], &body[sent - HEADER_BYTES..])
                };
                let reading_same = receiving && from == to && (hgot > 0 || got > 0);
                let n =
                    write_some(s, h, b).map_err(|f| self.send_failed(f, to, sig, !reading_same))?;
                sent += n;
                progress |= n > 0;
                if sent == total {
                    out_done = true;
                    self.links[to].as_mut().expect("checked").tx_dirty = false;
                }
            }
            while !in_done {
                let s = &self.link(from).stream;
                let n = if let Some(m) = ahead.as_mut() {
                    let n = read_some(s, &mut m.data[m.got..])
                        .map_err(|f| self.fail(f, from, &m.sig, "receiving from"))?;
                    m.got += n;
                    n
                } else if hgot < HEADER_BYTES {
                    let n = read_some(s, &mut ihdr[hgot..])
                        .map_err(|f| self.fail(f, from, sig, "receiving from"))?;
                    hgot += n;
                    n
                } else {
                    let n = read_some(s, &mut dst[got..])
                        .map_err(|f| self.fail(f, from, sig, "receiving from"))?;
                    got += n;
                    n
                };
                if hgot == HEADER_BYTES && !checked && ahead.is_none() {
                    ahead = match park.as_mut() {
                        Some((p, _)) => self.message_ahead(from, &ihdr, sig, &mut **p)?,
                        None => None,
                    };
                    if ahead.is_none() {
                        self.check(from, &ihdr, sig, dst.len(), deadline)?;
                        checked = true;
                    }
                }
                if ahead.as_ref().is_some_and(|m| m.got == m.data.len()) {
                    // A message ahead of the collective's, taken in whole: on to the next.
                    let m = ahead.take().expect("tested above");
                    park.as_mut()
                        .expect("taken in with it")
                        .0
                        .park(from, m.sig, m.data);
                    (hgot, progress) = (0, true);
                    continue;
                }
                in_done = checked && got == dst.len();
                progress |= n > 0;
                if n == 0 {
                    break;
                }
            }
            if progress {
                spin_until = None;
            } else if !in_done && !self.spin.is_zero() {
                // Retry the non-blocking read for a while: a message that is about to arrive
                // is taken without the wake-up latency of a sleep in poll(2).
                let now = Instant::now();
                if now < *spin_until.get_or_insert(now + self.spin) {
                    std::hint::spin_loop();
                    continue;
                }
            }
            if !progress && (!out_done || !in_done) {
                // The messages the others' sockets bring meanwhile: those being taken in read
                // on, and the sockets with news, once the poll below says which, looked at.
                if let Some((p, drain)) = park.as_mut() {
                    if drain.step(self, sig, false, &mut **p)? {
                        continue;
                    }
                }
                let mut fds = Vec::with_capacity(2);
                if !out_done {
                    fds.push(pollfd(self.link(to).stream.as_raw_fd(), libc::POLLOUT));
                }
                if !in_done {
                    let fd = self.link(from).stream.as_raw_fd();
                    match fds.first_mut() {
                        Some(f) if f.fd == fd => f.events |= libc::POLLIN,
                        _ => fds.push(pollfd(fd, libc::POLLIN)),
                    }
                }
                if let Some((_, drain)) = park.as_ref() {
                    drain.watch(self, &mut fds, true);
                }
                if let Err(f) = poll_until(&mut fds, deadline) {
                    let (peer, doing) = if in_done {
                        (to, "sending to")
                    } else {
                        (from, "waiting for data from")
                    };
                    return Err(self.fail(f, peer, sig, doing));
                }
                if let Some((p, drain)) = park.as_mut() {
                    drain.look_ready(self, sig, &fds, &mut **p)?;
                }
            }
        }
        match park {
            Some((p, mut drain)) => drain.finish(self, sig, p, deadline),
            None => Ok(()),
        }
    }

    /// The point-to-point message whose header `hb` is, from `peer`, ahead of the message of
    /// the collective `sig` on its link, where `parking` takes it in: where to read it to.
    fn message_ahead(
        &mut self,
        peer: usize,
        hb: &[u8; HEADER_BYTES],
        sig: &OpSig,
        parking: &mut dyn Parking,
    ) -> Result<Option<Incoming>> {
        if matches!(sig.kind, OpKind::Send | OpKind::Recv) {
            return Ok(None);
        }
        let Ok(h) = frame::decode_header(hb) else {
            return Ok(None); // `check` names what is wrong with it
        };
        let theirs = match h.sig {
            Some(theirs) if h.frame_type == FrameType::Data && h.group == self.group => theirs,
            _ => return Ok(None),
        };
        if theirs.kind != OpKind::Send {
            return Ok(None);
        }
        Ok(parking
            .accepts(peer, &theirs, h.payload_len)?
            .map(|data| Incoming {
                sig: theirs,
                data,
                got: 0,
            }))
    }
}

impl P2p for TcpMesh {
    fn rank(&self) -> usize {
        self.rank
    }

    fn transfer(
        &mut self,
        out: Option<(usize, &[u8])>,
        inp: Option<(usize, &mut [u8])>,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        self.transfer_with(out, inp, sig, deadline, None)
    }
}
