//! The program's signal handlers while a caller's own thread runs ops ([`crate::interrupt`]).

use std::cell::RefCell;

use pyo3::prelude::*;

use crate::error::Result;
use crate::interrupt::{self, Polling};

thread_local! {
    /// The exception a handler raised while this thread ran an op, for its caller to raise.
    static RAISED: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// [`interrupt::Hook`]: runs the pending handlers with the GIL; keeps what one raised.
fn run_handlers() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            RAISED.with(|r| *r.borrow_mut() = Some(e));
            true
        }
    })
}

/// Makes waits on this process's main thread run its signal handlers (at module import).
pub(super) fn install() {
    interrupt::set_hook(run_handlers);
}

/// Runs `f` (which runs ops on this thread) with the GIL released; the signal handlers run
/// while it waits, and the exception one raised is the error, in place of the op's.
pub(super) fn run_ops<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T> + Send,
) -> PyResult<T> {
    let out = py.detach(|| {
        let _polling = Polling::start();
        f()
    });
    match RAISED.with(|r| r.borrow_mut().take()) {
        Some(e) => Err(e),
        None => out.map_err(super::errors::to_py),
    }
}
