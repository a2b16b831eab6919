//! `Work`: the completion of one op, waited on by the caller, finished by whoever ran it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::lock;
use crate::error::Result;

/// A pending op's completion.
#[derive(Clone)]
pub struct Work {
    inner: Arc<WorkState>,
}

struct WorkState {
    done: Mutex<Option<Result<()>>>,
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
    pub(super) fn finished(r: Result<()>) -> Self {
        let w = Self::pending();
        w.complete(r);
        w
    }

    /// Records the op's outcome and wakes every waiter.
    pub(super) fn complete(&self, r: Result<()>) {
        *lock(&self.inner.done) = Some(r);
        self.inner.cv.notify_all();
    }

    /// Whether the op has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        lock(&self.inner.done).is_some()
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
