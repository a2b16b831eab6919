//! A Python caller's signal handlers, run while its own thread waits inside an op.
//!
//! Blocking ops, and queued ops a caller runs while it waits for them, run on the caller's
//! thread with the GIL released. The program's signal handlers (Ctrl-C's
//! `KeyboardInterrupt`, the flight recorder's `SIGUSR1` dump) would wait for the op to end:
//! up to its deadline when a peer is stuck. While the process's main thread runs ops for its
//! caller ([`Polling`]), its waits (on shared memory, and on sockets, which then sleep at most
//! [`EVERY`] at a time) call [`poll`] or [`raised`], which run the handlers through the hook
//! the Python module sets ([`set_hook`]), at most every [`EVERY`]. A handler
//! that raises fails the op, which aborts the group on every rank as any failure does, and
//! the caller raises the handler's exception.

use std::cell::Cell;
use std::fmt::Display;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// How often a waiting main thread runs its signal handlers.
pub const EVERY: Duration = Duration::from_millis(100);

/// Runs the pending signal handlers; true if one raised (the hook keeps its exception).
pub type Hook = fn() -> bool;

static HOOK: OnceLock<Hook> = OnceLock::new();

thread_local! {
    /// When this thread last ran its handlers, while it runs ops for its caller.
    static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Sets the hook [`poll`] runs the handlers with (once per process; later calls are ignored).
pub fn set_hook(hook: Hook) {
    let _ = HOOK.set(hook);
}

/// While alive, waits on this thread run its signal handlers, if it is the main thread.
pub struct Polling {
    prev: Option<Instant>,
}

impl Polling {
    /// Starts polling on this thread (nothing on other threads: Python runs handlers only on
    /// the main one).
    pub fn start() -> Self {
        let now = is_main_thread().then(Instant::now);
        Polling {
            prev: LAST.with(|l| l.replace(now)),
        }
    }
}

impl Drop for Polling {
    fn drop(&mut self) {
        LAST.with(|l| l.set(self.prev));
    }
}

/// Whether this thread polls: its waits should sleep at most [`EVERY`] at a time.
pub fn polling() -> bool {
    LAST.with(|l| l.get().is_some())
}

/// Runs the handlers if this thread polls and [`EVERY`] has passed since it last did; whether
/// one raised.
pub fn raised() -> bool {
    let due = LAST.with(|l| match l.get() {
        Some(t) if t.elapsed() >= EVERY => {
            l.set(Some(Instant::now()));
            true
        }
        _ => false,
    });
    due && HOOK.get().is_some_and(|hook| hook())
}

/// [`raised`] as an error naming `rank` and `what` it was waiting in.
pub fn poll(rank: usize, what: &dyn Display) -> Result<()> {
    if raised() {
        return Err(interrupted(rank, what));
    }
    Ok(())
}

/// The error of an op whose wait a signal handler's exception ended.
pub fn interrupted(rank: usize, what: &dyn Display) -> Error {
    Error::new(
        ErrorKind::Closed,
        format!(
            "rank {rank} was interrupted in {what}: a signal handler raised while it waited \
             (Ctrl-C?); the group is aborted"
        ),
    )
}

/// Whether this is the process's main thread (the one Python runs signal handlers on).
pub fn is_main_thread() -> bool {
    // SAFETY: getpid and gettid take no arguments and cannot fail.
    unsafe { libc::gettid() == libc::getpid() }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    fn raising() -> bool {
        CALLS.fetch_add(1, Ordering::SeqCst);
        true
    }

    #[test]
    fn only_a_polling_thread_runs_the_hook_and_not_more_often_than_every_slice() {
        set_hook(raising);
        // Not polling: never runs it.
        assert!(poll(0, &"all_reduce").is_ok());
        // On another thread than the main one, starting to poll does nothing either.
        std::thread::spawn(|| {
            let p = Polling::start();
            std::thread::sleep(EVERY);
            assert!(poll(0, &"all_reduce").is_ok());
            drop(p);
        })
        .join()
        .unwrap();
        assert_eq!(CALLS.load(Ordering::SeqCst), 0);
        // As the main thread would: due once EVERY has passed, then not again at once.
        LAST.with(|l| l.set(Some(Instant::now() - EVERY)));
        let e = poll(3, &"all_reduce #7").unwrap_err();
        assert!(
            e.message
                .contains("rank 3 was interrupted in all_reduce #7"),
            "{e:?}"
        );
        assert!(poll(3, &"all_reduce #7").is_ok());
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
        LAST.with(|l| l.set(None));
    }
}
