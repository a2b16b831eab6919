//! (stub until direct lands)
#![allow(missing_docs, unused_variables)]
use crate::collectives::p2p::P2p;
use crate::{DType, Error, OpSig, ReduceOp, Result};
use std::time::Instant;
pub fn broadcast<P: P2p>(
    p: &mut P,
    members: &[usize],
    buf: &mut [u8],
    root: usize,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
pub fn reduce<P: P2p>(
    p: &mut P,
    members: &[usize],
    buf: &mut [u8],
    root: usize,
    dtype: DType,
    op: ReduceOp,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
pub fn gather<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    root: usize,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
pub fn scatter<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    root: usize,
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
pub fn all_to_all<P: P2p>(
    p: &mut P,
    members: &[usize],
    out: &mut [u8],
    inp: &[u8],
    sig: &OpSig,
    deadline: Instant,
) -> Result<()> {
    Err(Error::invalid("stub"))
}
pub fn barrier<P: P2p>(p: &mut P, members: &[usize], sig: &OpSig, deadline: Instant) -> Result<()> {
    Err(Error::invalid("stub"))
}
