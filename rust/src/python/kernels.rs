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

/// `bytes` as float32 values (torch's float32 tensors are 4-byte aligned).
fn f32s<'a>(bytes: &'a mut [u8], what: &str) -> PyResult<&'a mut [f32]> {
    if bytes.is_empty() {
        return Ok(&mut []); // an empty tensor's pointer may be anything
    }
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| {
        to_py(Error::invalid(format!(
            "{what} is not a 4-byte aligned float32 buffer"
        )))
    })
}

/// `bytes` as read-only values of `T`; `kind` names them in the error ("float32").
fn values_ro<'a, T: bytemuck::Pod>(bytes: &'a [u8], what: &str, kind: &str) -> PyResult<&'a [T]> {
    if bytes.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(bytes).map_err(|_| {
        to_py(Error::invalid(format!(
            "{what} is not a {}-byte aligned {kind} buffer",
            std::mem::size_of::<T>()
        )))
    })
}

/// `bytes` as read-only float32 values.
fn f32s_ro<'a>(bytes: &'a [u8], what: &str) -> PyResult<&'a [f32]> {
    values_ro(bytes, what, "float32")
}

/// `bytes` as read-only int64 values.
fn i64s_ro<'a>(bytes: &'a [u8], what: &str) -> PyResult<&'a [i64]> {
    values_ro(bytes, what, "int64")
}

/// Runs `kernel` on float32 `input` (read) and `out` (written), separate contiguous buffers,
/// with the GIL released.
fn read_write(
    py: Python<'_>,
    (input, what_in): (&Bound<'_, PyAny>, &str),
    (out, what_out): (&Bound<'_, PyAny>, &str),
    kernel: impl FnOnce(&[f32], &mut [f32]) -> crate::error::Result<()> + Send,
) -> PyResult<()> {
    let i = hold(input, false, what_in)?;
    let mut o = hold(out, true, what_out)?;
    let (ib, ob) = (bytes_of(&i), bytes_of_mut(&mut o));
    disjoint(ib, ob, &format!("{what_in} and {what_out}"))?;
    let (i, o) = (f32s_ro(ib, what_in)?, f32s(ob, what_out)?);
    py.detach(|| kernel(i, o)).py_err()
}

/// Sums the `units` rows of float32 `parts` (contiguous, `units * out.numel()` values) into
/// `out` in the canonical tree (see `kernels::tree`), on `threads` threads.
#[pyfunction]
#[pyo3(signature = (parts, out, units, threads=1))]
pub fn tree_sum(
    py: Python<'_>,
    parts: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    units: usize,
    threads: usize,
) -> PyResult<()> {
    // On torch's OpenMP threads (`kernels::openmp`), not a pool of the engine's own.
    read_write(py, (parts, "parts"), (out, "out"), |p, o| {
        kernels::tree::tree_sum(p, units, o, threads)
    })
}

/// Rows `start..stop` of a linear layer's weight gradient for each of `units` units
/// (`dys`: contiguous float32 `units x rows x outs`, `xs`: `units x rows x ins`) into `out`
/// (`units x (stop - start) x ins`), or with `tree` their canonical tree sum
/// (`(stop - start) x ins`); see `kernels::unit_products`.
///
/// `lookups` (with `tree`): `(offsets, idx, dy)`, an embedding's lookups of the weight's rows
/// added onto each unit's product before the tree (`kernels::unit_lookups::Lookups`; int64
/// `offsets` and `idx`, float32 `dy`).
#[pyfunction]
#[pyo3(signature = (dys, xs, out, units, rows, outs, ins, start, stop, tree, threads=1, lookups=None))]
#[allow(clippy::too_many_arguments)]
pub fn unit_products(
    py: Python<'_>,
    dys: &Bound<'_, PyAny>,
    xs: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    units: usize,
    rows: usize,
    outs: usize,
    ins: usize,
    start: usize,
    stop: usize,
    tree: bool,
    threads: usize,
    lookups: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>)>,
) -> PyResult<()> {
    let d = hold(dys, false, "dys")?;
    let x = hold(xs, false, "xs")?;
    let mut o = hold(out, true, "out")?;
    let (db, xb, ob) = (bytes_of(&d), bytes_of(&x), bytes_of_mut(&mut o));
    disjoint(db, ob, "dys and out")?;
    disjoint(xb, ob, "xs and out")?;
    let held = match &lookups {
        None => None,
        Some((offsets, idx, dy)) if tree => Some([
            hold(offsets, false, "offsets")?,
            hold(idx, false, "idx")?,
            hold(dy, false, "lookups' dy")?,
        ]),
        Some(_) => {
            return Err(to_py(Error::invalid(
                "unit products: lookups are added in the tree only (tree=True)",
            )))
        }
    };
    if let Some([_, _, dy]) = &held {
        disjoint(bytes_of(dy), ob, "the lookups' dy and out")?;
    }
    let (d, x, o) = (f32s_ro(db, "dys")?, f32s_ro(xb, "xs")?, f32s(ob, "out")?);
    let lookups = match &held {
        None => None,
        Some([offsets, idx, dy]) => Some(kernels::unit_lookups::Lookups {
            offsets: i64s_ro(bytes_of(offsets), "offsets")?,
            idx: i64s_ro(bytes_of(idx), "idx")?,
            dy: f32s_ro(bytes_of(dy), "the lookups' dy")?,
        }),
    };
    let shape = kernels::unit_products::Shape {
        units,
        rows,
        outs,
        ins,
    };
    // On torch's OpenMP threads (`kernels::openmp`), not a pool of the engine's own.
    py.detach(|| {
        if tree {
            kernels::unit_products::tree_with(d, x, shape, start, stop, lookups, o, threads)
        } else {
            kernels::unit_products::products(d, x, shape, start, stop, o, threads)
        }
    })
    .py_err()
}

/// Per-unit sums over rows of float32 `rows` (contiguous, `units` units of rows of
/// `features`) into `out` (`units x features`), each unit's rows added in order.
#[pyfunction]
#[pyo3(signature = (rows, out, units, features, threads=1))]
pub fn unit_row_sums(
    py: Python<'_>,
    rows: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    units: usize,
    features: usize,
    threads: usize,
) -> PyResult<()> {
    read_write(py, (rows, "rows"), (out, "out"), |r, o| {
        kernels::unit_rows::row_sums(r, units, features, o, threads)
    })
}

/// A layer norm's backward (`kernels::unit_rows::norm_backward`) from float32 `x`, `mean`,
/// `rstd` and `dy`: the per-unit sums into `weight` and `bias` (`units x features` each) and
/// the input's gradient into `dx` (`gamma`: the norm's weight); every output may be None.
#[pyfunction]
#[pyo3(signature = (x, mean, rstd, dy, weight, bias, units, features, threads=1, gamma=None, dx=None))]
#[allow(clippy::too_many_arguments)]
pub fn unit_norm_backward(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    mean: &Bound<'_, PyAny>,
    rstd: &Bound<'_, PyAny>,
    dy: &Bound<'_, PyAny>,
    weight: Option<&Bound<'_, PyAny>>,
    bias: Option<&Bound<'_, PyAny>>,
    units: usize,
    features: usize,
    threads: usize,
    gamma: Option<&Bound<'_, PyAny>>,
    dx: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let mut ins = vec![
        hold(x, false, "x")?,
        hold(mean, false, "mean")?,
        hold(rstd, false, "rstd")?,
        hold(dy, false, "dy")?,
    ];
    let mut names = vec!["x", "mean", "rstd", "dy"];
    if let Some(g) = gamma {
        ins.push(hold(g, false, "gamma")?);
        names.push("gamma");
    }
    let mut outs = Vec::new();
    for (t, name) in [(weight, "weight"), (bias, "bias"), (dx, "dx")] {
        outs.push(t.map(|t| hold(t, true, name)).transpose()?);
    }
    let bytes: Vec<&[u8]> = ins.iter().map(bytes_of).collect();
    let out_bytes: Vec<Option<&mut [u8]>> = outs
        .iter_mut()
        .map(|o| o.as_mut().map(bytes_of_mut))
        .collect();
    let out_names = ["weight", "bias", "dx"];
    for (o, name) in out_bytes.iter().zip(out_names) {
        let Some(o) = o.as_deref() else { continue };
        for (i, what) in bytes.iter().zip(&names) {
            disjoint(i, o, &format!("{what} and {name}"))?;
        }
    }
    for i in 0..out_bytes.len() {
        for j in i + 1..out_bytes.len() {
            if let (Some(a), Some(b)) = (out_bytes[i].as_deref(), out_bytes[j].as_deref()) {
                disjoint(a, b, &format!("{} and {}", out_names[i], out_names[j]))?;
            }
        }
    }
    let (x, mean) = (f32s_ro(bytes[0], "x")?, f32s_ro(bytes[1], "mean")?);
    let (rstd, dy) = (f32s_ro(bytes[2], "rstd")?, f32s_ro(bytes[3], "dy")?);
    let gamma = bytes.get(4).map(|g| f32s_ro(g, "gamma")).transpose()?;
    let [wb, bb, db]: [Option<&mut [u8]>; 3] = out_bytes.try_into().expect("three outputs");
    let w = wb.map(|v| f32s(v, "weight")).transpose()?;
    let b = bb.map(|v| f32s(v, "bias")).transpose()?;
    let d = db.map(|v| f32s(v, "dx")).transpose()?;
    let rows = kernels::unit_rows::NormRows { x, mean, rstd, dy };
    py.detach(|| kernels::unit_rows::norm_backward(rows, units, features, gamma, d, w, b, threads))
        .py_err()
}

/// One Adam (or, with `decoupled`, AdamW) step of float32 `param` with `grad`, its moments
/// updated in place; torch's formulas.
#[pyfunction]
#[pyo3(signature = (param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, decoupled, step, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    exp_avg: &Bound<'_, PyAny>,
    exp_avg_sq: &Bound<'_, PyAny>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    step: u64,
    threads: usize,
) -> PyResult<()> {
    let mut p = hold(param, true, "param")?;
    let g = hold(grad, false, "grad")?;
    let mut m = hold(exp_avg, true, "exp_avg")?;
    let mut v = hold(exp_avg_sq, true, "exp_avg_sq")?;
    let (pb, gb, mb, vb) = (
        bytes_of_mut(&mut p),
        bytes_of(&g),
        bytes_of_mut(&mut m),
        bytes_of_mut(&mut v),
    );
    let all = [
        (&*pb, "param"),
        (gb, "grad"),
        (&*mb, "exp_avg"),
        (&*vb, "exp_avg_sq"),
    ];
    for (i, (a, an)) in all.iter().enumerate() {
        for (b, bn) in &all[i + 1..] {
            disjoint(a, b, &format!("{an} and {bn}"))?;
        }
    }
    let (p, g, m, v) = (
        f32s(pb, "param")?,
        f32s_ro(gb, "grad")?,
        f32s(mb, "exp_avg")?,
        f32s(vb, "exp_avg_sq")?,
    );
    let h = kernels::optim::Adam {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        decoupled,
        step,
    };
    py.detach(|| kernels::run(threads, || kernels::optim::adam(p, g, m, v, &h)))
        .py_err()
}

/// One SGD step of float32 `param` with `grad`; `momentum_buffer` (with `momentum != 0`) is
/// updated in place, starting as the gradient when `first`; torch's formulas.
#[pyfunction]
#[pyo3(signature = (param, grad, momentum_buffer, *, lr, momentum, dampening, weight_decay, nesterov, first, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn sgd_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    momentum_buffer: Option<&Bound<'_, PyAny>>,
    lr: f64,
    momentum: f64,
    dampening: f64,
    weight_decay: f64,
    nesterov: bool,
    first: bool,
    threads: usize,
) -> PyResult<()> {
    let mut p = hold(param, true, "param")?;
    let g = hold(grad, false, "grad")?;
    let mut b = momentum_buffer
        .map(|b| hold(b, true, "momentum_buffer"))
        .transpose()?;
    let (pb, gb) = (bytes_of_mut(&mut p), bytes_of(&g));
    disjoint(pb, gb, "param and grad")?;
    let bb = match b.as_mut() {
        Some(b) => {
            let bb = bytes_of_mut(b);
            disjoint(pb, bb, "param and momentum_buffer")?;
            disjoint(gb, bb, "grad and momentum_buffer")?;
            Some(f32s(bb, "momentum_buffer")?)
        }
        None => None,
    };
    let (p, g) = (f32s(pb, "param")?, f32s_ro(gb, "grad")?);
    let h = kernels::optim::Sgd {
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        first,
    };
    py.detach(|| kernels::run(threads, || kernels::optim::sgd(p, g, bb, &h)))
        .py_err()
}
