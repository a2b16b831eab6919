//! The tracer's timeline lines, encoded in one call (`shardline.comm.trace.recorder`).
//!
//! A line of ops is `{"k":"ops","r":[record, ...]}` and its newline: each record the flight
//! recorder's list (`shardline.comm.flight`), its dtype written as its name, and its device
//! start and end after it where the op has them. `json.dumps` of the same takes a Python call
//! per record to copy it and name its dtype; here the records are read where they are and
//! written by `serde_json` into bytes the caller writes to its file as they are. A value this
//! does not write (a float that is not finite, a type that is not JSON's) is an error, and the
//! caller writes that line with `json.dumps` instead.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::ser::{Error as _, Serialize, SerializeSeq, Serializer};

/// The index of a record's dtype (`shardline.comm.flight.DTYPE`).
const DTYPE: usize = 4;

/// A Python value as JSON: None, bool, int, finite float, str, list or tuple.
struct Value<'a, 'py>(&'a Bound<'py, PyAny>);

impl Serialize for Value<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let o = self.0;
        // The types a record holds most (its texts and times) first.
        if let Ok(t) = o.cast::<PyString>() {
            return s.serialize_str(&t.to_cow().map_err(S::Error::custom)?);
        }
        if let Ok(f) = o.cast::<PyFloat>() {
            return finite(f.value(), s);
        }
        if o.is_none() {
            return s.serialize_unit();
        }
        if let Ok(b) = o.cast::<PyBool>() {
            return s.serialize_bool(b.is_true());
        }
        if let Ok(i) = o.cast::<PyInt>() {
            if let Ok(v) = i.extract::<i64>() {
                return s.serialize_i64(v);
            }
            return s.serialize_u64(i.extract::<u64>().map_err(S::Error::custom)?);
        }
        if o.is_instance_of::<PyList>() || o.is_instance_of::<PyTuple>() {
            let mut seq = s.serialize_seq(o.len().ok())?;
            for item in o.try_iter().map_err(S::Error::custom)? {
                seq.serialize_element(&Value(&item.map_err(S::Error::custom)?))?;
            }
            return seq.end();
        }
        Err(S::Error::custom("a value of a type JSON does not hold"))
    }
}

/// `v` as a JSON number; an error when it is not finite (JSON has no such number).
fn finite<S: Serializer>(v: f64, s: S) -> Result<S::Ok, S::Error> {
    if !v.is_finite() {
        return Err(S::Error::custom("a float that is not finite"));
    }
    s.serialize_f64(v)
}

/// A record's dtype by its name: from `dtypes` (the flight recorder's, `None` there as ""),
/// else its text without `torch.`, kept in `dtypes` for the next time.
struct Dtype<'a, 'py> {
    dtype: &'a Bound<'py, PyAny>,
    dtypes: &'a Bound<'py, PyDict>,
}

impl Serialize for Dtype<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let dtype = self.dtype;
        if let Some(name) = self.dtypes.get_item(dtype).map_err(S::Error::custom)? {
            let name = name.cast::<PyString>().map_err(S::Error::custom)?;
            return s.serialize_str(&name.to_cow().map_err(S::Error::custom)?);
        }
        if let Ok(text) = dtype.cast::<PyString>() {
            return s.serialize_str(&text.to_cow().map_err(S::Error::custom)?);
        }
        let text = dtype.str().map_err(S::Error::custom)?;
        let text = text.to_cow().map_err(S::Error::custom)?;
        let name = text.strip_prefix("torch.").unwrap_or(&text);
        self.dtypes
            .set_item(dtype, name)
            .map_err(S::Error::custom)?;
        s.serialize_str(name)
    }
}

/// One record: its fields (the dtype by name), then its device span's two times if any.
struct Record<'a, 'py> {
    fields: &'a Bound<'py, PyList>,
    span: &'a Bound<'py, PyAny>,
    dtypes: &'a Bound<'py, PyDict>,
}

impl Serialize for Record<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let span = if self.span.is_none() {
            None
        } else {
            Some(self.span.cast::<PyTuple>().map_err(S::Error::custom)?)
        };
        let n = self.fields.len() + span.map_or(0, |t| t.len());
        let mut seq = s.serialize_seq(Some(n))?;
        for (k, item) in self.fields.iter().enumerate() {
            if k == DTYPE {
                seq.serialize_element(&Dtype {
                    dtype: &item,
                    dtypes: self.dtypes,
                })?;
            } else {
                seq.serialize_element(&Value(&item))?;
            }
        }
        if let Some(times) = span {
            for t in times.iter() {
                seq.serialize_element(&Value(&t))?;
            }
        }
        seq.end()
    }
}

/// `{"k":"ops","r":[...]}` and a newline, as UTF-8 bytes, for `records` (the flight
/// recorder's lists) and `spans` (each record's device start and end, or `None`), with
/// `dtypes` naming their dtypes.
///
/// Raises `ValueError` for a value it does not write (see the module), `TypeError` for a
/// record that is not a list.
#[pyfunction]
pub fn trace_ops_line<'py>(
    py: Python<'py>,
    records: &Bound<'py, PyList>,
    spans: &Bound<'py, PyList>,
    dtypes: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyBytes>> {
    if records.len() != spans.len() {
        return Err(PyValueError::new_err(format!(
            "{} records and {} spans: pass one span (or None) per record",
            records.len(),
            spans.len()
        )));
    }
    let mut out = Vec::with_capacity(16 + 192 * records.len());
    out.extend_from_slice(br#"{"k":"ops","r":["#);
    for (i, (record, span)) in records.iter().zip(spans.iter()).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let record = Record {
            fields: record.cast::<PyList>()?,
            span: &span,
            dtypes,
        };
        serde_json::to_writer(&mut out, &record)
            .map_err(|e| PyValueError::new_err(format!("record {i}: {e}")))?;
    }
    out.extend_from_slice(b"]}\n");
    Ok(PyBytes::new(py, &out))
}
