//! (stub until the ring lands)
#![allow(missing_docs, unused_variables)]
use crate::collectives::p2p::P2p;
use crate::{DType, Error, OpSig, ReduceOp, Result};
use std::time::Instant;
pub fn all_reduce<P: P2p>(
    p: &mut P,
    members: &[usize],
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
pub fn reduce_scatter<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    dtype: DType,
    op: ReduceOp,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
pub fn all_gather<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    counts: &[usize],
    dtype: DType,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
