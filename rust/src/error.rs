//! One error type for the engine: a coarse kind and a message that says what to do. The
//! bindings map each kind to an exception class; this crate knows no Python names.

use std::fmt;

/// What went wrong, coarsely: callers (the bindings) tell errors apart by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorKind {
    /// A wait passed its deadline.
    Timeout = 1,
    /// A peer died, closed its end or vanished.
    PeerLost = 2,
    /// Ranks called different collectives.
    Mismatch = 3,
    /// The caller passed something unusable.
    InvalidArgument = 4,
    /// A peer failed the HMAC handshake.
    Auth = 5,
    /// Bytes on the wire broke the protocol.
    Protocol = 6,
    /// An operating-system call failed.
    Io = 7,
    /// The communicator was shut down or broken by an earlier failure.
    Closed = 8,
    /// A checkpoint file is corrupt, truncated or unreadable.
    Checkpoint = 9,
}

impl ErrorKind {
    /// The kind for a wire tag; unknown tags read as `Protocol`.
    pub fn from_tag(tag: u8) -> Self {
        match tag {
            1 => ErrorKind::Timeout,
            2 => ErrorKind::PeerLost,
            3 => ErrorKind::Mismatch,
            4 => ErrorKind::InvalidArgument,
            5 => ErrorKind::Auth,
            7 => ErrorKind::Io,
            8 => ErrorKind::Closed,
            9 => ErrorKind::Checkpoint,
            _ => ErrorKind::Protocol,
        }
    }
}

/// An engine error: a kind and a message that says which rank, which op and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// What went wrong, coarsely.
    pub kind: ErrorKind,
    /// Full, human-readable message.
    pub message: String,
}

/// What a timeout's message advises when a rank may just be slow. It says "timeout" as a
/// word: torch's tests and tools look for " timeout ", " Timed out " or " closed " in the
/// errors of a backend.
pub const LONGER_TIMEOUT: &str =
    "raise the group's timeout (init's timeout argument, or SHARDLINE_TIMEOUT)";

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }
    /// Bad input at the API edge.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
    /// Malformed or unexpected bytes from a peer.
    pub fn protocol(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Protocol, message)
    }
    /// A failed system call, with context.
    pub fn io(context: impl fmt::Display, err: std::io::Error) -> Self {
        Self::new(ErrorKind::Io, format!("{context}: {err}"))
    }
    /// Prefixes the message with context, keeping the kind.
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}
