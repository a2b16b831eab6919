//! The communicator: op queue, worker thread, inline fast path, deadlines and `Work`.
//!
//! Ops run strictly in issue order. A blocking call with nothing queued runs inline on the
//! caller's thread (no hand-off, so small ops cost microseconds); anything else goes to the
//! communicator's one worker thread and returns a [`Work`]. Every op gets a deadline, a
//! sequence number and a signature; the first failure aborts the transports for every rank
//! and leaves the communicator closed, so later calls fail fast instead of hanging.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::collectives::arena::{ArenaComm, DEFAULT_ONESHOT_BYTES};
use crate::collectives::lanes::Lanes;
use crate::collectives::p2p::P2p;
use crate::collectives::{direct, ring};
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::op::{OpKind, OpSig};
use crate::reduce::{self, ReduceOp};
use crate::transport::shm::Arena;
use crate::transport::tcp::{TcpListenerHandle, TcpMesh};
use crate::wait::SpinPolicy;

/// Everything a rank needs to join a communicator (rendezvous happens in Python).
#[derive(Clone, Debug)]
pub struct CommConfig {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Group name (distinguishes communicators on the wire).
    pub name: String,
    /// Shared job secret for the TCP handshake.
    pub secret: Vec<u8>,
    /// Host identity of every rank; equal ids share memory.
    pub host_ids: Vec<String>,
    /// TCP listener address of every rank (empty strings where there is none).
    pub addrs: Vec<String>,
    /// The arena of this rank's host, when it has several ranks.
    pub arena_path: Option<String>,
    /// Deadline of every op.
    pub timeout: Duration,
    /// All-reduces up to this size are one-shot on the arena.
    pub oneshot_bytes: usize,
    /// Ranks of the job on this machine, whatever their host ids say (they share its cores):
    /// TCP waits spin only while every one of them has a core.
    pub machine_ranks: usize,
    /// Threads per rank for the memory passes of large shared-memory ops (1: none).
    pub lanes: usize,
    /// Shared-memory ops of at least this many bytes use the lanes.
    pub lanes_min_bytes: usize,
}

impl CommConfig {
    /// A config with defaults for the tunables.
    pub fn new(rank: usize, world: usize, name: &str) -> Self {
        CommConfig {
            rank,
            world,
            name: name.into(),
            secret: Vec::new(),
            host_ids: vec!["host".into(); world],
            addrs: vec![String::new(); world],
            arena_path: None,
            timeout: Duration::from_secs(300),
            oneshot_bytes: DEFAULT_ONESHOT_BYTES,
            machine_ranks: world,
            lanes: 1,
            lanes_min_bytes: crate::collectives::lanes::DEFAULT_MIN_BYTES,
        }
    }
}

/// How a communicator's ranks are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One rank.
    Single,
    /// All ranks on one host: the arena.
    Shm,
    /// One rank per host: TCP.
    Tcp,
    /// Several hosts with several ranks: arena inside, TCP between local leaders.
    Hierarchical,
}

impl Mode {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Single => "single",
            Mode::Shm => "shm",
            Mode::Tcp => "tcp",
            Mode::Hierarchical => "hierarchical",
        }
    }
}

/// A caller's buffer: pointer and length, valid until the op completes (the caller's
/// keep-alive guarantees it).
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawBuf is only dereferenced by the op that owns it, on one thread at a time, while
// the keep-alive submitted with the op holds the memory.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// Wraps memory the caller keeps valid (and unaliased by other writers) until the op is done.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes until the op's [`Work`] completes.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        RawBuf { ptr, len }
    }

    /// Wraps a slice (for Rust callers who block until the op is done).
    pub fn from_slice(s: &mut [u8]) -> Self {
        RawBuf {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the memory (dangling or null when empty).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    #[allow(clippy::mut_from_ref)]
    fn bytes(&self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: guaranteed by `new`'s contract; the engine runs one op at a time.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// One collective or point-to-point op with its buffers.
///
/// Field names follow torch.distributed: `buf` in place, `inp`/`out`, `root`, `peer` (a rank
/// of this group), `op` the reduction.
#[allow(missing_docs)]
#[derive(Debug)]
pub enum Op {
    /// In-place all-reduce.
    AllReduce {
        buf: RawBuf,
        dtype: DType,
        op: ReduceOp,
    },
    /// `inp` = world blocks of `out.len()`.
    ReduceScatter {
        out: RawBuf,
        inp: RawBuf,
        dtype: DType,
        op: ReduceOp,
    },
    /// `counts`: element count of every rank's input (None: all equal).
    AllGather {
        out: RawBuf,
        inp: RawBuf,
        dtype: DType,
        counts: Option<Vec<usize>>,
    },
    /// In-place broadcast from `root`.
    Broadcast {
        buf: RawBuf,
        dtype: DType,
        root: usize,
    },
    /// In-place reduce to `root`.
    Reduce {
        buf: RawBuf,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    },
    /// `out` (root only) = world blocks of `inp.len()`.
    Gather {
        out: Option<RawBuf>,
        inp: RawBuf,
        dtype: DType,
        root: usize,
    },
    /// `inp` (root only) = world blocks of `out.len()`.
    Scatter {
        out: RawBuf,
        inp: Option<RawBuf>,
        dtype: DType,
        root: usize,
    },
    /// Equal blocks.
    AllToAll {
        out: RawBuf,
        inp: RawBuf,
        dtype: DType,
    },
    /// Barrier.
    Barrier,
    /// Send to `peer`.
    Send {
        buf: RawBuf,
        dtype: DType,
        peer: usize,
    },
    /// Receive from `peer`.
    Recv {
        buf: RawBuf,
        dtype: DType,
        peer: usize,
    },
}

/// A pending op's completion.
#[derive(Clone)]
pub struct Work {
    inner: Arc<WorkState>,
}

struct WorkState {
    done: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl Work {
    fn pending() -> Self {
        Work {
            inner: Arc::new(WorkState {
                done: Mutex::new(None),
                cv: Condvar::new(),
            }),
        }
    }

    fn finished(r: Result<()>) -> Self {
        let w = Self::pending();
        w.complete(r);
        w
    }

    fn complete(&self, r: Result<()>) {
        *lock(&self.inner.done) = Some(r);
        self.inner.cv.notify_all();
    }

    /// Whether the op has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        lock(&self.inner.done).is_some()
    }

    /// Waits up to `timeout` (forever if None); the op's own deadline bounds the wait anyway.
    /// Returns Ok(false) if the timeout passed first.
    pub fn wait_for(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = lock(&self.inner.done);
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone().map(|_| true);
            }
            let slice = match deadline {
                None => Duration::from_millis(100),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(false);
                    }
                    (d - now).min(Duration::from_millis(100))
                }
            };
            g = self
                .inner
                .cv
                .wait_timeout(g, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Job {
    op: Op,
    work: Work,
    keepalive: Box<dyn Any + Send>,
    /// Submitted with `async_op`: it overlaps the caller's compute, so no helper threads.
    async_op: bool,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Job>,
    running: usize,
    closed: bool,
}

struct Shared {
    core: Mutex<Core>,
    queue: Mutex<Queue>,
    cv: Condvar,
    arena: Option<Arc<Arena>>,
    rank: usize,
    world: usize,
    mode: Mode,
}

/// A communicator: a group of ranks and the engine that runs their collectives.
pub struct Communicator {
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

struct Core {
    rank: usize,
    world: usize,
    mode: Mode,
    arena: Option<ArenaComm>,
    mesh: Option<TcpMesh>,
    /// This rank's index among the ranks of its host (0 = the host's leader).
    my_local: usize,
    /// The lowest rank of every host (hierarchical mode).
    leaders: Vec<usize>,
    seq: u64,
    broken: Option<Error>,
    timeout: Duration,
}

impl Communicator {
    /// Joins the communicator described by `cfg`; `listener` is this rank's bound TCP
    /// listener (needed for point-to-point ops and multi-host groups).
    pub fn new(cfg: CommConfig, listener: Option<TcpListenerHandle>) -> Result<Self> {
        let (rank, world) = (cfg.rank, cfg.world);
        if world == 0 || rank >= world || cfg.host_ids.len() != world || cfg.addrs.len() != world {
            return Err(Error::invalid(format!(
                "bad communicator config: rank {rank} of world {world} with {} host ids and {} addresses",
                cfg.host_ids.len(),
                cfg.addrs.len()
            )));
        }
        let mut hosts: Vec<(&str, Vec<usize>)> = Vec::new();
        for (r, h) in cfg.host_ids.iter().enumerate() {
            match hosts.iter_mut().find(|(id, _)| id == h) {
                Some((_, v)) => v.push(r),
                None => hosts.push((h, vec![r])),
            }
        }
        let local = hosts
            .iter()
            .find(|(id, _)| *id == cfg.host_ids[rank])
            .expect("own host")
            .1
            .clone();
        let my_local = local.iter().position(|&r| r == rank).expect("own rank");
        let leaders: Vec<usize> = hosts.iter().map(|(_, v)| v[0]).collect();
        let mode = match (world, hosts.len()) {
            (1, _) => Mode::Single,
            (_, 1) => Mode::Shm,
            (w, h) if w == h => Mode::Tcp,
            _ => Mode::Hierarchical,
        };
        let deadline = Instant::now() + cfg.timeout;
        let arena = if local.len() > 1 {
            let path = cfg.arena_path.as_deref().ok_or_else(|| {
                Error::invalid(format!(
                    "rank {rank} shares its host with ranks {local:?} but got no arena path"
                ))
            })?;
            let a = Arc::new(Arena::open(path, my_local, local.clone())?);
            if a.slot_bytes() < 64 * a.ranks() {
                return Err(Error::invalid(format!(
                    "shared-memory slots of {} bytes are too small for {} local ranks; raise SHARDLINE_SHM_SLOT_BYTES",
                    a.slot_bytes(),
                    a.ranks()
                )));
            }
            Some(a)
        } else {
            None
        };
        let mesh = match listener {
            Some(l) if world > 1 => {
                let peers: Vec<usize> = (0..world).filter(|&r| r != rank).collect();
                let mut mesh = TcpMesh::connect(
                    rank,
                    world,
                    &cfg.addrs,
                    &peers,
                    l,
                    &cfg.secret,
                    &cfg.name,
                    deadline,
                )?;
                mesh.set_spin(SpinPolicy::for_ranks(cfg.machine_ranks).spin);
                Some(mesh)
            }
            _ => None,
        };
        if matches!(mode, Mode::Tcp | Mode::Hierarchical) && mesh.is_none() {
            return Err(Error::invalid(format!(
                "rank {rank}: group {:?} spans several hosts but no TCP listener was given",
                cfg.name
            )));
        }
        let core = Core {
            rank,
            world,
            mode,
            arena: arena.clone().map(|a| {
                let lanes = Lanes::new(cfg.lanes, cfg.lanes_min_bytes, &format!("sl-r{rank}"));
                ArenaComm::new(a, cfg.oneshot_bytes, lanes)
            }),
            mesh,
            my_local,
            leaders,
            seq: 0,
            broken: None,
            timeout: cfg.timeout,
        };
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            arena,
            rank,
            world,
            mode,
        });
        let s2 = shared.clone();
        let worker = std::thread::Builder::new()
            .name(format!("shardline-{}-r{rank}", cfg.name))
            .spawn(move || worker_loop(&s2))
            .map_err(|e| Error::io("starting the communicator's worker thread", e))?;
        Ok(Communicator {
            shared,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.shared.world
    }

    /// How the ranks are connected.
    pub fn mode(&self) -> Mode {
        self.shared.mode
    }

    /// Validates `op` and runs it: inline when blocking and nothing is queued, else on the
    /// worker. `keepalive` is dropped once the op is done.
    pub fn submit(&self, op: Op, keepalive: Box<dyn Any + Send>, async_op: bool) -> Result<Work> {
        validate(&op, self.shared.rank, self.shared.world)?;
        let mut q = lock(&self.shared.queue);
        if q.closed {
            return Err(closed_error(self.shared.rank));
        }
        if !async_op && q.items.is_empty() && q.running == 0 {
            q.running += 1;
            drop(q);
            let r = run_guarded(&self.shared, &op, true);
            drop(keepalive);
            let mut q = lock(&self.shared.queue);
            q.running -= 1;
            // Wake the worker only if it has something to do: a needless wake-up costs a
            // syscall and steals a core from the peers this rank is synchronising with.
            if !q.items.is_empty() {
                self.shared.cv.notify_all();
            }
            return Ok(Work::finished(r));
        }
        let work = Work::pending();
        q.items.push_back(Job {
            op,
            work: work.clone(),
            keepalive,
            async_op,
        });
        self.shared.cv.notify_all();
        Ok(work)
    }

    /// Fails pending and future ops here and on every peer with `reason`.
    pub fn abort(&self, reason: &str) {
        let err = Error::new(
            ErrorKind::Closed,
            format!("rank {} aborted the group: {reason}", self.shared.rank),
        );
        if let Some(a) = &self.shared.arena {
            a.abort(&err);
        }
        if let Ok(mut core) = self.shared.core.try_lock() {
            core.fail(&err);
        }
    }

    /// Runs what is queued, then stops the worker; later submissions fail.
    pub fn close(&self) {
        lock(&self.shared.queue).closed = true;
        self.shared.cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        let mut core = lock(&self.shared.core);
        core.mesh = None;
        core.arena = None;
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.close();
    }
}

fn closed_error(rank: usize) -> Error {
    Error::new(
        ErrorKind::Closed,
        format!("rank {rank}: the communicator was shut down; create a new group"),
    )
}

/// Runs one op; a panic (a bug in the engine) becomes an error on this rank, breaks the
/// communicator like any failure, and leaves the queue usable for the error to surface.
///
/// `helpers`: whether a large shared-memory op may split its passes over the communicator's
/// helper threads. Only ops the caller waits for do: an async op runs beside the caller's
/// compute, whose cores the helpers would take.
fn run_guarded(shared: &Shared, op: &Op, helpers: bool) -> Result<()> {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lock(&shared.core).run(op, helpers)
    }));
    outcome.unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let err = Error::new(
            ErrorKind::Protocol,
            format!(
                "rank {}: internal error in the collective engine ({what}); please report it",
                shared.rank
            ),
        );
        lock(&shared.core).fail(&err);
        Err(err)
    })
}

fn worker_loop(shared: &Shared) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if q.running == 0 {
                    if let Some(j) = q.items.pop_front() {
                        q.running += 1;
                        break j;
                    }
                    if q.closed {
                        return;
                    }
                }
                q = shared.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let r = run_guarded(shared, &job.op, !job.async_op);
        job.work.complete(r);
        drop(job.keepalive);
        lock(&shared.queue).running -= 1;
        shared.cv.notify_all();
    }
}

fn bad(op: &str, msg: String) -> Result<()> {
    Err(Error::invalid(format!("{op}: {msg}")))
}

/// The root of gather/scatter must pass its `role` buffer of `needed` bytes; others need none.
fn root_buffer(
    op: &str,
    role: &str,
    is_root: bool,
    buf: Option<&RawBuf>,
    needed: usize,
) -> Result<()> {
    match (is_root, buf) {
        (false, _) => Ok(()),
        (true, Some(b)) if b.len() == needed => Ok(()),
        (true, Some(b)) => bad(
            op,
            format!("root's {role} holds {} bytes, needs {needed}", b.len()),
        ),
        (true, None) => bad(op, format!("the root must pass an {role} buffer")),
    }
}

fn validate(op: &Op, rank: usize, world: usize) -> Result<()> {
    let check_root = |name: &str, root: usize| {
        if root >= world {
            return bad(
                name,
                format!("root {root} is out of range for a group of {world} ranks"),
            );
        }
        Ok(())
    };
    match op {
        Op::AllReduce { buf, dtype, op } => {
            op.validate(*dtype)?;
            dtype.count_of(buf.len(), "all_reduce").map(|_| ())
        }
        Op::Reduce {
            buf,
            dtype,
            op,
            root,
        } => {
            op.validate(*dtype)?;
            check_root("reduce", *root)?;
            dtype.count_of(buf.len(), "reduce").map(|_| ())
        }
        Op::ReduceScatter {
            out,
            inp,
            dtype,
            op,
        } => {
            op.validate(*dtype)?;
            dtype.count_of(out.len(), "reduce_scatter")?;
            if inp.len() != out.len() * world {
                return bad("reduce_scatter", format!(
                    "input holds {} bytes but must hold world_size ({world}) x output ({} bytes) = {} bytes",
                    inp.len(), out.len(), out.len() * world
                ));
            }
            Ok(())
        }
        Op::AllGather {
            out,
            inp,
            dtype,
            counts,
        } => {
            let n_in = dtype.count_of(inp.len(), "all_gather")?;
            let total: usize = match counts {
                Some(c) => {
                    if c.len() != world {
                        return bad(
                            "all_gather",
                            format!("counts has {} entries for {world} ranks", c.len()),
                        );
                    }
                    if c[rank] != n_in {
                        return bad(
                            "all_gather",
                            format!(
                                "rank {rank}'s input has {n_in} elements but counts[{rank}] = {}",
                                c[rank]
                            ),
                        );
                    }
                    c.iter().sum::<usize>() * dtype.size()
                }
                None => inp.len() * world,
            };
            if out.len() != total {
                return bad(
                    "all_gather",
                    format!(
                        "output holds {} bytes but the gathered inputs need {total}",
                        out.len()
                    ),
                );
            }
            Ok(())
        }
        Op::Broadcast { buf, dtype, root } => {
            check_root("broadcast", *root)?;
            dtype.count_of(buf.len(), "broadcast").map(|_| ())
        }
        Op::Gather {
            out,
            inp,
            dtype,
            root,
        } => {
            check_root("gather", *root)?;
            dtype.count_of(inp.len(), "gather")?;
            root_buffer(
                "gather",
                "output",
                rank == *root,
                out.as_ref(),
                inp.len() * world,
            )
        }
        Op::Scatter {
            out,
            inp,
            dtype,
            root,
        } => {
            check_root("scatter", *root)?;
            dtype.count_of(out.len(), "scatter")?;
            root_buffer(
                "scatter",
                "input",
                rank == *root,
                inp.as_ref(),
                out.len() * world,
            )
        }
        Op::AllToAll { out, inp, dtype } => {
            let n = dtype.count_of(inp.len(), "all_to_all")?;
            if out.len() != inp.len() || n % world != 0 {
                return bad("all_to_all", format!(
                    "input ({} bytes) and output ({} bytes) must be equal and split into {world} equal blocks",
                    inp.len(), out.len()
                ));
            }
            Ok(())
        }
        Op::Barrier => Ok(()),
        Op::Send { buf, dtype, peer } | Op::Recv { buf, dtype, peer } => {
            if *peer >= world || *peer == rank {
                return bad(
                    "send/recv",
                    format!("peer {peer} is not another rank of this group of {world}"),
                );
            }
            dtype.count_of(buf.len(), "send/recv").map(|_| ())
        }
    }
}

fn sig_of(op: &Op, world: usize) -> OpSig {
    match op {
        Op::AllReduce { buf, dtype, op } => {
            OpSig::new(OpKind::AllReduce, *dtype, buf.len() / dtype.size()).with_reduce(*op)
        }
        Op::ReduceScatter { out, dtype, op, .. } => {
            OpSig::new(OpKind::ReduceScatter, *dtype, out.len() / dtype.size()).with_reduce(*op)
        }
        Op::AllGather {
            inp, dtype, counts, ..
        } => {
            let n = match counts {
                Some(c) => c.iter().sum(),
                None => inp.len() / dtype.size() * world,
            };
            OpSig::new(OpKind::AllGather, *dtype, n)
        }
        Op::Broadcast { buf, dtype, root } => {
            OpSig::new(OpKind::Broadcast, *dtype, buf.len() / dtype.size()).with_root(*root)
        }
        Op::Reduce {
            buf,
            dtype,
            op,
            root,
        } => OpSig::new(OpKind::Reduce, *dtype, buf.len() / dtype.size())
            .with_root(*root)
            .with_reduce(*op),
        Op::Gather {
            inp, dtype, root, ..
        } => OpSig::new(OpKind::Gather, *dtype, inp.len() / dtype.size()).with_root(*root),
        Op::Scatter {
            out, dtype, root, ..
        } => OpSig::new(OpKind::Scatter, *dtype, out.len() / dtype.size()).with_root(*root),
        Op::AllToAll { inp, dtype, .. } => {
            OpSig::new(OpKind::AllToAll, *dtype, inp.len() / dtype.size())
        }
        Op::Barrier => OpSig::new(OpKind::Barrier, DType::U8, 0),
        // Both ends of a message sign it as a send, so the receiver can compare.
        Op::Send { buf, dtype, .. } | Op::Recv { buf, dtype, .. } => {
            OpSig::new(OpKind::Send, *dtype, buf.len() / dtype.size())
        }
    }
}

impl Core {
    fn fail(&mut self, err: &Error) {
        if let Some(a) = &self.arena {
            a.abort(err);
        }
        if let Some(m) = &mut self.mesh {
            m.abort_all(err);
        }
        if self.broken.is_none() {
            self.broken = Some(err.clone());
        }
    }

    fn run(&mut self, op: &Op, helpers: bool) -> Result<()> {
        if let Some(e) = &self.broken {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "rank {}: this group is unusable after an earlier failure ({}); shut it down and \
                     create a new one (or restart the job)",
                    self.rank, e.message
                ),
            ));
        }
        let mut sig = sig_of(op, self.world);
        if !matches!(op, Op::Send { .. } | Op::Recv { .. }) {
            sig.seq = self.seq;
            self.seq += 1;
        }
        let deadline = Instant::now() + self.timeout;
        if let Some(a) = self.arena.as_mut() {
            a.allow_helpers(helpers);
        }
        let r = self.dispatch(op, &sig, deadline);
        if let Err(e) = &r {
            self.fail(e);
        }
        r
    }

    fn mesh(&mut self) -> Result<&mut TcpMesh> {
        let rank = self.rank;
        self.mesh.as_mut().ok_or_else(|| {
            Error::invalid(format!(
                "rank {rank}: this group has no TCP links (created without a listener)"
            ))
        })
    }

    fn dispatch(&mut self, op: &Op, sig: &OpSig, deadline: Instant) -> Result<()> {
        match (op, self.mode) {
            (Op::Send { buf, peer, .. }, _) => self.mesh()?.send(*peer, sig, buf.bytes(), deadline),
            (Op::Recv { buf, peer, .. }, _) => self.mesh()?.recv(*peer, sig, buf.bytes(), deadline),
            (_, Mode::Single) => run_single(op),
            (_, Mode::Shm) => self.run_shm(op, sig, deadline),
            (Op::AllReduce { buf, dtype, op }, Mode::Hierarchical) => {
                self.hier_all_reduce(buf.bytes(), *dtype, *op, sig, deadline)
            }
            _ => {
                let members: Vec<usize> = (0..self.world).collect();
                run_p2p(self.mesh()?, &members, op, sig, deadline)
            }
        }
    }

    fn run_shm(&mut self, op: &Op, sig: &OpSig, deadline: Instant) -> Result<()> {
        let a = self.arena.as_mut().expect("shm mode has an arena");
        match op {
            Op::AllReduce { buf, dtype, op } => {
                a.all_reduce(buf.bytes(), *dtype, *op, sig, None, deadline)
            }
            Op::Reduce {
                buf,
                dtype,
                op,
                root,
            } => a.all_reduce(buf.bytes(), *dtype, *op, sig, Some(*root), deadline),
            Op::ReduceScatter {
                out,
                inp,
                dtype,
                op,
            } => a.reduce_scatter(out.bytes(), inp.bytes(), *dtype, *op, sig, deadline),
            Op::AllGather {
                out,
                inp,
                dtype,
                counts,
            } => {
                let counts: Vec<usize> = match counts {
                    Some(c) => c.iter().map(|c| c * dtype.size()).collect(),
                    None => vec![inp.len(); a.n()],
                };
                a.all_gather(out.bytes(), inp.bytes(), &counts, sig, None, deadline)
            }
            Op::Gather { out, inp, root, .. } => {
                let counts = vec![inp.len(); a.n()];
                let out = out.as_ref().map(|o| o.bytes()).unwrap_or(&mut []);
                a.all_gather(out, inp.bytes(), &counts, sig, Some(*root), deadline)
            }
            Op::Broadcast { buf, root, .. } => a.broadcast(buf.bytes(), *root, sig, deadline),
            Op::Scatter {
                out,
                inp,
                dtype,
                root,
            } => {
                let inp = inp.as_ref().map(|i| &*i.bytes()).unwrap_or(&[]);
                a.scatter(out.bytes(), inp, *root, dtype.size(), sig, deadline)
            }
            Op::AllToAll { out, inp, dtype } => {
                a.all_to_all(out.bytes(), inp.bytes(), dtype.size(), sig, deadline)
            }
            Op::Barrier => a.barrier(sig, deadline),
            Op::Send { .. } | Op::Recv { .. } => unreachable!("p2p is dispatched before"),
        }
    }

    /// Arena reduce to the local leader, TCP all-reduce among leaders, arena broadcast back.
    fn hier_all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        let partial = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        if let Some(a) = self.arena.as_mut() {
            a.all_reduce(buf, dtype, partial, sig, Some(0), deadline)?;
        }
        if self.my_local == 0 {
            let leaders = self.leaders.clone();
            let mesh = self.mesh()?;
            ring::all_reduce(mesh, &leaders, buf, dtype, partial, sig, deadline)?;
            if op == ReduceOp::Avg {
                reduce::scale(buf, dtype, self.world);
            }
        }
        if let Some(a) = self.arena.as_mut() {
            a.broadcast(buf, 0, sig, deadline)?;
        }
        Ok(())
    }
}

fn run_single(op: &Op) -> Result<()> {
    match op {
        Op::ReduceScatter { out, inp, .. }
        | Op::AllToAll { out, inp, .. }
        | Op::AllGather { out, inp, .. } => out.bytes().copy_from_slice(inp.bytes()),
        Op::Gather {
            out: Some(out),
            inp,
            ..
        }
        | Op::Scatter {
            out,
            inp: Some(inp),
            ..
        } => out.bytes().copy_from_slice(inp.bytes()),
        _ => {}
    }
    Ok(())
}

fn run_p2p<P: P2p>(
    p: &mut P,
    members: &[usize],
    op: &Op,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    match op {
        Op::AllReduce { buf, dtype, op } => {
            ring::all_reduce(p, members, buf.bytes(), *dtype, *op, sig, deadline)
        }
        Op::ReduceScatter {
            out,
            inp,
            dtype,
            op,
        } => ring::reduce_scatter(
            p,
            members,
            out.bytes(),
            inp.bytes(),
            *dtype,
            *op,
            sig,
            deadline,
        ),
        Op::AllGather {
            out,
            inp,
            dtype,
            counts,
        } => {
            let counts = counts
                .clone()
                .unwrap_or_else(|| vec![inp.len() / dtype.size(); members.len()]);
            ring::all_gather(
                p,
                members,
                out.bytes(),
                inp.bytes(),
                &counts,
                *dtype,
                sig,
                deadline,
            )
        }
        Op::Broadcast { buf, root, .. } => {
            direct::broadcast(p, members, buf.bytes(), *root, sig, deadline)
        }
        Op::Reduce {
            buf,
            dtype,
            op,
            root,
        } => direct::reduce(p, members, buf.bytes(), *dtype, *op, *root, sig, deadline),
        Op::Gather { out, inp, root, .. } => {
            let out = out.as_ref().map(|o| o.bytes()).unwrap_or(&mut []);
            direct::gather(p, members, out, inp.bytes(), *root, sig, deadline)
        }
        Op::Scatter { out, inp, root, .. } => {
            let inp = inp.as_ref().map(|i| &*i.bytes()).unwrap_or(&[]);
            direct::scatter(p, members, out.bytes(), inp, *root, sig, deadline)
        }
        Op::AllToAll { out, inp, .. } => {
            direct::all_to_all(p, members, out.bytes(), inp.bytes(), sig, deadline)
        }
        Op::Barrier => direct::barrier(p, members, sig, deadline),
        Op::Send { .. } | Op::Recv { .. } => unreachable!("p2p is dispatched before"),
    }
}
