//! Routing: which transport and which algorithm run an op, by the group's layout.
//!
//! A `Router` holds this rank's links (the arena of its host, the TCP mesh to the other
//! ranks) and sends each op where it belongs: point-to-point ops through the arena's channels
//! to ranks of this host and over TCP to the others; collectives on the arena inside one host, ring and direct algorithms over TCP across hosts, and, for groups
//! with several ranks on several hosts, the arena inside each host around a TCP all-reduce
//! among the hosts' leaders.

use std::sync::Arc;
use std::time::Instant;

use super::config::CommConfig;
use super::links::{tcp_peers, unlinked, P2pLinks};
use super::mailbox::{Mailbox, ParkMeanwhile, PARK_LIMIT};
use super::op::Op;
use super::taking_in;
use super::work::Outcome;
use crate::collectives::arena::{self, ArenaComm};
use crate::collectives::comm_threads::CommThreads;
use crate::collectives::{direct, ring};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::{self, ReduceOp};
use crate::signature::OpSig;
use crate::transport::p2p::P2p;
use crate::transport::shm::segment::Segment;
use crate::transport::shm::Arena;
use crate::transport::tcp::{LinkOptions, TcpListenerHandle, TcpMesh};
use crate::wait::SpinPolicy;

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

/// This rank's links and the route of every op over them.
pub(super) struct Router {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) mode: Mode,
    arena: Option<ArenaComm>,
    mesh: Option<TcpMesh>,
    /// This rank's index among the ranks of its host (0 = the host's leader).
    my_local: usize,
    /// The lowest rank of every host (hierarchical mode).
    leaders: Vec<usize>,
    /// Messages taken ahead of the receive that wants their tag.
    mailbox: Mailbox,
}

impl Router {
    /// Links this rank as `cfg` describes (a validated config): maps its host's arena when
    /// the host has several ranks, and connects the TCP mesh through `listener` (needed for
    /// point-to-point ops and groups across hosts). Also returns the arena, which the
    /// communicator keeps to abort it while an op holds the router.
    pub(super) fn connect(
        cfg: &CommConfig,
        listener: Option<TcpListenerHandle>,
    ) -> Result<(Self, Option<Arc<Arena>>)> {
        let (rank, world) = (cfg.rank, cfg.world);
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
            let a = Arc::new(Arena::open(path, my_local, local.clone(), cfg.spin())?);
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
                    &LinkOptions {
                        keepalive: cfg.keepalive,
                        cancel: cfg.cancel.clone(),
                    },
                )?;
                mesh.set_spin(SpinPolicy::for_ranks(cfg.machine_ranks, cfg.spin()).spin);
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
        let comm = match arena.clone() {
            Some(a) => {
                let comm_threads = CommThreads::new(
                    cfg.comm_threads,
                    cfg.comm_threads_min_bytes,
                    &format!("sl-r{rank}"),
                );
                let fixed = cfg.oneshot_bytes.unwrap_or(arena::DEFAULT_ONESHOT_BYTES);
                let mut comm = ArenaComm::new(a, fixed, comm_threads, cfg.stream_stores);
                // Measured unless set, or unless the ranks outnumber the cores: then times
                // say more about the scheduler than about the algorithms, and one phase (one
                // wait for every rank to be scheduled) beats two.
                let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
                if cfg.oneshot_bytes.is_none() && cfg.machine_ranks <= cores {
                    comm.tune_oneshot_at_first_use();
                }
                Some(comm)
            }
            None => None,
        };
        let router = Router {
            rank,
            world,
            mode,
            arena: comm,
            mesh,
            my_local,
            leaders,
            mailbox: Mailbox::new(PARK_LIMIT),
        };
        Ok((router, arena))
    }

    /// Up to how many bytes all-reduces on the arena are one-shot (no arena: `None`).
    pub(super) fn oneshot_bytes(&self) -> Option<usize> {
        self.arena.as_ref().map(ArenaComm::oneshot_bytes)
    }

    /// Maps one symmetric allocation (every rank's segment file, by group rank) into the
    /// arena's collectives; this rank's segment. Only where the whole group shares one host.
    pub(super) fn register_symmetric(
        &mut self,
        paths: &[String],
        len: usize,
    ) -> Result<(usize, Arc<Segment>)> {
        match (self.arena.as_mut(), self.mode) {
            (Some(a), Mode::Shm) => a.register_symmetric(paths, len),
            _ => Err(Error::invalid(format!(
                "symmetric memory needs a group whose ranks all share one host (this group is \
                 {:?}); allocate ordinary tensors on it",
                self.mode
            ))),
        }
    }

    /// Forgets symmetric allocation `index` on this rank.
    pub(super) fn release_symmetric(&mut self, index: usize) -> Result<()> {
        match self.arena.as_mut() {
            Some(a) => a.release_symmetric(index),
            None => Err(Error::invalid(format!(
                "no symmetric allocation #{index} on this group (it has no shared memory)"
            ))),
        }
    }

    /// The arena's collectives, if this rank's host has several ranks.
    #[cfg(test)]
    pub(super) fn arena(&self) -> Option<&ArenaComm> {
        self.arena.as_ref()
    }

    /// The TCP links, if the group was created with a listener.
    #[cfg(test)]
    pub(super) fn tcp(&self) -> Option<&TcpMesh> {
        self.mesh.as_ref()
    }

    /// Whether the next ops may split their memory passes over the helper threads.
    pub(super) fn allow_helpers(&mut self, on: bool) {
        if let Some(a) = self.arena.as_mut() {
            a.allow_helpers(on);
        }
    }

    /// Fails every link with `err`, so that peers waiting on this rank stop at once.
    pub(super) fn abort(&mut self, err: &Error) {
        if let Some(a) = &self.arena {
            a.abort(err);
        }
        if let Some(m) = &mut self.mesh {
            m.abort_all(err);
        }
    }

    /// The error the arena was aborted with, by this rank or a peer, if any.
    pub(super) fn aborted(&self) -> Option<Error> {
        self.arena.as_ref().and_then(|a| a.arena().aborted())
    }

    /// Releases the links.
    pub(super) fn disconnect(&mut self) {
        self.mesh = None;
        self.arena = None;
    }

    /// The TCP mesh, and the mailbox where the collective `sig` parks the point-to-point
    /// messages that reach this rank over it meanwhile ([`TcpMesh::parking`]).
    fn parking(&mut self, sig: &OpSig) -> Result<(&mut TcpMesh, ParkMeanwhile<'_>)> {
        let rank = self.rank;
        let mesh = self.mesh.as_mut().ok_or_else(|| unlinked(rank))?;
        let parking = ParkMeanwhile {
            mailbox: &mut self.mailbox,
            me: rank,
            during: *sig,
        };
        Ok((mesh, parking))
    }

    /// The ranks this rank's TCP mesh links it to, but for those of its host.
    fn tcp_peers(&self) -> Vec<usize> {
        let arena = self.arena.as_ref().map(ArenaComm::arena);
        self.mesh
            .as_ref()
            .map_or_else(Vec::new, |m| tcp_peers(self.world, m, arena))
    }

    /// The links point-to-point messages take: the arena's channels to ranks of this host,
    /// TCP to the others.
    fn links(&mut self) -> (P2pLinks<'_>, &mut Mailbox) {
        let links = P2pLinks {
            rank: self.rank,
            world: self.world,
            arena: self.arena.as_ref().map(ArenaComm::arena),
            mesh: self.mesh.as_mut(),
        };
        (links, &mut self.mailbox)
    }

    /// Runs `op` (signed `sig`) on the transport and algorithm its kind and the group's
    /// mode call for, by `deadline`. A receive's outcome is the rank its message came from.
    pub(super) fn dispatch(&mut self, op: &Op, sig: &OpSig, deadline: Instant) -> Outcome {
        match op {
            Op::Send { buf, peer, .. } => {
                let (mut links, mailbox) = self.links();
                links
                    .send(*peer, sig, buf.bytes(), deadline, mailbox)
                    .map(|()| None)
            }
            Op::Recv { buf, peer, .. } => {
                let (mut links, mailbox) = self.links();
                mailbox
                    .recv(&mut links, *peer, sig, buf.bytes(), deadline)
                    .map(Some)
            }
            _ => self.run(op, sig, deadline).map(|()| None),
        }
    }

    fn run(&mut self, op: &Op, sig: &OpSig, deadline: Instant) -> Result<()> {
        match (op, self.mode) {
            (Op::Send { .. } | Op::Recv { .. }, _) => unreachable!("p2p is dispatched before"),
            (_, Mode::Single) => run_single(op),
            (_, Mode::Shm) => self.run_shm(op, sig, deadline),
            (Op::AllReduce { buf, dtype, op }, Mode::Hierarchical) => {
                self.hier_all_reduce(buf.bytes(), *dtype, *op, sig, deadline)
            }
            _ => {
                let members: Vec<usize> = (0..self.world).collect();
                let others = self.tcp_peers();
                let (mesh, mut parking) = self.parking(sig)?;
                run_p2p(
                    &mut mesh.parking(others, &mut parking),
                    &members,
                    op,
                    sig,
                    deadline,
                )
            }
        }
    }

    fn run_shm(&mut self, op: &Op, sig: &OpSig, deadline: Instant) -> Result<()> {
        let a = self.arena.as_mut().expect("shm mode has an arena");
        match op {
            Op::AllReduce { buf, dtype, op } => {
                a.all_reduce(None, buf.bytes(), *dtype, *op, sig, None, deadline)
            }
            Op::Reduce {
                buf,
                dtype,
                op,
                root,
            } => a.all_reduce(None, buf.bytes(), *dtype, *op, sig, Some(*root), deadline),
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
        let premul = reduce::premultiplied_avg(dtype, op);
        if premul {
            reduce::scale(buf, dtype, self.world); // this rank's share of the mean, in place
        }
        // The arena's waits read what other hosts' ranks send to this one meanwhile.
        let others = self.tcp_peers();
        self.on_arena(&others, sig, deadline, |a| {
            a.all_reduce(None, buf, dtype, partial, sig, Some(0), deadline)
        })?;
        if self.my_local == 0 {
            let leaders = self.leaders.clone();
            let (mesh, mut parking) = self.parking(sig)?;
            let mut mesh = mesh.parking(others.clone(), &mut parking);
            ring::all_reduce(&mut mesh, &leaders, buf, dtype, partial, sig, deadline)?;
            if op == ReduceOp::Avg && !premul {
                reduce::scale(buf, dtype, self.world);
            }
        }
        self.on_arena(&others, sig, deadline, |a| {
            a.broadcast(buf, 0, sig, deadline)
        })
    }

    /// Runs `op` on this host's arena, if it has one, while its waits take in the messages
    /// the ranks of `others` (of other hosts) send to this one over TCP ([`taking_in`]).
    fn on_arena(
        &mut self,
        others: &[usize],
        sig: &OpSig,
        deadline: Instant,
        op: impl FnOnce(&mut ArenaComm) -> Result<()>,
    ) -> Result<()> {
        let Some(arena) = self.arena.as_mut() else {
            return Ok(());
        };
        taking_in::run(
            arena,
            &mut self.mesh,
            &mut self.mailbox,
            others,
            self.rank,
            sig,
            deadline,
            op,
        )
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
