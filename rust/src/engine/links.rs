//! The links point-to-point messages take: the arena's channels to ranks of this host, TCP
//! to the others ([`P2pLinks`]), and the ranks a TCP wait takes messages in from.

use std::time::Instant;

use super::mailbox::{Links, Mailbox, ParkMeanwhile};
use crate::error::{Error, Result};
use crate::signature::OpSig;
use crate::transport::p2p::P2p;
use crate::transport::shm::Arena;
use crate::transport::tcp::TcpMesh;

/// The links a receive uses: the arena's channels to ranks of this host, TCP to the others.
pub(super) struct P2pLinks<'a> {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) arena: Option<&'a Arena>,
    pub(super) mesh: Option<&'a mut TcpMesh>,
}

impl P2pLinks<'_> {
    /// `peer`'s index in the arena, if it shares this rank's host.
    fn local(&self, peer: usize) -> Option<(&Arena, usize)> {
        let a = self.arena?;
        a.local_of(peer).map(|local| (a, local))
    }

    fn mesh(&mut self) -> Result<&mut TcpMesh> {
        let rank = self.rank;
        self.mesh.as_deref_mut().ok_or_else(|| unlinked(rank))
    }

    /// Sends one message, signed `sig`, to `peer`. Over TCP, the messages that reach this
    /// rank from its TCP peers while the send waits for room are parked in `mailbox` for the
    /// receives that follow ([`ParkMeanwhile`]).
    pub(super) fn send(
        &mut self,
        peer: usize,
        sig: &OpSig,
        payload: &[u8],
        deadline: Instant,
        mailbox: &mut Mailbox,
    ) -> Result<()> {
        if let Some((a, local)) = self.local(peer) {
            return a.send_to(local, sig, payload, deadline);
        }
        let (rank, world, arena) = (self.rank, self.world, self.arena);
        let mesh = self.mesh()?;
        let others = tcp_peers(world, mesh, arena);
        let mut parking = ParkMeanwhile {
            mailbox,
            me: rank,
            during: *sig,
        };
        mesh.send_draining(peer, sig, payload, deadline, &others, &mut parking)
    }
}

/// The ranks of `world` that `mesh` links this rank to, but for those of its host (`arena`'s).
pub(super) fn tcp_peers(world: usize, mesh: &TcpMesh, arena: Option<&Arena>) -> Vec<usize> {
    (0..world)
        .filter(|&p| mesh.linked(p) && arena.is_none_or(|a| a.local_of(p).is_none()))
        .collect()
}

/// The error of a message to a rank of another host in a group made without TCP links.
pub(super) fn unlinked(rank: usize) -> Error {
    Error::invalid(format!(
        "rank {rank}: this group has no TCP links (created without a listener)"
    ))
}

impl Links for P2pLinks<'_> {
    fn me(&self) -> usize {
        self.rank
    }

    fn peers(&self) -> Vec<usize> {
        (0..self.world).filter(|&r| r != self.rank).collect()
    }

    fn next(
        &mut self,
        peer: usize,
        expected: &OpSig,
        deadline: Option<Instant>,
    ) -> Result<Option<(OpSig, u64)>> {
        match (self.local(peer), deadline) {
            (Some((a, local)), None) => a.peek_from(local),
            (Some((a, local)), Some(d)) => a.wait_message_from(local, expected, d).map(Some),
            (None, _) => self.mesh()?.peek(peer, expected, deadline),
        }
    }

    fn take(&mut self, peer: usize, sig: &OpSig, dst: &mut [u8], deadline: Instant) -> Result<()> {
        match self.local(peer) {
            Some((a, local)) => a.recv_from(local, sig, dst, deadline),
            None => self.mesh()?.recv(peer, sig, dst, deadline),
        }
    }
}
