//! PyO3 bindings: module `shardline._native`. The only code that knows Python.
//!
//! - [`errors`]: the one table from engine error kinds to `shardline.errors` classes.
//! - [`buffer`]: caller memory in, zero copy.
//! - [`group`]: `Group`, `Work`, `Listener` and the arena helpers over [`crate::engine`].
//! - [`signals`]: the program's signal handlers while a caller's thread runs ops.
//! - [`kernels`]: compute kernels over caller tensors (the 1-bit codec, CPU optimizer steps).
//! - [`shard`]: `write_shard` and `ShardReader` over [`crate::shard`].
//! - [`symmetric`]: symmetric memory (segment files, a group's allocations).
//! - [`cuda`]: CUDA events read through the loaded driver (the tracer's GPU times).
//! - [`trace`]: the tracer's timeline lines, encoded in one call.
//!
//! Every setting arrives as an argument: nothing here reads the environment.

mod buffer;
mod cuda;
mod errors;
mod group;
mod kernels;
mod shard;
mod signals;
mod symmetric;
mod trace;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    signals::install();
    m.add_class::<group::PyGroup>()?;
    m.add_class::<group::PyWork>()?;
    m.add_class::<group::PyListener>()?;
    m.add_function(wrap_pyfunction!(group::arena_create, m)?)?;
    m.add_function(wrap_pyfunction!(group::arena_unlink, m)?)?;
    m.add_function(wrap_pyfunction!(group::arena_sweep, m)?)?;
    m.add_class::<symmetric::PySegment>()?;
    m.add_function(wrap_pyfunction!(symmetric::symmetric_create, m)?)?;
    m.add_function(wrap_pyfunction!(symmetric::symmetric_unlink, m)?)?;
    m.add_function(wrap_pyfunction!(symmetric::symmetric_register, m)?)?;
    m.add_function(wrap_pyfunction!(symmetric::symmetric_release, m)?)?;
    m.add_class::<shard::PyShardReader>()?;
    m.add_function(wrap_pyfunction!(shard::write_shard, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::onebit_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::onebit_encode_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::onebit_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::sgd_step, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::tree_sum, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::unit_products, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::unit_row_sums, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::unit_norm_backward, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_events_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_event_create, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_event_record, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_event_query, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_events_elapsed, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_stream_create, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_stream_wait, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_events_fork, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_events_record_pair, m)?)?;
    m.add_function(wrap_pyfunction!(trace::trace_ops_line, m)?)?;
    Ok(())
}
