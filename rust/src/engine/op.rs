//! The ops a communicator queues: the caller's buffers, the checks an op passes before it is
//! queued, and the signature every rank compares before data moves.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::signature::{OpKind, OpSig};

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
    /// `ptr..ptr+len` must stay valid for reads and writes until the op's [`Work`](super::Work) completes.
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

    /// The memory, for the op that owns the buffer.
    #[allow(clippy::mut_from_ref)]
    pub(super) fn bytes(&self) -> &mut [u8] {
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
    /// Send to `peer` one message labelled `tag`.
    Send {
        buf: RawBuf,
        dtype: DType,
        peer: usize,
        tag: u32,
    },
    /// Receive the next message labelled `tag` from `peer`, or from whichever rank sends one
    /// first when `peer` is `None`.
    Recv {
        buf: RawBuf,
        dtype: DType,
        peer: Option<usize>,
        tag: u32,
    },
}

impl Op {
    /// Which collective the op is.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::AllReduce { .. } => OpKind::AllReduce,
            Op::ReduceScatter { .. } => OpKind::ReduceScatter,
            Op::AllGather { .. } => OpKind::AllGather,
            Op::Broadcast { .. } => OpKind::Broadcast,
            Op::Reduce { .. } => OpKind::Reduce,
            Op::Gather { .. } => OpKind::Gather,
            Op::Scatter { .. } => OpKind::Scatter,
            Op::AllToAll { .. } => OpKind::AllToAll,
            Op::Barrier => OpKind::Barrier,
            Op::Send { .. } => OpKind::Send,
            Op::Recv { .. } => OpKind::Recv,
        }
    }

    /// The element type of the op's buffers (none for a barrier).
    pub fn dtype(&self) -> Option<DType> {
        match self {
            Op::AllReduce { dtype, .. }
            | Op::ReduceScatter { dtype, .. }
            | Op::AllGather { dtype, .. }
            | Op::Broadcast { dtype, .. }
            | Op::Reduce { dtype, .. }
            | Op::Gather { dtype, .. }
            | Op::Scatter { dtype, .. }
            | Op::AllToAll { dtype, .. }
            | Op::Send { dtype, .. }
            | Op::Recv { dtype, .. } => Some(*dtype),
            Op::Barrier => None,
        }
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

/// Checks `op` on `rank` of a group of `world` ranks before it is queued: dtypes, sizes,
/// roots and peers.
pub(super) fn validate(op: &Op, rank: usize, world: usize) -> Result<()> {
    let check_root = |name: &str, root: usize| {
        if root >= world {
            return bad(
                name,
                format!("root {root} is out of range for a group of {world} ranks"),
            );
        }
        Ok(())
    };
    if let Some(dtype) = op.dtype().filter(|d| !d.is_collective()) {
        return bad(
            op.kind().name(),
            format!(
                "collectives do not move {dtype}; use one of {}",
                DType::collective_names()
            ),
        );
    }
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
        Op::Send {
            buf, dtype, peer, ..
        }
        | Op::Recv {
            buf,
            dtype,
            peer: Some(peer),
            ..
        } => {
            if *peer >= world || *peer == rank {
                return bad(
                    "send/recv",
                    format!("peer {peer} is not another rank of this group of {world}"),
                );
            }
            dtype.count_of(buf.len(), "send/recv").map(|_| ())
        }
        Op::Recv {
            buf,
            dtype,
            peer: None,
            ..
        } => {
            if world < 2 {
                return bad(
                    "recv",
                    "a receive from any source needs another rank to send; this group has one"
                        .into(),
                );
            }
            dtype.count_of(buf.len(), "recv").map(|_| ())
        }
    }
}

/// The signature of `op` in a group of `world` ranks (sequence number 0: the communicator
/// numbers its ops).
pub(super) fn sig_of(op: &Op, world: usize) -> OpSig {
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
        Op::Send {
            buf, dtype, tag, ..
        }
        | Op::Recv {
            buf, dtype, tag, ..
        } => OpSig::new(OpKind::Send, *dtype, buf.len() / dtype.size()).with_tag(*tag),
    }
}
