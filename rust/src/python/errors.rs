//! Engine errors to Python exceptions; the hierarchy itself lives in `shardline.errors`.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::error::{Error, ErrorKind};

/// The one table: the class in `shardline.errors` that each engine error kind becomes.
pub fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Timeout => "CollectiveTimeoutError",
        ErrorKind::PeerLost => "PeerLostError",
        ErrorKind::Mismatch => "CollectiveMismatchError",
        ErrorKind::InvalidArgument => "InvalidArgumentError",
        ErrorKind::Auth => "AuthenticationError",
        ErrorKind::Protocol => "ProtocolError",
        ErrorKind::Io => "TransportError",
        ErrorKind::Closed => "CommunicatorClosedError",
        ErrorKind::Checkpoint => "CheckpointError",
    }
}

/// Converts an engine error into the `shardline.errors` class of its kind.
pub fn to_py(err: Error) -> PyErr {
    let name = class_name(err.kind);
    Python::attach(|py| {
        let class = py.import("shardline.errors").and_then(|m| m.getattr(name));
        match class.and_then(|c| c.call1((err.message.clone(),))) {
            Ok(exc) => PyErr::from_value(exc),
            Err(_) => PyRuntimeError::new_err(format!("{name}: {}", err.message)),
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
