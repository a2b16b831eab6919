//! CUDA events and streams through the loaded driver ([`crate::cuda_events`]): the tracer's
//! GPU times.
//! Handles are plain integers (torch's `Event.cuda_event`, `Stream.cuda_stream`); the reads
//! of many events run with the GIL released.

use pyo3::prelude::*;

use super::errors::IntoPy;
use crate::cuda_events;

/// Whether this process has loaded a CUDA driver these functions can use.
#[pyfunction]
pub fn cuda_events_available() -> bool {
    cuda_events::available()
}

/// A new event of GPU `device` (its handle; kept for the process's life): one that keeps its
/// time, or with `timing=False` one only to order work by.
#[pyfunction]
#[pyo3(signature = (device, timing = true))]
pub fn cuda_event_create(device: i32, timing: bool) -> PyResult<usize> {
    cuda_events::create(device, timing).py_err()
}

/// Whether GPU `device` is past `event`.
#[pyfunction]
pub fn cuda_event_query(device: i32, event: usize) -> PyResult<bool> {
    cuda_events::query(device, event).py_err()
}

/// Records `event` on `stream` (a raw stream handle; 0: the default stream) of GPU `device`.
#[pyfunction]
pub fn cuda_event_record(device: i32, event: usize, stream: usize) -> PyResult<()> {
    cuda_events::record(device, event, stream).py_err()
}

/// A new stream of GPU `device` (its handle; kept for the process's life).
#[pyfunction]
pub fn cuda_stream_create(device: i32) -> PyResult<usize> {
    cuda_events::stream_create(device).py_err()
}

/// Makes `stream` of GPU `device` wait on the GPU for `event`; the host does not wait.
#[pyfunction]
pub fn cuda_stream_wait(device: i32, stream: usize, event: usize) -> PyResult<()> {
    cuda_events::stream_wait(device, stream, event).py_err()
}

/// Records `start` then `sync` on `stream` of GPU `device`, and makes `side` wait for `sync`
/// (a traced op's way onto its group's stream), in one call.
#[pyfunction]
pub fn cuda_events_fork(
    device: i32,
    stream: usize,
    side: usize,
    start: usize,
    sync: usize,
) -> PyResult<()> {
    cuda_events::fork(device, stream, side, start, sync).py_err()
}

/// Records `first` then `second` on `stream` of GPU `device`, in one call.
#[pyfunction]
pub fn cuda_events_record_pair(
    device: i32,
    stream: usize,
    first: usize,
    second: usize,
) -> PyResult<()> {
    cuda_events::record_pair(device, stream, first, second).py_err()
}

/// For each pair (`firsts[i]`, `seconds[i]`) of GPU `device`'s events, the milliseconds
/// between them; NaN where the driver has no time for the pair.
#[pyfunction]
pub fn cuda_events_elapsed(
    py: Python<'_>,
    device: i32,
    firsts: Vec<usize>,
    seconds: Vec<usize>,
) -> PyResult<Vec<f64>> {
    py.detach(|| cuda_events::elapsed(device, &firsts, &seconds))
        .py_err()
}
