//! (stub until the TCP transport lands)
#![allow(missing_docs, unused_variables)]
use crate::collectives::p2p::P2p;
use crate::error::{Error, Result};
use crate::op::OpSig;
use std::time::Instant;
pub struct TcpListenerHandle;
impl TcpListenerHandle {
    pub fn bind(host: &str) -> Result<Self> {
        Ok(TcpListenerHandle)
    }
    pub fn address(&self) -> String {
        "127.0.0.1:1".into()
    }
}
pub struct TcpMesh;
impl TcpMesh {
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        rank: usize,
        world: usize,
        addrs: &[String],
        peers: &[usize],
        listener: TcpListenerHandle,
        secret: &[u8],
        group: &str,
        deadline: Instant,
    ) -> Result<Self> {
        Ok(TcpMesh)
    }
    pub fn abort_all(&mut self, err: &Error) {}
}
impl P2p for TcpMesh {
    fn rank(&self) -> usize {
        0
    }
    fn send(&mut self, peer: usize, sig: &OpSig, payload: &[u8], deadline: Instant) -> Result<()> {
        Err(Error::invalid("tcp stub"))
    }
    fn recv(&mut self, peer: usize, sig: &OpSig, dst: &mut [u8], deadline: Instant) -> Result<()> {
        Err(Error::invalid("tcp stub"))
    }
    fn exchange(
        &mut self,
        to: usize,
        payload: &[u8],
        from: usize,
        dst: &mut [u8],
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        Err(Error::invalid("tcp stub"))
    }
}
