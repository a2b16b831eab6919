//! The communicator: op queue, worker thread, inline fast path, sequence numbers and deadlines.
//!
//! Ops run strictly in issue order. A blocking call with nothing queued runs inline on the
//! caller's thread (no hand-off, so small ops cost microseconds); anything else goes to the
//! communicator's one worker thread and returns a [`Work`], and a caller that then waits for
//! it runs it itself if the worker has not started it. Every op gets a deadline, a
//! sequence number and a signature; the first failure aborts the transports for every rank
//! and leaves the communicator closed, so later calls fail fast instead of hanging.
//!
//! - [`config`]: [`CommConfig`], what a rank needs to join, every tunable with its default.
//! - [`op`]: [`Op`], the queued op with the caller's buffers ([`RawBuf`]), its checks and
//!   its signature.
//! - [`work`]: [`Work`], an op's completion.
//! - [`dispatch`]: the route of each op to a transport and an algorithm, by [`Mode`].
//! - `mailbox`: which message a receive takes (by source and tag, or from any source).
//! - `queue`: the worker thread, and a waiting caller, that run queued ops in order.
//! - `sends`: the send lane, which runs sends to ranks of this host beside the queue.
//! - this file: [`Communicator`], submission, and what runs one op (numbering, deadline).

pub mod config;
pub mod dispatch;
mod links;
mod mailbox;
pub mod op;
mod queue;
mod sends;
mod taking_in;
pub mod work;

use std::any::Any;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use config::CommConfig;
pub use dispatch::Mode;
use dispatch::Router;
use op::{sig_of, validate};
pub use op::{Op, RawBuf};
use queue::{panic_message, run_guarded, worker_loop, Job, Queue};
use sends::SendLane;
pub use work::{Outcome, Work};

use crate::error::{Error, ErrorKind, Result};
use crate::transport::shm::Arena;
use crate::transport::tcp::TcpListenerHandle;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Shared {
    core: Mutex<Core>,
    queue: Mutex<Queue>,
    cv: Condvar,
    arena: Option<Arc<Arena>>,
    /// Sends to ranks of this host, beside the queue (when the host has several ranks).
    sends: Option<SendLane>,
    rank: usize,
    world: usize,
    mode: Mode,
}

/// What runs the ops, one at a time: the links, the sequence numbers, the deadline of every
/// op, and the first failure, which breaks the communicator for good.
struct Core {
    router: Router,
    seq: u64,
    broken: Option<Error>,
    timeout: Duration,
}

/// A communicator: a group of ranks and the engine that runs their collectives.
pub struct Communicator {
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl Communicator {
    /// Joins the communicator described by `cfg`; `listener` is this rank's bound TCP
    /// listener (needed for point-to-point ops and multi-host groups).
    pub fn new(cfg: CommConfig, listener: Option<TcpListenerHandle>) -> Result<Self> {
        cfg.validate()?;
        let (router, arena) = Router::connect(&cfg, listener)?;
        let (rank, world, mode) = (router.rank, router.world, router.mode);
        let sends = match &arena {
            Some(a) => Some(SendLane::start(
                a.clone(),
                rank,
                world,
                cfg.timeout,
                &cfg.name,
            )?),
            None => None,
        };
        let core = Core {
            router,
            seq: 0,
            broken: None,
            timeout: cfg.timeout,
        };
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            arena,
            sends,
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

    /// All-reduces on this host's shared memory up to this many bytes are one-shot, larger
    /// ones two-phase: as set, or as the first all-reduce measured (before it, the default).
    /// `None`: this rank's host has no other rank of the group. Waits for an op in progress.
    pub fn oneshot_bytes(&self) -> Option<usize> {
        lock(&self.shared.core).router.oneshot_bytes()
    }

    /// Maps one symmetric allocation: `paths` holds every rank's segment file (by group
    /// rank), each `len` bytes; returns its index and this rank's segment. Collectives on buffers
    /// inside it then skip the arena's slots when every rank passes the same place. Every rank registers
    /// its allocations in the same order; waits for an op in progress.
    pub fn register_symmetric(
        &self,
        paths: &[String],
        len: usize,
    ) -> Result<(usize, Arc<crate::transport::shm::segment::Segment>)> {
        lock(&self.shared.core)
            .router
            .register_symmetric(paths, len)
    }

    /// Forgets symmetric allocation `index` (what [`Self::register_symmetric`] returned) on
    /// this rank, once no buffer of it is in use here; waits for an op in progress.
    pub fn release_symmetric(&self, index: usize) -> Result<()> {
        lock(&self.shared.core).router.release_symmetric(index)
    }

    /// Validates `op` and runs it: inline when blocking and nothing is queued, else on the
    /// worker. `keepalive` is dropped once the op is done.
    pub fn submit(&self, op: Op, keepalive: Box<dyn Any + Send>, async_op: bool) -> Result<Work> {
        validate(&op, self.shared.rank, self.shared.world)?;
        if let Some(lane) = self.shared.sends.as_ref().filter(|l| l.takes(&op)) {
            return lane.submit(op, keepalive, async_op);
        }
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
            // Wake the worker only if it has something to do (or must stop): a needless
            // wake-up costs a syscall and steals a core from the peers this rank is
            // synchronising with.
            if !q.items.is_empty() || q.closed {
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

    /// Runs the queued ops up to `work` on this thread when the worker is not running one, as
    /// a caller about to wait for `work` may (`queue::run_until`).
    pub fn run_until(&self, work: &Work) {
        queue::run_until(&self.shared, work);
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
        if let Some(lane) = &self.shared.sends {
            lane.close();
        }
        lock(&self.shared.core).router.disconnect();
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

impl Core {
    fn fail(&mut self, err: &Error) {
        self.router.abort(err);
        if self.broken.is_none() {
            self.broken = Some(err.clone());
        }
    }

    /// Numbers `op`, gives it its deadline and runs it; a failure breaks the communicator.
    /// A receive's outcome is the rank its message came from.
    fn run(&mut self, op: &Op, helpers: bool) -> Outcome {
        if self.broken.is_none() {
            // A failed send on the send lane, or a peer's failure, aborted the arena between
            // two of this rank's ops: this op is the first to hear of it and raises it as it
            // is, so a lost peer is a PeerLost error on every survivor, whether the survivor
            // was inside an op or between two. Later ops say the group is unusable.
            if let Some(e) = self.router.aborted() {
                self.fail(&e);
                return Err(e);
            }
        }
        if let Some(e) = &self.broken {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "rank {}: this group is unusable after an earlier failure ({}); shut it down and \
                     create a new one (or restart the job)",
                    self.router.rank, e.message
                ),
            ));
        }
        let mut sig = sig_of(op, self.router.world);
        if !matches!(op, Op::Send { .. } | Op::Recv { .. }) {
            sig.seq = self.seq;
            self.seq += 1;
        }
        let deadline = Instant::now() + self.timeout;
        self.router.allow_helpers(helpers);
        let r = self.router.dispatch(op, &sig, deadline);
        if let Err(e) = &r {
            self.fail(e);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::dtype::DType;
    use crate::memcpy::StreamMode;
    use crate::reduce::ReduceOp;
    use crate::transport::shm;
    use crate::wait::SpinPolicy;

    static NEXT: AtomicUsize = AtomicUsize::new(0);

    /// Runs `body` on two ranks of one host (a 1 MiB-slot arena), each config first changed
    /// by `settings`.
    fn on_one_host<T: Send>(
        settings: impl Fn(&mut CommConfig) + Sync,
        body: impl Fn(&Communicator) -> T + Sync,
    ) -> Vec<T> {
        let path = format!(
            "/dev/shm/shardline-{}-engine{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        shm::create(&path, 2, 1 << 20).unwrap();
        let out = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|r| {
                    let (path, settings, body) = (&path, &settings, &body);
                    s.spawn(move || {
                        let mut cfg = CommConfig::new(r, 2, "unit");
                        cfg.arena_path = Some(path.clone());
                        cfg.timeout = Duration::from_secs(5);
                        settings(&mut cfg);
                        body(&Communicator::new(cfg, None).unwrap())
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        shm::unlink(&path).unwrap();
        out
    }

    fn f32_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
        values.flat_map(f32::to_le_bytes).collect()
    }

    #[test]
    fn shared_memory_settings_reach_the_engine() {
        for mode in [StreamMode::Off, StreamMode::All, StreamMode::CopyIn] {
            let got = on_one_host(
                |cfg| {
                    cfg.stream_stores = mode;
                    cfg.spin_us = 7;
                    cfg.oneshot_bytes = Some(4096);
                    cfg.comm_threads = 3;
                    // Never split: streaming applies only to ops on one thread.
                    cfg.comm_threads_min_bytes = usize::MAX;
                },
                |c| {
                    let seen = {
                        let core = lock(&c.shared.core);
                        let a = core
                            .router
                            .arena()
                            .expect("two ranks of one host share an arena");
                        let spin = a.arena().spin_policy().spin;
                        (
                            a.stream_mode(),
                            a.oneshot_bytes(),
                            spin,
                            a.comm_threads().threads(),
                        )
                    };
                    // A 1 MiB all_reduce: chunked (above oneshot_bytes), each rank's part
                    // large enough to stream in every mode that streams.
                    let n = (1 << 20) / 4;
                    let mut buf = f32_bytes((0..n).map(|i| (i % 1000) as f32 + c.rank() as f32));
                    let op = Op::AllReduce {
                        buf: RawBuf::from_slice(&mut buf),
                        dtype: DType::F32,
                        op: ReduceOp::Sum,
                    };
                    c.submit(op, Box::new(()), false)
                        .unwrap()
                        .wait_for(None)
                        .unwrap();
                    (seen, buf)
                },
            );
            // 7 µs unless the ranks outnumber the cores.
            let spin = SpinPolicy::for_ranks(2, Duration::from_micros(7)).spin;
            let want = f32_bytes((0..(1 << 18)).map(|i| 2.0 * (i % 1000) as f32 + 1.0));
            for (seen, buf) in got {
                assert_eq!(seen, (mode, 4096, spin, 3), "{mode:?}");
                assert!(buf == want, "{mode:?}: wrong all_reduce result");
            }
        }
    }

    #[test]
    fn a_caller_waiting_for_queued_ops_runs_them_in_order() {
        // Whoever runs each op (the worker or the waiting caller), every result is the sum of
        // its own buffers: the ops ran one at a time, in the order both ranks issued them.
        let n = 4096;
        let got = on_one_host(
            |_| {},
            |c| {
                let mut bufs: Vec<Vec<u8>> = (0..6)
                    .map(|k| f32_bytes((0..n).map(|i| (i * (k + 1) + c.rank()) as f32)))
                    .collect();
                for _round in 0..3 {
                    let works: Vec<Work> = bufs
                        .iter_mut()
                        .map(|b| {
                            let op = Op::AllReduce {
                                buf: RawBuf::from_slice(b),
                                dtype: DType::F32,
                                op: ReduceOp::Sum,
                            };
                            c.submit(op, Box::new(()), true).unwrap()
                        })
                        .collect();
                    let last = works.last().unwrap();
                    c.run_until(last);
                    for w in &works {
                        w.wait_for(None).unwrap();
                    }
                }
                bufs
            },
        );
        for (r, bufs) in got.iter().enumerate() {
            for (k, b) in bufs.iter().enumerate() {
                // x + rank summed over two ranks, three times: 8x + 4.
                let want = f32_bytes((0..n).map(|i| (8 * (i * (k + 1)) + 4) as f32));
                assert!(*b == want, "rank {r}, buffer {k}");
            }
        }
    }

    #[test]
    fn send_and_recv_on_one_host_go_through_the_arena() {
        // No TCP listener: the only way between the two ranks is the arena's channels.
        let got = on_one_host(
            |_| {},
            |c| {
                let mut buf = f32_bytes((0..1000).map(|i| i as f32 * (1.0 + c.rank() as f32)));
                let peer = 1 - c.rank();
                let op = if c.rank() == 0 {
                    Op::Send {
                        buf: RawBuf::from_slice(&mut buf),
                        dtype: DType::F32,
                        peer,
                        tag: 0,
                    }
                } else {
                    Op::Recv {
                        buf: RawBuf::from_slice(&mut buf),
                        dtype: DType::F32,
                        peer: Some(peer),
                        tag: 0,
                    }
                };
                c.submit(op, Box::new(()), false)
                    .unwrap()
                    .wait_for(None)
                    .unwrap();
                buf
            },
        );
        assert!(got[1] == f32_bytes((0..1000).map(|i| i as f32)));
    }

    #[test]
    fn an_async_send_does_not_hold_up_a_receive_from_the_same_peer() {
        // Each rank sends 8 MiB (8x the channel's ring) to the other, then receives: the
        // sends must run beside the receives, or both ranks wait for each other.
        let n = 2 << 20;
        let got = on_one_host(
            |_| {},
            |c| {
                let peer = 1 - c.rank();
                let mut out = f32_bytes((0..n).map(|i| (i + c.rank()) as f32));
                let mut inp = vec![0u8; out.len()];
                let send = Op::Send {
                    buf: RawBuf::from_slice(&mut out),
                    dtype: DType::F32,
                    peer,
                    tag: 0,
                };
                let sent = c.submit(send, Box::new(()), true).unwrap();
                let recv = Op::Recv {
                    buf: RawBuf::from_slice(&mut inp),
                    dtype: DType::F32,
                    peer: Some(peer),
                    tag: 0,
                };
                c.submit(recv, Box::new(()), false)
                    .unwrap()
                    .wait_for(None)
                    .unwrap();
                sent.wait_for(None).unwrap();
                inp
            },
        );
        for (r, inp) in got.iter().enumerate() {
            assert!(
                *inp == f32_bytes((0..n).map(|i| (i + 1 - r) as f32)),
                "rank {r}"
            );
        }
    }

    #[test]
    fn tcp_waits_spin_as_configured() {
        let listeners: Vec<_> = (0..2)
            .map(|_| TcpListenerHandle::bind("127.0.0.1").unwrap())
            .collect();
        let addrs: Vec<String> = listeners.iter().map(|l| l.address()).collect();
        let spins: Vec<Duration> = std::thread::scope(|s| {
            let ranks: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let addrs = addrs.clone();
                    s.spawn(move || {
                        let mut cfg = CommConfig::new(r, 2, "unit-tcp");
                        cfg.host_ids = vec!["a".into(), "b".into()];
                        cfg.addrs = addrs;
                        cfg.secret = b"unit test secret".to_vec();
                        cfg.timeout = Duration::from_secs(5);
                        // One rank on this machine: it always has a core, so it spins as set.
                        cfg.machine_ranks = 1;
                        cfg.spin_us = 7;
                        let c = Communicator::new(cfg, Some(l)).unwrap();
                        assert_eq!(c.mode(), Mode::Tcp);
                        c.submit(Op::Barrier, Box::new(()), false)
                            .unwrap()
                            .wait_for(None)
                            .unwrap();
                        let core = lock(&c.shared.core);
                        core.router.tcp().expect("a TCP group has links").spin()
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(spins, [Duration::from_micros(7); 2]);
    }

    #[test]
    fn dtypes_only_files_hold_are_refused_before_queueing() {
        let c = Communicator::new(CommConfig::new(0, 1, "unit-dtype"), None).unwrap();
        let mut buf = [0u8; 4];
        let op = Op::Broadcast {
            buf: RawBuf::from_slice(&mut buf),
            dtype: DType::I16,
            root: 0,
        };
        let Err(err) = c.submit(op, Box::new(()), false) else {
            panic!("an int16 broadcast was queued");
        };
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(
            err.message
                .starts_with("broadcast: collectives do not move int16; use one of float32"),
            "{err}"
        );
    }
}
