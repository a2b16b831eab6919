"""The exception hierarchy: every error shardline raises is a ``ShardlineError``.

The Rust engine raises these classes by name (``shardline._native`` looks them up in this
module), so the names here are part of the engine's interface. Each class also subclasses the
closest built-in, so ``except TimeoutError`` or ``except ConnectionError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorClosedError",
    "InvalidArgumentError",
    "MembershipChanged",
    "MonitoredBarrierError",
    "PeerLostError",
    "ProtocolError",
    "ShardlineError",
    "TransportError",
]


class ShardlineError(Exception):
    """Base for every error raised by shardline.

    Attributes:
        failed_rank: The rank whose failure while joining the job this error reports, when it
            does (every rank still joining raises one, naming that rank); else ``None``.
    """

    failed_rank: int | None = None


class CollectiveTimeoutError(ShardlineError, TimeoutError):
    """A collective passed its deadline: its group's ``timeout``.

    That is ``init(timeout=...)``'s, else ``SHARDLINE_TIMEOUT``, else 300 s. The message names
    the op and the ranks that had not arrived.
    """


class MonitoredBarrierError(CollectiveTimeoutError, RuntimeError):
    """Ranks did not reach ``torch.distributed.monitored_barrier`` in time.

    On rank 0 the message names them (Gloo's words, so tools that match Gloo's messages keep
    working); on the others it says that rank 0 failed the barrier, and why.
    """


class PeerLostError(ShardlineError, ConnectionError):
    """A peer died, closed its connection or vanished; raised on every survivor."""


class CollectiveMismatchError(ShardlineError, ValueError):
    """Ranks called different collectives (op, dtype, count, root or order differ).

    Raised on all ranks; the message names both sides.
    """


class InvalidArgumentError(ShardlineError, ValueError):
    """An argument is unusable (non-contiguous, wrong device, dtype or size)."""


class AuthenticationError(ShardlineError, PermissionError):
    """A peer failed the HMAC handshake: ranks do not share one ``SHARDLINE_SECRET``."""


class ProtocolError(ShardlineError, ConnectionError):
    """Bytes on the wire broke the protocol (bad magic, version or lengths)."""


class TransportError(ShardlineError, OSError):
    """An operating-system call of a transport failed (socket, shared memory)."""


class CommunicatorClosedError(ShardlineError, RuntimeError):
    """The group was shut down, or broken by an earlier failure; create a new one."""


class CheckpointError(ShardlineError, OSError):
    """A checkpoint could not be written, read or resharded."""


class MembershipChanged(ShardlineError):
    """An elastic job's members changed (a node joined); ``elastic.run`` re-forms the group.

    ``State.commit`` raises it on every rank at the same step, once the commit is made. Seen
    outside ``shardline.elastic.run``, it means the training function does not run under it.
    """
