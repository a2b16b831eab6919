//! In a group with several ranks on several hosts, the waits of a collective on a host's
//! shared memory read what the other hosts' ranks send to this one over TCP meanwhile.
//!
//! There an all-reduce runs on each host's shared memory around a TCP all-reduce among the
//! hosts' first ranks; the other ranks wait on the shared memory. A rank that sends a message
//! larger than the sockets' buffers over TCP and then enters the all-reduce waits in its send
//! until the receiver reads. Were the receiver a waiting rank that receives only after the
//! all-reduce, neither would get on (the sender's host would never join the all-reduce) until
//! the deadline. So the arena's waits poll this rank's TCP links at their checks
//! ([`ArenaComm::set_meanwhile`]) and take the point-to-point messages in, as a collective over
//! TCP does ([`crate::transport::tcp::Drain`]), into the mailbox where the receives that
//! follow find them.
//!
//! The waits may run on the arena's helper threads, so the TCP mesh and the mailbox are lent to
//! them for the arena's part of the op (moved behind a lock) and taken back after it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::mailbox::{Mailbox, ParkMeanwhile};
use crate::collectives::arena::ArenaComm;
use crate::error::Result;
use crate::signature::OpSig;
use crate::transport::tcp::{Drain, TcpMesh};

/// How often an idle poll looks at the TCP links (each look is a system call per link), the
/// first time after this long (an op that waits less pays nothing); one with a message
/// arriving polls at every check.
const EVERY: Duration = Duration::from_millis(1);

/// The TCP links and the mailbox, lent to an arena op's waits.
struct Lent {
    mesh: TcpMesh,
    mailbox: Mailbox,
    taking: Drain,
    me: usize,
    sig: OpSig,
    last: Instant,
    busy: bool,
}

impl Lent {
    fn parking(&mut self) -> (&mut TcpMesh, &mut Drain, ParkMeanwhile<'_>) {
        let parking = ParkMeanwhile {
            mailbox: &mut self.mailbox,
            me: self.me,
            during: self.sig,
        };
        (&mut self.mesh, &mut self.taking, parking)
    }

    /// One check's poll: whether a message is still arriving.
    fn poll(&mut self) -> Result<bool> {
        let now = Instant::now();
        if !self.busy && now - self.last < EVERY {
            return Ok(false);
        }
        self.last = now;
        let sig = self.sig;
        let (mesh, taking, mut parking) = self.parking();
        let busy = taking.poll(mesh, &sig, &mut parking)?;
        self.busy = busy;
        Ok(busy)
    }
}

/// Runs `op` on `arena` (this rank's part of the collective `sig` on its host's shared
/// memory) while its waits take in the messages the ranks of `others` send to rank `me` over
/// `mesh` (lent for the while; left alone when there is none), into `mailbox`. A message
/// still arriving when the op is done is read to its end by `deadline`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run<R>(
    arena: &mut ArenaComm,
    mesh: &mut Option<TcpMesh>,
    mailbox: &mut Mailbox,
    others: &[usize],
    me: usize,
    sig: &OpSig,
    deadline: Instant,
    op: impl FnOnce(&mut ArenaComm) -> Result<R>,
) -> Result<R> {
    if others.is_empty() || mesh.is_none() {
        return op(arena);
    }
    let lent = Arc::new(Mutex::new(Some(Lent {
        mesh: mesh.take().expect("checked above"),
        mailbox: std::mem::replace(mailbox, mailbox.empty_like()),
        taking: Drain::new(others.iter().copied()),
        me,
        sig: *sig,
        last: Instant::now(),
        busy: false,
    })));
    let hook = Arc::clone(&lent);
    arena.set_meanwhile(Some(Arc::new(move || {
        let mut lent = hook.lock().unwrap_or_else(PoisonError::into_inner);
        lent.as_mut().map_or(Ok(false), Lent::poll)
    })));
    let done = op(arena);
    arena.set_meanwhile(None);
    let mut back = lent
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .expect("lent once, taken back once");
    let finished = if done.is_ok() {
        let (mesh, taking, mut parking) = back.parking();
        taking.finish(mesh, sig, &mut parking, deadline)
    } else {
        Ok(()) // the op failed: the group is aborted, on every rank
    };
    *mesh = Some(back.mesh);
    *mailbox = back.mailbox;
    finished.and(done)
}
