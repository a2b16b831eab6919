//! The send lane: point-to-point sends to ranks of this host run beside the op queue, on
//! their own thread, so that a send waiting for its receiver never holds up this rank's
//! receives and collectives. An `isend` to a peer followed by a `recv` from the same peer
//! (each rank doing both, as a ring exchange does) then completes at any size, as with Gloo;
//! on the op queue it would deadlock once the message outgrows the channel's ring.
//!
//! Sends keep their issue order among themselves, which is the only order a channel needs
//! (receives stay on the op queue, in order). A blocking send with nothing queued runs on the
//! caller's thread. A failure aborts the arena, which fails every rank's waits on it and
//! breaks the communicator as any failure does.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::op::{sig_of, Op};
use super::{lock, panic_message, Work};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::shm::Arena;

struct Job {
    op: Op,
    work: Work,
    keepalive: Box<dyn Any + Send>,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Job>,
    running: bool,
    closed: bool,
}

struct Lane {
    arena: Arc<Arena>,
    rank: usize,
    world: usize,
    timeout: Duration,
    queue: Mutex<Queue>,
    cv: Condvar,
}

/// The sends of one communicator to the ranks that share its arena.
pub(super) struct SendLane {
    lane: Arc<Lane>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl SendLane {
    /// Starts the lane's thread for sends through `arena`.
    pub(super) fn start(
        arena: Arc<Arena>,
        rank: usize,
        world: usize,
        timeout: Duration,
        name: &str,
    ) -> Result<Self> {
        let lane = Arc::new(Lane {
            arena,
            rank,
            world,
            timeout,
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
        });
        let l2 = lane.clone();
        let thread = std::thread::Builder::new()
            .name(format!("shardline-{name}-r{rank}-send"))
            .spawn(move || l2.run_loop())
            .map_err(|e| Error::io("starting the communicator's send thread", e))?;
        Ok(SendLane {
            lane,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Whether `op` is a send this lane runs: one to a rank of this host.
    pub(super) fn takes(&self, op: &Op) -> bool {
        matches!(op, Op::Send { peer, .. } if self.lane.arena.local_of(*peer).is_some())
    }

    /// Runs the send `op` (validated, [`SendLane::takes`]): inline when blocking and the lane
    /// is idle, else on the lane's thread. `keepalive` is dropped once it is done.
    pub(super) fn submit(
        &self,
        op: Op,
        keepalive: Box<dyn Any + Send>,
        async_op: bool,
    ) -> Result<Work> {
        let mut q = lock(&self.lane.queue);
        if q.closed {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "rank {}: the communicator was shut down; create a new group",
                    self.lane.rank
                ),
            ));
        }
        if !async_op && q.items.is_empty() && !q.running {
            q.running = true;
            drop(q);
            let r = self.lane.send(&op);
            drop(keepalive);
            lock(&self.lane.queue).running = false;
            self.lane.cv.notify_all();
            return Ok(Work::finished(r.map(|()| None)));
        }
        let work = Work::pending();
        q.items.push_back(Job {
            op,
            work: work.clone(),
            keepalive,
        });
        self.lane.cv.notify_all();
        Ok(work)
    }

    /// Runs what is queued, then stops the thread.
    pub(super) fn close(&self) {
        lock(&self.lane.queue).closed = true;
        self.lane.cv.notify_all();
        if let Some(h) = lock(&self.thread).take() {
            let _ = h.join();
        }
    }
}

impl Drop for SendLane {
    fn drop(&mut self) {
        self.close();
    }
}

impl Lane {
    fn run_loop(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if !q.running {
                        if let Some(j) = q.items.pop_front() {
                            q.running = true;
                            break j;
                        }
                        if q.closed {
                            return;
                        }
                    }
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let r = self.send(&job.op);
            job.work.complete(r.map(|()| None));
            drop(job.keepalive);
            lock(&self.queue).running = false;
            self.cv.notify_all();
        }
    }

    /// Moves one message; a failure (or a panic: a bug in the engine) aborts the arena for
    /// every rank, so the caller's wait ends with the error instead of never.
    fn send(&self, op: &Op) -> Result<()> {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.move_one(op)));
        outcome.unwrap_or_else(|panic| {
            let what = panic_message(panic.as_ref());
            let err = Error::new(
                ErrorKind::Protocol,
                format!(
                    "rank {}: internal error in the send lane ({what}); please report it",
                    self.rank
                ),
            );
            self.arena.abort(&err);
            Err(err)
        })
    }

    fn move_one(&self, op: &Op) -> Result<()> {
        let Op::Send { buf, peer, .. } = op else {
            unreachable!("the send lane only takes sends");
        };
        if let Some(e) = self.arena.aborted() {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "rank {}: this group is unusable after an earlier failure ({}); shut it down \
                     and create a new one (or restart the job)",
                    self.rank, e.message
                ),
            ));
        }
        let local = self.arena.local_of(*peer).expect("checked by takes");
        let sig = sig_of(op, self.world);
        let deadline = Instant::now() + self.timeout;
        let r = self.arena.send_to(local, &sig, buf.bytes(), deadline);
        if let Err(e) = &r {
            self.arena.abort(e);
        }
        r
    }
}
