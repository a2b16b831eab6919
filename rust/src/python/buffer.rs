//! Caller memory in, zero copy: any C-contiguous buffer-protocol object.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;

use super::errors::to_py;
use crate::engine::RawBuf;
use crate::error::Error;

/// A buffer held for the duration of an op.
pub struct Held {
    /// The Python buffer view (keeps the exporter alive and its memory pinned).
    pub view: PyUntypedBuffer,
    /// Pointer and length for the engine.
    pub raw: RawBuf,
}

/// Borrows `obj`'s memory; `writable` demands a writable buffer. `what` names the argument.
pub fn hold(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Held> {
    let view = PyUntypedBuffer::get(obj).map_err(|e| {
        to_py(Error::invalid(format!(
            "{what} must be a contiguous CPU tensor's memory or a numpy array (buffer protocol): {e}"
        )))
    })?;
    if !view.is_c_contiguous() {
        return Err(to_py(Error::invalid(format!(
            "{what} is not contiguous; call .contiguous() (torch) or np.ascontiguousarray first"
        ))));
    }
    if writable && view.readonly() {
        return Err(to_py(Error::invalid(format!(
            "{what} is read-only but the op writes into it"
        ))));
    }
    // [Note: buffer ownership] `view` pins the exporter's memory until it is dropped; the op
    // that receives `raw` completes before `view` goes (sync calls hold it on the stack, async
    // ones hand it to the engine as the op's keep-alive).
    // SAFETY: see the note: the memory stays valid while `view` lives.
    let raw = unsafe { RawBuf::new(view.buf_ptr() as *mut u8, view.len_bytes()) };
    Ok(Held { view, raw })
}
