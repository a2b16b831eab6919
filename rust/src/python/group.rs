//! `Group`, `Work`, `Listener` and the arena helpers: thin adapters over the engine.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use super::buffer::{hold, Held};
use super::errors::{to_py, IntoPy};
use super::signals;
use crate::engine::{CommConfig, Communicator, Op, Work};
use crate::error::{Error, ErrorKind};
use crate::memcpy::StreamMode;
use crate::transport::shm;
use crate::transport::tcp::{Cancel, TcpListenerHandle};
use crate::{DType, ReduceOp};

/// A bound TCP listener for incoming peer connections of one communicator.
#[pyclass(name = "Listener", module = "shardline._native")]
pub struct PyListener {
    inner: Mutex<Option<TcpListenerHandle>>,
    address: String,
}

#[pymethods]
impl PyListener {
    #[new]
    #[pyo3(signature = (host = "127.0.0.1"))]
    fn new(host: &str) -> PyResult<Self> {
        let l = TcpListenerHandle::bind(host).py_err()?;
        Ok(PyListener {
            address: l.address(),
            inner: Mutex::new(Some(l)),
        })
    }

    /// `"ip:port"` to publish at rendezvous.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }
}

/// Creates a shared-memory arena file (O_EXCL, mode 0600) for `num_ranks` local ranks.
#[pyfunction]
pub fn arena_create(path: &str, num_ranks: usize, slot_bytes: usize) -> PyResult<()> {
    shm::create(path, num_ranks, slot_bytes).py_err()
}

/// Removes the arena's name; mapped ranks keep using it.
#[pyfunction]
pub fn arena_unlink(path: &str) -> PyResult<()> {
    shm::unlink(path).py_err()
}

/// Removes arena files left by dead processes; returns how many were removed.
#[pyfunction]
#[pyo3(signature = (directory = "/dev/shm"))]
pub fn arena_sweep(directory: &str) -> usize {
    shm::sweep(directory)
}

/// A collective in flight.
#[pyclass(name = "Work", module = "shardline._native")]
pub struct PyWork {
    work: Work,
    /// The communicator of a queued op, whose queue `wait` may run up to it.
    comm: Option<Weak<Communicator>>,
}

fn wait_work(py: Python<'_>, work: &Work, timeout: Option<f64>) -> PyResult<()> {
    if work.is_completed() {
        // Inline ops finish before `submit` returns: no GIL release needed.
        return work.wait_for(None).map(|_| ()).py_err();
    }
    let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    loop {
        let slice = match deadline {
            Some(d) => d
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(100)),
            None => Duration::from_millis(100),
        };
        if py.detach(|| work.wait_for(Some(slice))).py_err()? {
            return Ok(());
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(to_py(Error::new(
                ErrorKind::Timeout,
                format!(
                    "Work.wait: the op did not complete within {:.3} s",
                    timeout.unwrap_or(0.0)
                ),
            )));
        }
    }
}

#[pymethods]
impl PyWork {
    /// Blocks until done (raises the op's error); `timeout` in seconds.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        // With no timeout of its own the caller runs the op itself if the worker has not
        // started it (`Communicator::run_until`); a timeout could not bound an op run here.
        if timeout.is_none() && !self.work.is_completed() {
            if let Some(comm) = self.comm.as_ref().and_then(Weak::upgrade) {
                signals::run_ops(py, || {
                    comm.run_until(&self.work);
                    Ok(())
                })?;
            }
        }
        wait_work(py, &self.work, timeout)
    }

    /// Whether the op has finished.
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }

    /// The rank a finished receive took its message from (`None` for other ops, and for a
    /// receive that has not finished or failed).
    #[getter]
    fn source(&self) -> Option<usize> {
        self.work.source()
    }
}

/// A communicator: shared memory among ranks on one host, TCP between hosts.
#[pyclass(name = "Group", module = "shardline._native", weakref)]
pub struct PyGroup {
    comm: Mutex<Option<Arc<Communicator>>>,
    rank: usize,
    world: usize,
    transport: &'static str,
}

fn dtype(name: &str) -> PyResult<DType> {
    DType::parse(name).py_err()
}

fn reduce_op(name: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(name).py_err()
}

/// `value` as a u64, or an `InvalidArgumentError` naming the argument and its unit.
fn non_negative(value: i64, what: &str, unit: &str) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| {
        to_py(Error::invalid(format!(
            "{what} must be a number of {unit} >= 0, got {value}"
        )))
    })
}

impl PyGroup {
    pub(super) fn comm(&self) -> PyResult<Arc<Communicator>> {
        self.comm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                to_py(Error::new(
                    ErrorKind::Closed,
                    format!(
                        "rank {}: the group was shut down; create a new one",
                        self.rank
                    ),
                ))
            })
    }

    fn submit(&self, py: Python<'_>, op: Op, held: Vec<Held>, async_op: bool) -> PyResult<PyWork> {
        let comm = self.comm()?;
        if async_op {
            let keep: Vec<_> = held.into_iter().map(|h| h.keep).collect();
            let work = comm.submit(op, Box::new(keep), true).py_err()?;
            let comm = Some(Arc::downgrade(&comm));
            return Ok(PyWork { work, comm });
        }
        // Queued behind others, it is run here with them (`Communicator::run_until`).
        let work = signals::run_ops(py, || {
            let work = comm.submit(op, Box::new(()), false)?;
            comm.run_until(&work);
            Ok(work)
        })?;
        wait_work(py, &work, None)?;
        drop(held);
        Ok(PyWork { work, comm: None })
    }
}

#[pymethods]
impl PyGroup {
    #[new]
    #[pyo3(signature = (rank, world_size, *, name, secret, host_ids, addrs, listener, arena_path, timeout, machine_ranks=None, comm_threads=1, comm_threads_min_bytes=None, spin_us=None, stream_stores=None, oneshot_bytes=None, keepalive=None, cancel=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        name: String,
        secret: Vec<u8>,
        host_ids: Vec<String>,
        addrs: Vec<String>,
        listener: Option<PyRef<'_, PyListener>>,
        arena_path: Option<String>,
        timeout: f64,
        machine_ranks: Option<usize>,
        comm_threads: usize,
        comm_threads_min_bytes: Option<usize>,
        spin_us: Option<i64>,
        stream_stores: Option<&str>,
        oneshot_bytes: Option<i64>,
        keepalive: Option<f64>,
        cancel: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(to_py(Error::invalid(format!(
                "timeout must be a positive number of seconds, got {timeout}"
            ))));
        }
        // Settings left at None keep the engine's defaults (CommConfig::new).
        let mut cfg = CommConfig::new(rank, world_size, &name);
        if let Some(us) = spin_us {
            cfg.spin_us = non_negative(us, "spin_us", "microseconds")?;
        }
        if let Some(mode) = stream_stores {
            cfg.stream_stores = StreamMode::parse(mode).py_err()?;
        }
        if let Some(bytes) = oneshot_bytes {
            cfg.oneshot_bytes = Some(non_negative(bytes, "oneshot_bytes", "bytes")? as usize);
        }
        cfg.secret = secret;
        cfg.host_ids = host_ids;
        cfg.addrs = addrs;
        cfg.arena_path = arena_path;
        cfg.timeout = Duration::from_secs_f64(timeout);
        cfg.machine_ranks = machine_ranks.unwrap_or(world_size).max(1);
        cfg.comm_threads = comm_threads.max(1);
        if let Some(bytes) = comm_threads_min_bytes {
            cfg.comm_threads_min_bytes = bytes;
        }
        if let Some(seconds) = keepalive {
            if !(seconds.is_finite() && seconds >= 0.0) {
                return Err(to_py(Error::invalid(format!(
                    "keepalive must be a non-negative number of seconds (0: off), got {seconds}"
                ))));
            }
            cfg.keepalive = Duration::from_secs_f64(seconds);
        }
        // `cancel()` is called while linking; the exception it raises ends the setup and is
        // what this constructor raises (kept here, as the engine's errors hold no Python).
        let raised: Arc<Mutex<Option<PyErr>>> = Arc::new(Mutex::new(None));
        if let Some(callable) = cancel {
            let slot = raised.clone();
            cfg.cancel = Some(Cancel(Arc::new(move || {
                Python::attach(|py| match callable.call0(py) {
                    Ok(_) => None,
                    Err(e) => {
                        let message = e.to_string();
                        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        Some(Error::new(ErrorKind::Closed, message))
                    }
                })
            })));
        }
        let listener = match listener {
            Some(l) => Some(
                l.inner
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .ok_or_else(|| {
                        to_py(Error::invalid(
                            "this Listener was already used by another Group; bind a new one",
                        ))
                    })?,
            ),
            None => None,
        };
        let comm = match py.detach(|| Communicator::new(cfg, listener)) {
            Ok(comm) => comm,
            Err(e) => {
                let cancelled = raised.lock().unwrap_or_else(|p| p.into_inner()).take();
                return Err(cancelled.unwrap_or_else(|| to_py(e)));
            }
        };
        Ok(PyGroup {
            transport: comm.mode().name(),
            rank,
            world: world_size,
            comm: Mutex::new(Some(Arc::new(comm))),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.world
    }

    /// `"single"`, `"shm"`, `"tcp"` or `"hierarchical"`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.transport
    }

    /// All-reduces on shared memory up to this many bytes are one-shot, larger ones
    /// two-phase: as set, else as the group's first all-reduce measured (the default before
    /// it). `None`: no other rank of the group on this host. Waits for an op in progress.
    #[getter]
    fn oneshot_bytes(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        let comm = self.comm()?;
        Ok(py.detach(|| comm.oneshot_bytes()))
    }

    #[pyo3(signature = (buf, dtype, op = "sum", async_op = false))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        op: &str,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let (d, o) = (self::dtype(dtype)?, reduce_op(op)?);
        let b = hold(buf, true, "all_reduce: tensor")?;
        self.submit(
            py,
            Op::AllReduce {
                buf: b.raw,
                dtype: d,
                op: o,
            },
            vec![b],
            async_op,
        )
    }

    #[pyo3(signature = (out, inp, dtype, op = "sum", async_op = false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        dtype: &str,
        op: &str,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let (d, o) = (self::dtype(dtype)?, reduce_op(op)?);
        let (ob, ib) = (
            hold(out, true, "reduce_scatter: output")?,
            hold(inp, false, "reduce_scatter: input")?,
        );
        let op = Op::ReduceScatter {
            out: ob.raw,
            inp: ib.raw,
            dtype: d,
            op: o,
        };
        self.submit(py, op, vec![ob, ib], async_op)
    }

    #[pyo3(signature = (out, inp, dtype, counts = None, async_op = false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        dtype: &str,
        counts: Option<Vec<usize>>,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let d = self::dtype(dtype)?;
        let (ob, ib) = (
            hold(out, true, "all_gather: output")?,
            hold(inp, false, "all_gather: input")?,
        );
        let op = Op::AllGather {
            out: ob.raw,
            inp: ib.raw,
            dtype: d,
            counts,
        };
        self.submit(py, op, vec![ob, ib], async_op)
    }

    #[pyo3(signature = (buf, dtype, root, async_op = false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        root: usize,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let d = self::dtype(dtype)?;
        let b = hold(buf, true, "broadcast: tensor")?;
        self.submit(
            py,
            Op::Broadcast {
                buf: b.raw,
                dtype: d,
                root,
            },
            vec![b],
            async_op,
        )
    }

    #[pyo3(signature = (buf, dtype, op = "sum", root = 0, async_op = false))]
    fn reduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        op: &str,
        root: usize,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let (d, o) = (self::dtype(dtype)?, reduce_op(op)?);
        let b = hold(buf, true, "reduce: tensor")?;
        self.submit(
            py,
            Op::Reduce {
                buf: b.raw,
                dtype: d,
                op: o,
                root,
            },
            vec![b],
            async_op,
        )
    }

    #[pyo3(signature = (out, inp, dtype, root = 0, async_op = false))]
    fn gather(
        &self,
        py: Python<'_>,
        out: Option<&Bound<'_, PyAny>>,
        inp: &Bound<'_, PyAny>,
        dtype: &str,
        root: usize,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let d = self::dtype(dtype)?;
        let ib = hold(inp, false, "gather: input")?;
        let ob = out.map(|o| hold(o, true, "gather: output")).transpose()?;
        let op = Op::Gather {
            out: ob.as_ref().map(|b| b.raw),
            inp: ib.raw,
            dtype: d,
            root,
        };
        self.submit(py, op, std::iter::once(ib).chain(ob).collect(), async_op)
    }

    #[pyo3(signature = (out, inp, dtype, root = 0, async_op = false))]
    fn scatter(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        inp: Option<&Bound<'_, PyAny>>,
        dtype: &str,
        root: usize,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let d = self::dtype(dtype)?;
        let ob = hold(out, true, "scatter: output")?;
        let ib = inp.map(|i| hold(i, false, "scatter: input")).transpose()?;
        let op = Op::Scatter {
            out: ob.raw,
            inp: ib.as_ref().map(|b| b.raw),
            dtype: d,
            root,
        };
        self.submit(py, op, std::iter::once(ob).chain(ib).collect(), async_op)
    }

    #[pyo3(signature = (out, inp, dtype, async_op = false))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        dtype: &str,
        async_op: bool,
    ) -> PyResult<PyWork> {
        let d = self::dtype(dtype)?;
        let (ob, ib) = (
            hold(out, true, "all_to_all: output")?,
            hold(inp, false, "all_to_all: input")?,
        );
        self.submit(
            py,
            Op::AllToAll {
                out: ob.raw,
                inp: ib.raw,
                dtype: d,
            },
            vec![ob, ib],
            async_op,
        )
    }

    #[pyo3(signature = (async_op = false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> PyResult<PyWork> {
        self.submit(py, Op::Barrier, Vec::new(), async_op)
    }

    #[pyo3(signature = (buf, dtype, dst, async_op = false, tag = 0))]
    fn send(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        dst: usize,
        async_op: bool,
        tag: u32,
    ) -> PyResult<PyWork> {
        let d = self::dtype(dtype)?;
        let b = hold(buf, false, "send: tensor")?;
        self.submit(
            py,
            Op::Send {
                buf: b.raw,
                dtype: d,
                peer: dst,
                tag,
            },
            vec![b],
            async_op,
        )
    }

    /// Receives the next message tagged `tag` from `src`, or from any rank when `src` is
    /// `None`; the Work's `source` says which rank it came from.
    #[pyo3(signature = (buf, dtype, src, async_op = false, tag = 0))]
    fn recv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        src: Option<usize>,
        async_op: bool,
        tag: u32,
    ) -> PyResult<PyWork> {
        let d = self::dtype(dtype)?;
        let b = hold(buf, true, "recv: tensor")?;
        self.submit(
            py,
            Op::Recv {
                buf: b.raw,
                dtype: d,
                peer: src,
                tag,
            },
            vec![b],
            async_op,
        )
    }

    /// Fails every pending and future op here and on every peer with `reason`.
    fn abort(&self, reason: &str) -> PyResult<()> {
        self.comm()?.abort(reason);
        Ok(())
    }

    /// Waits for queued ops, then releases the transport; later calls raise.
    fn close(&self, py: Python<'_>) {
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(c) = comm {
            py.detach(|| c.close());
        }
    }
}
