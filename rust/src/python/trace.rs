//! The tracer's timeline lines, encoded in one call (`shardline.comm.trace.recorder`).
//!
//! A line of ops is `{"k":"ops","r":[record, ...]}`: each record the flight recorder's list
//! (`shardline.comm.flight`), its dtype written as its name, and its device start and end
//! after it where the op has them. `json.dumps` of the same takes a Python call per record to
//! copy it and name its dtype; here the records are read where they are and written by
//! `serde_json`. A value this does not write (a float that is not finite, a type that is not
//! JSON's) is an error, and the caller writes that line with `json.dumps` instead.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::ser::{Error as _, Serialize, SerializeSeq, Serializer};

/// The index of a record's dtype (`shardline.comm.flight.DTYPE`).
const DTYPE: usize = 4;

/// A Python value as JSON: None, bool, int, finite float, str, list or tuple.
struct Value<'a, 'py>(&'a Bound<'py, PyAny>);

impl Serialize for Value<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let o = self.0;
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
        if let Ok(f) = o.cast::<PyFloat>() {
            let v = f.value();
            if !v.is_finite() {
                return Err(S::Error::custom("a float that is not finite"));
            }
            return s.serialize_f64(v);
        }
        if let Ok(t) = o.cast::<PyString>() {
            return s.serialize_str(&t.to_cow().map_err(S::Error::custom)?);
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

/// One record: its fields (the dtype by name), then its device span's two times if any.
struct Record<'a, 'py> {
    fields: &'a Bound<'py, PyList>,
    span: &'a Bound<'py, PyAny>,
    dtypes: &'a Bound<'py, PyDict>,
}

impl Record<'_, '_> {
    /// A dtype's name: from `dtypes` (the flight recorder's, `None` there as ""), else its
    /// text without `torch.`, kept in `dtypes` for the next time.
    fn dtype_name(&self, dtype: &Bound<'_, PyAny>) -> PyResult<String> {
        if let Some(name) = self.dtypes.get_item(dtype)? {
            return Ok(name.cast::<PyString>()?.to_cow()?.into_owned());
        }
        if let Ok(text) = dtype.cast::<PyString>() {
            return Ok(text.to_cow()?.into_owned());
        }
        let text = dtype.str()?.to_cow()?.into_owned();
        let name = text.strip_prefix("torch.").unwrap_or(&text).to_owned();
        self.dtypes.set_item(dtype, &name)?;
        Ok(name)
    }
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
                seq.serialize_element(&self.dtype_name(&item).map_err(S::Error::custom)?)?;
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

/// `{"k":"ops","r":[...]}` for `records` (the flight recorder's lists) and `spans` (each
/// record's device start and end, or `None`), with `dtypes` naming their dtypes.
///
/// Raises `ValueError` for a value it does not write (see the module), `TypeError` for a
/// record that is not a list.
#[pyfunction]
pub fn trace_ops_line(
    records: &Bound<'_, PyList>,
    spans: &Bound<'_, PyList>,
    dtypes: &Bound<'_, PyDict>,
) -> PyResult<String> {
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
    out.extend_from_slice(b"]}");
    // serde_json writes UTF-8 only.
    String::from_utf8(out).map_err(|e| PyValueError::new_err(e.to_string()))
}
