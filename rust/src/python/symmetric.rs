//! Symmetric memory for Python: create a rank's segment file, map a group's allocation.

use std::sync::Arc;

use pyo3::prelude::*;

use super::errors::IntoPy;
use super::group::PyGroup;
use crate::transport::shm::{self, segment};

/// One rank's segment of a symmetric allocation; while it lives, so does the mapping.
#[pyclass(name = "SymmetricSegment", module = "shardline._native", frozen)]
pub struct PySegment {
    seg: Arc<segment::Segment>,
    index: usize,
}

#[pymethods]
impl PySegment {
    /// Address of the mapping.
    #[getter]
    fn address(&self) -> usize {
        self.seg.ptr() as usize
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.seg.len()
    }

    /// The allocation's index in its group (the same on every rank).
    #[getter]
    fn index(&self) -> usize {
        self.index
    }
}

/// Creates this rank's segment file (O_EXCL, mode 0600, zero-filled) of `nbytes` bytes.
#[pyfunction]
pub fn symmetric_create(path: &str, nbytes: usize) -> PyResult<()> {
    segment::create(path, nbytes).py_err()
}

/// Removes a segment file's name; ranks that mapped it keep it.
#[pyfunction]
pub fn symmetric_unlink(path: &str) -> PyResult<()> {
    shm::unlink(path).py_err()
}

/// Maps every rank's segment file of one allocation (`paths` by group rank) into `group`'s
/// collectives; this rank's segment. Every rank registers its allocations in the same order.
#[pyfunction]
pub fn symmetric_register(
    py: Python<'_>,
    group: &PyGroup,
    paths: Vec<String>,
    nbytes: usize,
) -> PyResult<PySegment> {
    let comm = group.comm()?;
    let (index, seg) = py
        .detach(|| comm.register_symmetric(&paths, nbytes))
        .py_err()?;
    Ok(PySegment { seg, index })
}

/// Forgets allocation `index` of `group` on this rank: its mappings of the other ranks'
/// segments go (this rank's own stays while a tensor on it lives).
#[pyfunction]
pub fn symmetric_release(py: Python<'_>, group: &PyGroup, index: usize) -> PyResult<()> {
    let comm = group.comm()?;
    py.detach(|| comm.release_symmetric(index)).py_err()
}
