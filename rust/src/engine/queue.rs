//! The op queue: the worker thread that runs queued ops in order, and a waiting caller that
//! runs them itself when the worker has not started them.
//!
//! At most one op runs at a time (`Queue::running`), whoever runs it: the worker, a blocking
//! caller with nothing queued ([`super::Communicator::submit`]) or a caller waiting for a
//! queued op ([`run_until`]). Every one takes the op at the front, so ops run in issue order.

use std::any::Any;
use std::collections::VecDeque;

use super::{lock, Op, Outcome, Shared, Work};
use crate::error::{Error, ErrorKind};

pub(super) struct Job {
    pub(super) op: Op,
    pub(super) work: Work,
    pub(super) keepalive: Box<dyn Any + Send>,
    /// Submitted with `async_op`: it overlaps the caller's compute, so no helper threads.
    pub(super) async_op: bool,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) items: VecDeque<Job>,
    /// Ops being run (0 or 1): by the worker, by a blocking caller or by a waiting one.
    pub(super) running: usize,
    pub(super) closed: bool,
}

/// Runs one op; a panic (a bug in the engine) becomes an error on this rank, breaks the
/// communicator like any failure, and leaves the queue usable for the error to surface.
///
/// `helpers`: whether a large shared-memory op may split its passes over the communicator's
/// helper threads. Only ops the caller waits for do: an async op runs beside the caller's
/// compute, whose cores the helpers would take.
pub(super) fn run_guarded(shared: &Shared, op: &Op, helpers: bool) -> Outcome {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lock(&shared.core).run(op, helpers)
    }));
    outcome.unwrap_or_else(|panic| {
        let what = panic_message(panic.as_ref());
        let err = Error::new(
            ErrorKind::Protocol,
            format!(
                "rank {}: internal error in the collective engine ({what}); please report it",
                shared.rank
            ),
        );
        lock(&shared.core).fail(&err);
        Err(err)
    })
}

/// What a caught panic says (its `&str` or `String` payload).
pub(super) fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

pub(super) fn worker_loop(shared: &Shared) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if q.running == 0 {
                    if let Some(j) = q.items.pop_front() {
                        q.running += 1;
                        break j;
                    }
                    if q.closed {
                        return;
                    }
                }
                q = shared.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let helpers = !job.async_op;
        finish(shared, job, helpers);
    }
}

/// Runs `job`, records its outcome and frees the queue for the next op.
fn finish(shared: &Shared, job: Job, helpers: bool) {
    let _running = Running(shared);
    let r = run_guarded(shared, &job.op, helpers);
    job.work.complete(r);
    drop(job.keepalive);
}

/// Frees the queue for the next op when dropped, also if dropping a job's buffers panicked
/// (the worker would otherwise wait for an op that nobody runs).
struct Running<'a>(&'a Shared);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        lock(&self.0.queue).running -= 1;
        self.0.cv.notify_all();
    }
}

/// A caller about to wait for `work` runs the queued ops up to it itself, while the worker
/// is not running one: the ops would run in the same order, and the caller need not wait for
/// the worker to get a core, which a host whose cores all compute gives milliseconds late.
/// Async ops use the helper threads only when the process's main thread waits: its compute
/// waits too, while another thread's wait (a completion thread) may be beside it. Returns at
/// once when `work` is not queued here (done, being run, or on the send lane).
pub(super) fn run_until(shared: &Shared, work: &Work) {
    while !work.is_completed() {
        let job = {
            let mut q = lock(&shared.queue);
            if q.running != 0 || !q.items.iter().any(|j| j.work.same(work)) {
                return;
            }
            let Some(job) = q.items.pop_front() else {
                return;
            };
            q.running += 1;
            job
        };
        let helpers = !job.async_op || crate::interrupt::is_main_thread();
        finish(shared, job, helpers);
    }
}
