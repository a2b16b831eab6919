//! Caller memory in, zero copy: a buffer-protocol object (numpy array, memoryview) or a
//! contiguous CPU torch tensor, recognised by its `data_ptr()`/`nbytes` (Rust never imports
//! torch).

use pyo3::buffer::PyUntypedBuffer;
use pyo3::intern;
use pyo3::prelude::*;

use super::errors::to_py;
use crate::engine::RawBuf;
use crate::error::Error;

/// What keeps an op's memory alive and pinned (held only for its `Drop`).
#[allow(dead_code)]
pub enum Keep {
    /// A buffer view (pins the exporter's memory until released).
    View(PyUntypedBuffer),
    /// A reference to a tensor (its storage lives as long as the tensor).
    Object(Py<PyAny>),
}

/// A buffer held for the duration of an op.
pub struct Held {
    /// Keeps the memory valid.
    pub keep: Keep,
    /// Pointer and length for the engine.
    pub raw: RawBuf,
}

fn invalid(msg: String) -> PyErr {
    to_py(Error::invalid(msg))
}

/// Borrows `obj`'s memory; `writable` demands a writable buffer. `what` names the argument.
pub fn hold(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Held> {
    // SAFETY: `obj` is a valid object reference for the duration of the call.
    let has_buffer = unsafe { pyo3::ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 1;
    if !has_buffer {
        return hold_tensor(obj, what);
    }
    let view = PyUntypedBuffer::get(obj).map_err(|e| {
        invalid(format!(
            "{what} must be a contiguous CPU tensor or a numpy array: {e}"
        ))
    })?;
    if !view.is_c_contiguous() {
        return Err(invalid(format!(
            "{what} is not contiguous; call .contiguous() (torch) or np.ascontiguousarray first"
        )));
    }
    if writable && view.readonly() {
        return Err(invalid(format!(
            "{what} is read-only but the op writes into it"
        )));
    }
    // [Note: buffer ownership] `keep` pins the memory until it is dropped; the op that
    // receives `raw` completes before that (sync calls hold it on the stack, async ones hand
    // it to the engine as the op's keep-alive).
    // SAFETY: see the note: the memory stays valid while the view lives.
    let raw = unsafe { RawBuf::new(view.buf_ptr() as *mut u8, view.len_bytes()) };
    Ok(Held {
        keep: Keep::View(view),
        raw,
    })
}

fn hold_tensor(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Held> {
    let py = obj.py();
    let not_tensor = |_| {
        invalid(format!(
            "{what} must be a contiguous CPU torch tensor or a buffer-protocol object (numpy \
             array), got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    };
    let is_cpu: bool = obj
        .getattr(intern!(py, "is_cpu"))
        .and_then(|v| v.extract())
        .map_err(not_tensor)?;
    if !is_cpu {
        return Err(invalid(format!(
            "{what} is not a CPU tensor; use the NCCL backend or call .cpu()"
        )));
    }
    let contiguous: bool = obj
        .call_method0(intern!(py, "is_contiguous"))
        .and_then(|v| v.extract())
        .map_err(not_tensor)?;
    if !contiguous {
        return Err(invalid(format!(
            "{what} is not contiguous; call .contiguous() first"
        )));
    }
    let ptr: usize = obj
        .call_method0(intern!(py, "data_ptr"))
        .and_then(|v| v.extract())
        .map_err(not_tensor)?;
    let nbytes: usize = obj
        .getattr(intern!(py, "nbytes"))
        .and_then(|v| v.extract())
        .map_err(not_tensor)?;
    // SAFETY: a contiguous CPU tensor owns `nbytes` bytes at `data_ptr()`; the reference kept
    // in `Keep::Object` keeps its storage alive until the op is done (see the note in `hold`).
    let raw = unsafe { RawBuf::new(ptr as *mut u8, nbytes) };
    Ok(Held {
        keep: Keep::Object(obj.clone().unbind()),
        raw,
    })
}

/// The bytes `held` pins.
pub fn bytes_of(held: &Held) -> &[u8] {
    let (ptr, len) = (held.raw.as_ptr(), held.raw.len());
    if len == 0 {
        return &[];
    }
    // SAFETY: `hold` checked that the object exports `len` contiguous bytes at `ptr`, and
    // `held` keeps them pinned for as long as the returned borrow of `held` lives.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// The writable bytes `held` pins (checked writable by `hold(.., true, ..)`).
pub fn bytes_of_mut(held: &mut Held) -> &mut [u8] {
    let (ptr, len) = (held.raw.as_ptr(), held.raw.len());
    if len == 0 {
        return &mut [];
    }
    // SAFETY: as in `bytes_of`; the buffer was checked writable, and the exclusive borrow of
    // `held` keeps this the only Rust reference to it.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}
