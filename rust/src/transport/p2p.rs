//! Point-to-point messages between two ranks: the interface a transport implements and the
//! collective algorithms use from above.

use std::time::Instant;

use crate::error::Result;
use crate::signature::OpSig;

/// Framed, signature-checked messages between this rank and its peers.
///
/// Every message carries the sender's [`OpSig`]; a receiver whose own signature differs fails
/// with a `Mismatch` error naming both sides, and a message whose length differs from what the
/// receiver expects fails with a `Protocol` error. Every call honours `deadline`.
pub trait P2p {
    /// This rank's rank (in the numbering `peer` arguments use).
    fn rank(&self) -> usize;

    /// Sends `out`'s payload to its peer while receiving from `inp`'s peer into its buffer
    /// (exactly its length), either side optional; never deadlocks when the peers do the same
    /// towards this rank. The two peers may be one.
    fn transfer(
        &mut self,
        out: Option<(usize, &[u8])>,
        inp: Option<(usize, &mut [u8])>,
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()>;

    /// Sends `payload` to `peer` as one message tagged with `sig`.
    fn send(&mut self, peer: usize, sig: &OpSig, payload: &[u8], deadline: Instant) -> Result<()> {
        self.transfer(Some((peer, payload)), None, sig, deadline)
    }

    /// Receives one message from `peer` into `dst` (exactly `dst.len()` bytes).
    fn recv(&mut self, peer: usize, sig: &OpSig, dst: &mut [u8], deadline: Instant) -> Result<()> {
        self.transfer(None, Some((peer, dst)), sig, deadline)
    }

    /// Sends `payload` to `to` while receiving from `from` into `dst`; never deadlocks when the
    /// peers do the same towards this rank. `to == from` is allowed.
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &mut self,
        to: usize,
        payload: &[u8],
        from: usize,
        dst: &mut [u8],
        sig: &OpSig,
        deadline: Instant,
    ) -> Result<()> {
        self.transfer(Some((to, payload)), Some((from, dst)), sig, deadline)
    }
}
