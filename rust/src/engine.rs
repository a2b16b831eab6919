//! (in progress) The communicator.
/// A communicator.
pub struct Communicator;
/// Its configuration.
pub struct CommConfig;
/// A pending op.
pub struct Work;
