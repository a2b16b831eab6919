//! `Work`: the completion of one op, waited on by the caller, finished by whoever ran it.
//!
//! An op's outcome is `Ok(source)` or its error: `source` is the rank a receive took its
//! message from (the one a receive from any source learns only when it matches), `None` for
//! every other op.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::lock;
use crate::error::Result;

/// A pending op's completion.
#[derive(Clone)]
pub struct Work {
    inner: Arc<WorkState>,
}

/// What an op ends with: the rank a receive's message came from (`None` for other ops).
pub type Outcome = Result<Option<usize>>;

struct WorkState {
    done: Mutex<Option<Outcome>>,
    cv: Condvar,
}

impl Work {
    /// A Work that [`Work::complete`] finishes later.
    pub(super) fn pending() -> Self {
        Work {
            inner: Arc::new(WorkState {
                done: Mutex::new(None),
                cv: Condvar::new(),
            }),
        }
    }

    /// A Work already finished with `r` (an op that ran inline).
    pub(super) fn finished(r: Outcome) -> Self {
        let w = Self::pending();
        w.complete(r);
        w
    }

    /// Records the op's outcome and wakes every waiter.
    pub(super) fn complete(&self, r: Outcome) {
        *lock(&self.inner.done) = Some(r);
        self.inner.cv.notify_all();
    }

    /// Whether `other` is this op's completion (a clone of it).
    pub(super) fn same(&self, other: &Work) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether the op has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        lock(&self.inner.done).is_some()
    }

    /// The rank a finished receive took its message from; `None` for other ops, for a
    /// receive not finished yet and for one that failed.
    pub fn source(&self) -> Option<usize> {
        match &*lock(&self.inner.done) {
            Some(Ok(source)) => *source,
            _ => None,
        }
    }

    /// Waits up to `timeout` (forever if None); the op's own deadline bounds the wait anyway.
    /// Returns Ok(false) if the timeout passed first.
    pub fn wait_for(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = lock(&self.inner.done);
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone().map(|_| true);
            }
            let slice = match deadline {
                None => Duration::from_millis(100),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(false);
                    }
                    (d - now).min(Duration::from_millis(100))
                }
            };
            g = self
                .inner
                .cv
                .wait_timeout(g, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
