//! Receives: which message a `recv` takes.
//!
//! Messages from one rank arrive in the order it sent them. A receive takes the first message
//! from its source that carries its tag; a receive from any source takes the first such
//! message to arrive from any rank (ranks are looked at in turn, so none is starved). Tags
//! are matched as Gloo and MPI match them: messages ahead of the one a receive wants, with
//! other tags, are *parked*, copied out of the transport into this rank's memory in arrival
//! order, until a receive asks for their tag. A message that matches goes straight from the
//! transport into the receiver's buffer; only messages taken out of order cost a copy.
//!
//! Parked bytes are bounded ([`PARK_LIMIT`]): a program that keeps sending a tag nobody
//! receives fails with an error naming the tags, instead of exhausting memory.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result, LONGER_TIMEOUT};
use crate::signature::{OpKind, OpSig};
use crate::transport::tcp::Parking;

/// Most bytes of messages a rank parks before it fails the receive that would park more.
pub(super) const PARK_LIMIT: usize = 1 << 30;
/// The largest memory of a taken message that a mailbox keeps for the next one to park.
const SPARE_LIMIT: usize = 256 << 20;

/// How a [`Mailbox`] reaches its rank's links, one peer at a time.
pub(super) trait Links {
    /// This rank.
    fn me(&self) -> usize;

    /// The ranks a receive from any source listens to.
    fn peers(&self) -> Vec<usize>;

    /// The signature and byte length of `peer`'s next message, without taking it. With no
    /// `deadline`, `None` when nothing has arrived yet, and a `PeerLost` error that leaves
    /// the links usable when `peer` has left with nothing more to read; with one, waits until
    /// it. `expected` names in errors what this rank waits for.
    fn next(
        &mut self,
        peer: usize,
        expected: &OpSig,
        deadline: Option<Instant>,
    ) -> Result<Option<(OpSig, u64)>>;

    /// Takes `peer`'s next message into `dst`; fails unless it is signed `sig` and holds
    /// exactly `dst.len()` bytes.
    fn take(&mut self, peer: usize, sig: &OpSig, dst: &mut [u8], deadline: Instant) -> Result<()>;
}

/// A message taken ahead of its receive.
struct Parked {
    peer: usize,
    sig: OpSig,
    data: Vec<u8>,
}

/// The messages this rank parked, and where a receive from any source looks first.
pub(super) struct Mailbox {
    parked: VecDeque<Parked>,
    bytes: usize,
    limit: usize,
    /// Index into the peers of the rank a receive from any source looks at first.
    next_any: usize,
    /// The memory of a parked message a receive took (the largest so far, up to
    /// [`SPARE_LIMIT`]), for the next one to park: a fresh allocation of a large message
    /// costs its pages' first writes each time (a 64 MiB exchange over loopback TCP took
    /// 76 ms with them, 42 ms without).
    spare: Vec<u8>,
}

impl Mailbox {
    /// An empty mailbox with this one's limit.
    pub(super) fn empty_like(&self) -> Self {
        Mailbox::new(self.limit)
    }

    /// An empty mailbox that parks up to `limit` bytes.
    pub(super) fn new(limit: usize) -> Self {
        Mailbox {
            parked: VecDeque::new(),
            bytes: 0,
            limit,
            next_any: 0,
            spare: Vec::new(),
        }
    }

    /// Receives into `dst` the next message tagged `want.tag()` from `peer`, or from any
    /// rank when `peer` is `None`; returns the rank it came from. `want` is the receive's
    /// signature: a message with its tag but another size or element type is a mismatch.
    pub(super) fn recv(
        &mut self,
        links: &mut impl Links,
        peer: Option<usize>,
        want: &OpSig,
        dst: &mut [u8],
        deadline: Instant,
    ) -> Result<usize> {
        let tag = want.tag();
        let waiting = |m: &Parked| peer.is_none_or(|p| m.peer == p) && m.sig.tag() == tag;
        if let Some(m) = self.parked.iter().position(waiting) {
            let m = self.parked.remove(m).expect("found above");
            self.bytes -= m.data.len();
            want.check_against(links.me(), &m.sig, m.peer)?;
            dst.copy_from_slice(&m.data);
            if (self.spare.capacity() + 1..=SPARE_LIMIT).contains(&m.data.capacity()) {
                self.spare = m.data;
            }
            return Ok(m.peer);
        }
        loop {
            let (src, theirs, len) = match peer {
                Some(p) => {
                    let (sig, len) = links.next(p, want, Some(deadline))?.expect("waited");
                    (p, sig, len)
                }
                None => self.next_from_any(links, want, deadline)?,
            };
            // A collective's message where a message was expected fails in `take`, naming both.
            if theirs.kind != OpKind::Send || theirs.tag() == tag {
                links.take(src, want, dst, deadline)?;
                return Ok(src);
            }
            self.park(
                links,
                src,
                (theirs, len),
                &format!("it waits for tag {tag}"),
                deadline,
            )?;
        }
    }

    /// The first message to arrive from any peer, looking at each in turn until `deadline`.
    /// A peer that has left with nothing more to read is passed over; once every peer has,
    /// the receive fails with the first one's error.
    fn next_from_any(
        &mut self,
        links: &mut impl Links,
        want: &OpSig,
        deadline: Instant,
    ) -> Result<(usize, OpSig, u64)> {
        let peers = links.peers();
        let mut gone: Vec<Option<Error>> = vec![None; peers.len()];
        let mut round = 0u32;
        loop {
            for k in 0..peers.len() {
                let at = (self.next_any + k) % peers.len();
                if gone[at].is_some() {
                    continue;
                }
                // A peer whose next message is a collective's is not sending to this receive.
                match links.next(peers[at], want, None) {
                    Ok(Some((sig, len))) if sig.kind == OpKind::Send => {
                        self.next_any = (at + 1) % peers.len();
                        return Ok((peers[at], sig, len));
                    }
                    Ok(_) => {}
                    Err(e) if e.kind == ErrorKind::PeerLost => gone[at] = Some(e),
                    Err(e) => return Err(e),
                }
            }
            if gone.iter().all(Option::is_some) {
                let first = gone.into_iter().flatten().next().expect("a peer");
                return Err(first.context(format!(
                    "rank {} waits to receive {want} from any source, but every other rank has \
                     left",
                    links.me()
                )));
            }
            if Instant::now() >= deadline {
                let me = links.me();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {me} timed out receiving {want} from any source: no rank sent it \
                         a message with that tag; check that some rank sends to rank {me} (or \
                         {LONGER_TIMEOUT})"
                    ),
                ));
            }
            pause(round);
            round = round.saturating_add(1);
        }
    }

    /// Takes `peer`'s next message (signed `sig`, `len` bytes) out of the transport and keeps
    /// it for the receive that asks for its tag; `waiting` says, in errors, what this rank
    /// waits for meanwhile.
    fn park(
        &mut self,
        links: &mut impl Links,
        peer: usize,
        (sig, len): (OpSig, u64),
        waiting: &str,
        deadline: Instant,
    ) -> Result<()> {
        let len = self.reserve(links.me(), peer, &sig, len, waiting)?;
        let mut data = self.buffer(len);
        links.take(peer, &sig, &mut data, deadline)?;
        self.parked.push_back(Parked { peer, sig, data });
        Ok(())
    }

    /// `len` bytes to park a message in: the spare memory where it is large enough.
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        if self.spare.capacity() < len {
            return vec![0u8; len];
        }
        let mut data = std::mem::take(&mut self.spare);
        data.resize(len, 0);
        data
    }

    /// Counts `len` more bytes parked for `peer`'s message signed `sig`, or fails when that
    /// would pass the limit or when `len` is not what `sig` holds.
    fn reserve(
        &mut self,
        me: usize,
        peer: usize,
        sig: &OpSig,
        len: u64,
        waiting: &str,
    ) -> Result<usize> {
        let bytes = sig.count.saturating_mul(sig.dtype.size() as u64);
        if len != bytes {
            return Err(Error::protocol(format!(
                "rank {peer} sent {len} bytes for {sig}, which holds {bytes}; the streams are \
                 out of sync"
            )));
        }
        let len = len as usize;
        if self.bytes.saturating_add(len) > self.limit {
            let mut held: Vec<(u32, usize)> =
                self.parked.iter().map(|m| (m.sig.tag(), m.peer)).collect();
            held.push((sig.tag(), peer));
            held.dedup();
            let held: Vec<String> = held
                .iter()
                .map(|(tag, rank)| format!("tag {tag} from rank {rank}"))
                .collect();
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "rank {me} would hold more than {} MiB of messages that no receive has asked \
                     for yet ({}) while {waiting}; receive those tags, or send in the order the \
                     receiver receives",
                    self.limit >> 20,
                    held.join(", "),
                ),
            ));
        }
        self.bytes += len;
        Ok(len)
    }
}

/// A TCP operation of this rank parks, for the receives that follow, the messages that reach
/// this rank while it waits ([`crate::transport::tcp::TcpMesh::send_draining`]) or that come
/// ahead of a collective's ([`crate::transport::tcp::TcpMesh::parking`]). Without this, two
/// ranks that each send to the other before receiving (or a ring of them) wait for each other
/// once their messages outgrow the sockets' buffers, and a message sent before a collective
/// to a rank that enters the collective before it receives stops the collective.
pub(super) struct ParkMeanwhile<'m> {
    pub(super) mailbox: &'m mut Mailbox,
    pub(super) me: usize,
    /// The operation that runs meanwhile: a send that waits for room, or a collective.
    pub(super) during: OpSig,
}

impl Parking for ParkMeanwhile<'_> {
    fn accepts(&mut self, peer: usize, sig: &OpSig, len: u64) -> Result<Option<Vec<u8>>> {
        if sig.kind != OpKind::Send {
            return Ok(None); // a collective's: it waits for the collective
        }
        let waiting = match self.during.kind {
            OpKind::Send => format!("its {} waits for room to send", self.during),
            _ => format!("it runs {}", self.during),
        };
        let len = self.mailbox.reserve(self.me, peer, sig, len, &waiting)?;
        Ok(Some(self.mailbox.buffer(len)))
    }

    fn park(&mut self, peer: usize, sig: OpSig, data: Vec<u8>) {
        self.mailbox.parked.push_back(Parked { peer, sig, data });
    }
}

/// Waits a little before a receive from any source looks at its peers again: a few yields,
/// then sleeps growing from 10 µs to about 1 ms.
fn pause(round: u32) {
    const YIELDS: u32 = 64;
    if round < YIELDS {
        std::thread::yield_now();
    } else {
        let micros = 10u64 << (round - YIELDS).min(7);
        std::thread::sleep(Duration::from_micros(micros));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::dtype::DType;

    /// Links over in-memory queues: `inbox[peer]` holds what `peer` sent, in order.
    struct Queues {
        me: usize,
        world: usize,
        inbox: HashMap<usize, VecDeque<(OpSig, Vec<u8>)>>,
        taken: usize,
    }

    impl Queues {
        fn new(me: usize, world: usize) -> Self {
            Queues {
                me,
                world,
                inbox: HashMap::new(),
                taken: 0,
            }
        }

        fn send(&mut self, from: usize, tag: u32, value: u8, len: usize) {
            let sig = OpSig::new(OpKind::Send, DType::U8, len).with_tag(tag);
            let q = self.inbox.entry(from).or_default();
            q.push_back((sig, vec![value; len]));
        }
    }

    impl Links for Queues {
        fn me(&self) -> usize {
            self.me
        }

        fn peers(&self) -> Vec<usize> {
            (0..self.world).filter(|&r| r != self.me).collect()
        }

        fn next(
            &mut self,
            peer: usize,
            expected: &OpSig,
            deadline: Option<Instant>,
        ) -> Result<Option<(OpSig, u64)>> {
            match self.inbox.get(&peer).and_then(|q| q.front()) {
                Some((sig, data)) => Ok(Some((*sig, data.len() as u64))),
                None if deadline.is_some() => Err(Error::new(
                    ErrorKind::Timeout,
                    format!("nothing from rank {peer} for {expected}"),
                )),
                None => Ok(None),
            }
        }

        fn take(&mut self, peer: usize, sig: &OpSig, dst: &mut [u8], _: Instant) -> Result<()> {
            let (theirs, data) = self.inbox.get_mut(&peer).unwrap().pop_front().unwrap();
            sig.check_against(self.me, &theirs, peer)?;
            dst.copy_from_slice(&data);
            self.taken += 1;
            Ok(())
        }
    }

    fn want(tag: u32, len: usize) -> OpSig {
        OpSig::new(OpKind::Send, DType::U8, len).with_tag(tag)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(200)
    }

    #[test]
    fn a_receive_takes_its_tag_and_parks_what_comes_before() {
        let mut q = Queues::new(0, 2);
        q.send(1, 5, 50, 3);
        q.send(1, 6, 60, 2);
        q.send(1, 5, 51, 3);
        let mut m = Mailbox::new(PARK_LIMIT);
        let mut six = [0u8; 2];
        assert_eq!(
            m.recv(&mut q, Some(1), &want(6, 2), &mut six, soon()),
            Ok(1)
        );
        assert_eq!(six, [60, 60]);
        assert_eq!(m.bytes, 3); // the first tag-5 message waits in the mailbox
        let mut five = [0u8; 3];
        m.recv(&mut q, Some(1), &want(5, 3), &mut five, soon())
            .unwrap();
        assert_eq!(five, [50; 3]); // per tag, in the order sent
        m.recv(&mut q, Some(1), &want(5, 3), &mut five, soon())
            .unwrap();
        assert_eq!(five, [51; 3]);
        assert_eq!((m.bytes, m.parked.len(), q.taken), (0, 0, 3));
    }

    #[test]
    fn any_source_takes_the_first_message_and_reports_its_sender() {
        let mut q = Queues::new(1, 3);
        q.send(2, 0, 20, 1);
        q.send(0, 0, 0, 1);
        let mut m = Mailbox::new(PARK_LIMIT);
        let mut out = [9u8; 1];
        let first = m.recv(&mut q, None, &want(0, 1), &mut out, soon()).unwrap();
        let second = m.recv(&mut q, None, &want(0, 1), &mut out, soon()).unwrap();
        assert_eq!({ first.min(second) }, 0);
        assert_eq!({ first.max(second) }, 2);
        assert_eq!(out[0] as usize, second * 10);
        let r = m.recv(&mut q, None, &want(0, 1), &mut out, Instant::now());
        let err = r.unwrap_err();
        assert_eq!(err.kind, ErrorKind::Timeout);
        assert!(err.message.contains("from any source"), "{}", err.message);
    }

    #[test]
    fn a_parked_message_of_another_size_is_a_mismatch() {
        let mut q = Queues::new(0, 2);
        q.send(1, 7, 1, 4);
        q.send(1, 8, 1, 1);
        let mut m = Mailbox::new(PARK_LIMIT);
        m.recv(&mut q, Some(1), &want(8, 1), &mut [0u8; 1], soon())
            .unwrap();
        let err = m
            .recv(&mut q, Some(1), &want(7, 2), &mut [0u8; 2], soon())
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Mismatch);
        assert!(err.message.contains("tag=7"), "{}", err.message);
    }

    #[test]
    fn parking_past_the_limit_fails_naming_the_tags() {
        let mut q = Queues::new(0, 2);
        q.send(1, 3, 0, 8);
        q.send(1, 4, 0, 8);
        q.send(1, 9, 0, 1);
        let mut m = Mailbox::new(10);
        let err = m
            .recv(&mut q, Some(1), &want(9, 1), &mut [0u8; 1], soon())
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Mismatch);
        assert!(
            err.message.contains("tag 3 from rank 1, tag 4 from rank 1"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_send_parks_what_arrives_meanwhile_within_the_limit() {
        let mut m = Mailbox::new(10);
        let sending = want(1, 64);
        let mut p = ParkMeanwhile {
            mailbox: &mut m,
            me: 0,
            during: sending,
        };
        // A collective's message is left for the collective; a send's is taken.
        let barrier = OpSig::new(OpKind::Barrier, DType::U8, 0);
        assert_eq!(p.accepts(1, &barrier, 0), Ok(None));
        assert_eq!(p.accepts(1, &want(2, 6), 6), Ok(Some(vec![0; 6])));
        p.park(1, want(2, 6), vec![7; 6]);
        let err = p.accepts(2, &want(3, 5), 5).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Mismatch);
        assert!(
            err.message.contains("tag 2 from rank 1, tag 3 from rank 2")
                && err
                    .message
                    .contains("while its send(uint8, 64, tag=1) waits for room"),
            "{}",
            err.message
        );
        let short = p.accepts(1, &want(4, 3), 2).unwrap_err();
        assert_eq!(short.kind, ErrorKind::Protocol, "{}", short.message);
        // The receive that follows takes the parked message, with nothing left in the links.
        let mut q = Queues::new(0, 2);
        let mut got = [0u8; 6];
        assert_eq!(
            m.recv(&mut q, Some(1), &want(2, 6), &mut got, soon()),
            Ok(1)
        );
        assert_eq!((got, m.bytes, q.taken), ([7; 6], 0, 0));
    }
}
