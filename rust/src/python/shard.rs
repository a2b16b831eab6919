//! Checkpoint shard files: thin adapters over [`crate::shard`]. `write_shard` writes one;
//! `ShardReader` is one open file (mapped, its header validated once) serving reads. Buffers
//! are borrowed zero copy and every read or write runs with the GIL released.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::buffer::{bytes_of, bytes_of_mut, hold, Held};
use super::errors::{to_py, IntoPy};
use crate::dtype::DType;
use crate::error::Error;
use crate::shard::{self, Encoding, ShardHeader, ShardReader, TensorData, WriteOptions};

fn invalid(msg: String) -> PyErr {
    to_py(Error::invalid(msg))
}

fn non_negative(value: i64, what: &str) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| invalid(format!("{what} must be >= 0, got {value}")))
}

/// One `(name, dtype, shape, data)` item of `write_shard`'s `tensors`.
struct Spec {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    held: Held,
}

fn parse_spec(i: usize, item: &Bound<'_, PyAny>) -> PyResult<Spec> {
    let (name, dtype, shape, data): (String, String, Vec<i64>, Bound<'_, PyAny>) =
        item.extract().map_err(|e: PyErr| {
            invalid(format!(
                "tensors[{i}] must be a (name: str, dtype: str, shape: list[int], data: buffer) \
                 tuple: {e}"
            ))
        })?;
    let dtype = DType::parse_safetensors(&dtype)
        .map_err(|e| to_py(e.context(format!("tensor {name:?}"))))?;
    let shape = shape
        .into_iter()
        .map(|d| non_negative(d, &format!("every dimension of tensor {name:?}")))
        .collect::<PyResult<_>>()?;
    let held = hold(&data, false, &format!("the data of tensor {name:?}"))?;
    Ok(Spec {
        name,
        dtype,
        shape,
        held,
    })
}

fn parse_metadata(metadata: &Bound<'_, PyAny>) -> PyResult<BTreeMap<String, String>> {
    let dict = metadata
        .cast::<PyDict>()
        .map_err(|_| invalid("metadata must be a dict[str, str]".to_owned()))?;
    dict.iter()
        .map(|(k, v)| {
            let key: String = k
                .extract()
                .map_err(|_| invalid(format!("metadata key {k} is not a str")))?;
            let value: String = v
                .extract()
                .map_err(|_| invalid(format!("metadata[{key:?}] is not a str")))?;
            Ok((key, value))
        })
        .collect()
}

/// Writes one shard file (see `shardline._native.write_shard` in `_native.pyi`).
/// `chunk_bytes` defaults to 4 MiB, spelled out so that Python's signature shows it.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata, compress = None, chunk_bytes = 4194304, threads = 0))]
pub fn write_shard<'py>(
    py: Python<'py>,
    path: &str,
    tensors: &Bound<'py, PyAny>,
    metadata: &Bound<'py, PyAny>,
    compress: Option<i32>,
    chunk_bytes: i64,
    threads: i64,
) -> PyResult<Bound<'py, PyDict>> {
    let specs = tensors
        .try_iter()?
        .enumerate()
        .map(|(i, item)| parse_spec(i, &item?))
        .collect::<PyResult<Vec<_>>>()?;
    let metadata = parse_metadata(metadata)?;
    let options = WriteOptions {
        compress,
        chunk_bytes: non_negative(chunk_bytes, "chunk_bytes")?,
        threads: non_negative(threads, "threads")? as usize,
    };
    let data: Vec<TensorData<'_>> = specs
        .iter()
        .map(|s| TensorData {
            name: s.name.clone(),
            dtype: s.dtype,
            shape: s.shape.clone(),
            data: bytes_of(&s.held),
        })
        .collect();
    // [Note: buffer ownership] `specs` holds every buffer until the write has returned.
    let report = py
        .detach(|| shard::write_shard(path, &data, &metadata, &options))
        .py_err()?;
    drop(data);
    drop(specs);

    let out = PyDict::new(py);
    for t in report.tensors {
        let entry = PyDict::new(py);
        entry.set_item("offset", t.offset)?;
        entry.set_item("stored_bytes", t.stored_bytes)?;
        entry.set_item("raw_bytes", t.raw_bytes)?;
        entry.set_item("crc32c", t.crc32c)?;
        out.set_item(t.name, entry)?;
    }
    let file = PyDict::new(py);
    file.set_item("bytes", report.file_bytes)?;
    file.set_item("header_bytes", report.header_bytes)?;
    out.set_item("__file__", file)?;
    Ok(out)
}

fn header_dict<'py>(py: Python<'py>, header: &ShardHeader) -> PyResult<Bound<'py, PyDict>> {
    let tensors = PyDict::new(py);
    for t in &header.tensors {
        let entry = PyDict::new(py);
        entry.set_item("dtype", t.dtype.safetensors_name())?;
        entry.set_item("shape", &t.shape)?;
        entry.set_item("offset", header.data_start() + t.begin)?;
        entry.set_item("raw_bytes", t.raw_bytes)?;
        entry.set_item("stored_bytes", t.stored_bytes())?;
        entry.set_item("compressed", matches!(t.encoding, Encoding::Zstd { .. }))?;
        tensors.set_item(&t.name, entry)?;
    }
    let out = PyDict::new(py);
    out.set_item("metadata", &header.metadata)?;
    out.set_item("tensors", tensors)?;
    Ok(out)
}

fn open(py: Python<'_>, path: &str) -> PyResult<ShardReader> {
    py.detach(|| ShardReader::open(path)).py_err()
}

/// One open shard file (see `_native.pyi`): mapped, its header validated once, serving reads
/// from any thread until `close`.
#[pyclass(name = "ShardReader", module = "shardline._native")]
pub struct PyShardReader {
    path: String,
    /// `None` once closed. Reads clone the `Arc`, so a close while another thread reads
    /// unmaps the file only when that read is done.
    inner: Mutex<Option<Arc<ShardReader>>>,
}

impl PyShardReader {
    fn reader(&self) -> PyResult<Arc<ShardReader>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                invalid(format!(
                    "checkpoint shard {}: the ShardReader was closed; open a new one",
                    self.path
                ))
            })
    }
}

#[pymethods]
impl PyShardReader {
    #[new]
    fn new(py: Python<'_>, path: &str) -> PyResult<Self> {
        let reader = open(py, path)?;
        Ok(PyShardReader {
            path: path.to_owned(),
            inner: Mutex::new(Some(Arc::new(reader))),
        })
    }

    /// The file's path.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// The validated header (see `_native.pyi`).
    fn header<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        header_dict(py, self.reader()?.header())
    }

    /// Copies raw bytes of one tensor into `out_buffer` (see `_native.pyi`).
    #[pyo3(signature = (key, byte_offset, out_buffer, verify = true))]
    fn read_range(
        &self,
        py: Python<'_>,
        key: &str,
        byte_offset: i64,
        out_buffer: &Bound<'_, PyAny>,
        verify: bool,
    ) -> PyResult<()> {
        let reader = self.reader()?;
        let start = non_negative(byte_offset, "byte_offset")?;
        let mut held = hold(out_buffer, true, "out_buffer")?;
        let dst = bytes_of_mut(&mut held);
        py.detach(|| reader.view().read_range(key, start, dst, verify, 0))
            .py_err()
    }

    /// Checks every checksum in the file (see `_native.pyi`).
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        let reader = self.reader()?;
        py.detach(|| reader.view().verify(0)).py_err()
    }

    /// Releases the file; later calls raise. Closing twice is allowed.
    fn close(&self) {
        let reader = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(reader);
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        exc_type: Option<&Bound<'_, PyAny>>,
        exc_value: Option<&Bound<'_, PyAny>>,
        traceback: Option<&Bound<'_, PyAny>>,
    ) {
        let _ = (exc_type, exc_value, traceback);
        self.close();
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { "closed" } else { "open" };
        format!("<shardline._native.ShardReader {:?} ({state})>", self.path)
    }
}
