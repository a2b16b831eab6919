//! Engine errors to Python exceptions; the hierarchy itself lives in `shardline.errors`.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::error::Error;

/// Converts an engine error into the `shardline.errors` class its kind names.
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| {
        let class = py
            .import("shardline.errors")
            .and_then(|m| m.getattr(err.kind.python_class()));
        match class.and_then(|c| c.call1((err.message.clone(),))) {
            Ok(exc) => PyErr::from_value(exc),
            Err(_) => {
                PyRuntimeError::new_err(format!("{}: {}", err.kind.python_class(), err.message))
            }
        }
    })
}

/// `Result<T, Error>` to `PyResult<T>`.
pub trait IntoPy<T> {
    /// Maps the error with [`to_py`].
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for crate::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
