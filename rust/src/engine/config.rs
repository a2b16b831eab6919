//! What a rank needs to join a communicator: who is where, and every tunable, with the
//! engine's defaults and the checks a config must pass.
//!
//! The engine reads no environment: Python reads each `SHARDLINE_*` setting once
//! (`shardline.config`) and passes it down as a field here.

use std::time::Duration;

use crate::collectives::comm_threads;
use crate::error::{Error, Result};
use crate::memcpy::StreamMode;
use crate::transport::tcp::Cancel;
use crate::wait;

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
    /// All-reduces up to this size are one-shot on the arena (`SHARDLINE_ONESHOT_BYTES`);
    /// `None`: measured by the first all-reduce ([`crate::collectives::tuning`]).
    pub oneshot_bytes: Option<usize>,
    /// Ranks of the job on this machine, whatever their host ids say (they share its cores):
    /// TCP waits spin only while every one of them has a core.
    pub machine_ranks: usize,
    /// Threads per rank for the memory passes of large shared-memory ops (1: none).
    pub comm_threads: usize,
    /// Shared-memory ops of at least this many bytes use the comm_threads.
    pub comm_threads_min_bytes: usize,
    /// How long shared-memory and TCP waits spin before they sleep, in microseconds, while
    /// every rank has a core (`SHARDLINE_SPIN_US`); ranks that outnumber the cores spin
    /// [`wait::OVERSUBSCRIBED_SPIN`] whatever this says.
    pub spin_us: u64,
    /// Which copies into shared memory use streaming stores (`SHARDLINE_STREAM_STORES`).
    pub stream_stores: StreamMode,
    /// A TCP peer that stops acknowledging for this long is lost, whatever the op's deadline
    /// (`SHARDLINE_KEEPALIVE`); zero keeps the kernel's defaults.
    pub keepalive: Duration,
    /// Asked while the TCP mesh is set up; an error ends the setup (see [`Cancel`]).
    pub cancel: Option<Cancel>,
}

/// Default of [`CommConfig::keepalive`].
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(30);

/// Default of [`CommConfig::spin_us`].
pub const DEFAULT_SPIN_US: u64 = wait::DEFAULT_SPIN.as_micros() as u64;

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
            oneshot_bytes: None,
            machine_ranks: world,
            comm_threads: 1,
            comm_threads_min_bytes: comm_threads::DEFAULT_MIN_BYTES,
            spin_us: DEFAULT_SPIN_US,
            stream_stores: StreamMode::default(),
            keepalive: DEFAULT_KEEPALIVE,
            cancel: None,
        }
    }

    /// The spin setting as a duration.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us)
    }

    /// Checks that the config describes one rank of a group consistently.
    pub fn validate(&self) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        if world == 0 || rank >= world || self.host_ids.len() != world || self.addrs.len() != world
        {
            return Err(Error::invalid(format!(
                "bad communicator config: rank {rank} of world {world} with {} host ids and {} addresses",
                self.host_ids.len(),
                self.addrs.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_engine_defaults() {
        let cfg = CommConfig::new(1, 4, "g");
        assert_eq!(cfg.spin(), wait::DEFAULT_SPIN);
        assert_eq!(cfg.spin_us, 50);
        assert_eq!(cfg.stream_stores, StreamMode::CopyIn);
        assert_eq!(cfg.oneshot_bytes, None);
        assert_eq!(cfg.comm_threads_min_bytes, comm_threads::DEFAULT_MIN_BYTES);
        assert_eq!(cfg.keepalive, Duration::from_secs(30));
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn inconsistent_configs_are_refused() {
        let mut cfg = CommConfig::new(4, 4, "g");
        assert!(cfg
            .validate()
            .unwrap_err()
            .message
            .contains("rank 4 of world 4"));
        cfg.rank = 0;
        cfg.addrs.pop();
        assert!(cfg.validate().unwrap_err().message.contains("3 addresses"));
        assert!(CommConfig::new(0, 0, "g").validate().is_err());
    }
}
