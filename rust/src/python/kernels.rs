//! Compute kernels over caller tensors: thin adapters over [`crate::kernels`]. Buffers are
//! borrowed zero copy and every kernel runs with the GIL released, on `threads` threads.

use pyo3::prelude::*;

use super::buffer::{bytes_of, bytes_of_mut, hold};
use super::errors::{to_py, IntoPy};
use crate::error::Error;
use crate::kernels;

/// Refuses two arguments that share memory (the kernels read one while writing the other).
fn disjoint(a: &[u8], b: &[u8], what: &str) -> PyResult<()> {
    let (a0, b0) = (a.as_ptr() as usize, b.as_ptr() as usize);
    if a0 < b0 + b.len() && b0 < a0 + a.len() {
        return Err(to_py(Error::invalid(format!(
            "{what} share memory; pass separate tensors"
        ))));
    }
    Ok(())
}

/// Encodes `values` (contiguous float32, rows of `length`) into `codes` (uint8, rows of
/// `length / 8 + 4 * length / block` bytes); with `feedback`, `values` is left holding the
/// residual.
#[pyfunction]
#[pyo3(signature = (values, codes, length, block, feedback, threads=1))]
pub fn onebit_encode(
    py: Python<'_>,
    values: &Bound<'_, PyAny>,
    codes: &Bound<'_, PyAny>,
    length: usize,
    block: usize,
    feedback: bool,
    threads: usize,
) -> PyResult<()> {
    let mut v = hold(values, true, "values")?;
    let mut c = hold(codes, true, "codes")?;
    let (vb, cb) = (bytes_of_mut(&mut v), bytes_of_mut(&mut c));
    disjoint(vb, cb, "values and codes")?;
    py.detach(|| {
        kernels::run(threads, || {
            kernels::onebit::encode(vb, cb, length, block, feedback)
        })
    })
    .py_err()
}

/// Encodes `values` (contiguous float32) cut into chunks of `chunk` values, each padded to
/// `length`, into `codes`; the value encoded is `values + residual`, and `residual` (when
/// given) is left holding what the encoding dropped.
#[pyfunction]
#[pyo3(signature = (values, residual, codes, chunk, length, block, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn onebit_encode_chunks(
    py: Python<'_>,
    values: &Bound<'_, PyAny>,
    residual: Option<&Bound<'_, PyAny>>,
    codes: &Bound<'_, PyAny>,
    chunk: usize,
    length: usize,
    block: usize,
    threads: usize,
) -> PyResult<()> {
    let v = hold(values, false, "values")?;
    let mut r = residual.map(|r| hold(r, true, "residual")).transpose()?;
    let mut c = hold(codes, true, "codes")?;
    let vb = bytes_of(&v);
    let cb = bytes_of_mut(&mut c);
    let rb = r.as_mut().map(bytes_of_mut);
    disjoint(vb, cb, "values and codes")?;
    if let Some(rb) = rb.as_deref() {
        disjoint(vb, rb, "values and residual")?;
        disjoint(rb, cb, "residual and codes")?;
    }
    py.detach(|| {
        kernels::run(threads, || {
            kernels::onebit::encode_chunks(vb, rb, cb, chunk, length, block)
        })
    })
    .py_err()
}

/// Decodes `codes` into `out` (float32): with `sum`, the sum of the rows (`length` values),
/// else every row.
#[pyfunction]
#[pyo3(signature = (codes, out, length, block, sum, threads=1))]
pub fn onebit_decode(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    length: usize,
    block: usize,
    sum: bool,
    threads: usize,
) -> PyResult<()> {
    let c = hold(codes, false, "codes")?;
    let mut o = hold(out, true, "out")?;
    let (cb, ob) = (bytes_of(&c), bytes_of_mut(&mut o));
    disjoint(cb, ob, "codes and out")?;
    py.detach(|| {
        kernels::run(threads, || {
            kernels::onebit::decode(cb, length, block, ob, sum)
        })
    })
    .py_err()
}
