//! Collective signatures: what each rank says it is doing, compared before data moves.

use crate::dtype::DType;
use crate::error::{Error, ErrorKind};
use crate::reduce::ReduceOp;

/// Which collective an op is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// Every rank ends with the reduction of all inputs.
    AllReduce = 1,
    /// Every rank ends with its slice of the reduction.
    ReduceScatter = 2,
    /// Every rank ends with every rank's input, concatenated.
    AllGather = 3,
    /// Every rank ends with the root's buffer.
    Broadcast = 4,
    /// The root ends with the reduction of all inputs.
    Reduce = 5,
    /// The root ends with every rank's input.
    Gather = 6,
    /// Every rank ends with its slice of the root's buffer.
    Scatter = 7,
    /// Rank i's j-th slice goes to rank j's i-th slice.
    AllToAll = 8,
    /// Nobody leaves before everybody arrived.
    Barrier = 9,
    /// Point-to-point message to one peer.
    Send = 10,
    /// Point-to-point message from one peer.
    Recv = 11,
}

impl OpKind {
    /// The torch.distributed name of the op.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
        }
    }

    /// The op for a wire tag.
    pub fn from_tag(tag: u8) -> Option<Self> {
        use OpKind::*;
        [
            AllReduce,
            ReduceScatter,
            AllGather,
            Broadcast,
            Reduce,
            Gather,
            Scatter,
            AllToAll,
            Barrier,
            Send,
            Recv,
        ]
        .into_iter()
        .find(|k| *k as u8 == tag)
    }

    /// Whether the op takes a root rank.
    pub fn has_root(self) -> bool {
        matches!(
            self,
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter
        )
    }

    /// Whether the op reduces (so its reduce op is part of the signature).
    pub fn reduces(self) -> bool {
        matches!(
            self,
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::Reduce
        )
    }
}

/// The signature of one collective call on one rank.
///
/// `count` is the per-rank element count the op is defined by: the buffer length for
/// all_reduce/broadcast/reduce, the output length for reduce_scatter and scatter, the input
/// length for all_gather and gather (0 for unequal all_gather, whose sizes are checked
/// separately), the total input length for all_to_all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpSig {
    /// Which collective.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Element count (see the type docs).
    pub count: u64,
    /// Root rank for rooted ops, the message's tag for point-to-point messages (`Send`),
    /// else 0.
    pub root: u32,
    /// Reduction for reducing ops, else `Sum`.
    pub reduce: ReduceOp,
    /// Sequence number of the op in its communicator (0-based).
    pub seq: u64,
}

/// Size of an encoded [`OpSig`].
pub const SIG_BYTES: usize = 24;

impl OpSig {
    /// A signature for `kind` on `count` elements of `dtype`.
    pub fn new(kind: OpKind, dtype: DType, count: usize) -> Self {
        OpSig {
            kind,
            dtype,
            count: count as u64,
            root: 0,
            reduce: ReduceOp::Sum,
            seq: 0,
        }
    }

    /// The same signature with a root.
    pub fn with_root(mut self, root: usize) -> Self {
        self.root = root as u32;
        self
    }

    /// The same signature with a point-to-point message's tag (kept where a root would be).
    pub fn with_tag(mut self, tag: u32) -> Self {
        self.root = tag;
        self
    }

    /// The tag of a point-to-point message (0 for every other op).
    pub fn tag(&self) -> u32 {
        if self.kind == OpKind::Send {
            self.root
        } else {
            0
        }
    }

    /// The same signature with a reduction op.
    pub fn with_reduce(mut self, reduce: ReduceOp) -> Self {
        self.reduce = reduce;
        self
    }

    /// Fixed little-endian encoding, for the arena's control lines and TCP frame headers.
    pub fn encode(&self) -> [u8; SIG_BYTES] {
        let mut out = [0u8; SIG_BYTES];
        out[0] = self.kind as u8;
        out[1] = self.dtype.tag();
        out[2] = self.reduce as u8;
        out[4..8].copy_from_slice(&self.root.to_le_bytes());
        out[8..16].copy_from_slice(&self.count.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out
    }

    /// Decodes [`OpSig::encode`]'s bytes; unknown tags are a protocol error.
    pub fn decode(bytes: &[u8; SIG_BYTES]) -> crate::Result<Self> {
        let kind = OpKind::from_tag(bytes[0])
            .ok_or_else(|| Error::protocol(format!("unknown op tag {}", bytes[0])))?;
        let dtype = DType::from_tag(bytes[1])
            .ok_or_else(|| Error::protocol(format!("unknown dtype tag {}", bytes[1])))?;
        let reduce = ReduceOp::from_tag(bytes[2])
            .ok_or_else(|| Error::protocol(format!("unknown reduce tag {}", bytes[2])))?;
        let root = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        let count = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let seq = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        Ok(OpSig {
            kind,
            dtype,
            count,
            root,
            reduce,
            seq,
        })
    }

    /// Compares this rank's signature with a peer's; the error names both sides.
    pub fn check_against(
        &self,
        my_rank: usize,
        other: &OpSig,
        other_rank: usize,
    ) -> crate::Result<()> {
        if self == other {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Mismatch,
            format!(
                "rank {other_rank} called {other} while rank {my_rank} called {self}; check that every \
                 rank runs the same collectives in the same order with the same sizes"
            ),
        ))
    }
}

impl std::fmt::Display for OpSig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}({}, {}", self.kind.name(), self.dtype, self.count)?;
        if self.kind.reduces() {
            write!(f, ", op={}", self.reduce.name())?;
        }
        if self.kind.has_root() {
            write!(f, ", root={}", self.root)?;
        }
        if self.tag() != 0 {
            write!(f, ", tag={}", self.tag())?;
        }
        if matches!(self.kind, OpKind::Send | OpKind::Recv) {
            // Messages are matched by source and tag, not numbered.
            return write!(f, ")");
        }
        write!(f, ") #{}", self.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trips() {
        let s = OpSig::new(OpKind::Reduce, DType::BF16, 12345)
            .with_root(3)
            .with_reduce(ReduceOp::Max);
        let s = OpSig { seq: 99, ..s };
        assert_eq!(OpSig::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn a_message_carries_its_tag_where_a_root_would_be() {
        let s = OpSig::new(OpKind::Send, DType::F32, 10).with_tag(7);
        assert_eq!(s.tag(), 7);
        assert_eq!(OpSig::decode(&s.encode()).unwrap().tag(), 7);
        assert_eq!(s.to_string(), "send(float32, 10, tag=7)");
        assert_eq!(
            OpSig::new(OpKind::Send, DType::F32, 10).to_string(),
            "send(float32, 10)"
        );
        let rooted = OpSig::new(OpKind::Broadcast, DType::F32, 10).with_root(3);
        assert_eq!(rooted.tag(), 0);
    }

    #[test]
    fn mismatch_message_names_both_sides() {
        let a = OpSig::new(OpKind::AllReduce, DType::F32, 1024);
        let b = OpSig::new(OpKind::AllGather, DType::F32, 1024);
        let err = a.check_against(0, &b, 1).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Mismatch);
        assert!(
            err.message.starts_with(
                "rank 1 called all_gather(float32, 1024) #0 while rank 0 called all_reduce(float32, 1024, op=sum) #0"
            ),
            "{}",
            err.message
        );
    }
}
