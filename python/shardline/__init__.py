"""shardline: train PyTorch models across processes on a Rust collective engine.

Table of contents:

- ``init``, ``shutdown``, ``is_initialized``, ``get_rank``, ``get_world_size``: the job.
- ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``reduce``, ``gather``,
  ``scatter``, ``all_to_all``, ``barrier``, ``send``, ``recv``: collectives on the default
  group (or ``group=``); ``async_op=True`` returns a ``Work``. ``all_gather_object`` and
  ``broadcast_object``: any picklable object.
- ``new_group``, ``ProcessGroup``, ``DeviceMesh``: sub-groups and named axes.
- ``symmetric_empty``: a CPU tensor every rank of the host maps, whose all-reduce copies
  nothing through the engine's slots.
- ``distribute``, ``DistributedDataParallel``, ``ShardedDataParallel`` (ZeRO 1/2/3, FSDP),
  ``MixedPrecision``, ``make_deterministic``: parallel strategies (``shardline.parallel``);
  ``as_distributed`` picks the fastest that fits, ``estimate_memory`` plans it before anything is
  allocated, ``plan_strategy`` prices every strategy (``explain()``);
  ``register_optimizer``: how ZeRO shards an optimizer class it does not know.
- ``compression``: gradient compression with error feedback (``compression.PowerSGD``,
  ``compression.Int8``, ``compression.TopK``, ...), passed as ``distribute(..., compression=)``;
  ``optim``: CPU optimizers stepped in Rust, 1-bit Adam.
- ``trace``: a job's timeline (``SHARDLINE_TRACE``), read by ``shardline doctor`` (a hang's
  culprit, a straggler, a mismatch) and ``shardline trace merge`` (a Perfetto trace).
- ``checkpoint``: distributed checkpoints (``save``, ``load``, ``latest``, ...);
  ``parallel.recompute``: activation recomputation and the activation store across ranks.
- ``DistributedSampler``: each rank's share of a dataset, resumable mid-epoch (``shardline.data``).
- ``shardline run`` (``shardline.launch``): the launcher; ``python -m shardline run ...``.
- ``ShardlineError`` and its subclasses (``shardline.errors``).

Importing shardline moves every object that exists by then (torch's modules with it) out of
the cycle collector's reach (``gc.freeze``): full collections and the process's exit no
longer walk them. Objects created later are collected as usual.
"""

from __future__ import annotations

import gc as _gc

from shardline import checkpoint, compression, elastic, optim
from shardline._version import __version__
from shardline.comm import ProcessGroup, Work, init_process_group, trace
from shardline.comm import torch_backend as _torch_backend  # noqa: F401  # registers "shardline"
from shardline.comm.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    get_rank,
    get_world_size,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from shardline.comm.mesh import DeviceMesh
from shardline.comm.objects import all_gather_object, broadcast_object
from shardline.comm.symmetric import symmetric_empty
from shardline.comm.world import init, is_initialized, shutdown
from shardline.data import DistributedSampler
from shardline.errors import (
    AuthenticationError,
    CheckpointError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    MembershipChanged,
    MonitoredBarrierError,
    PeerLostError,
    ProtocolError,
    ShardlineError,
    TransportError,
)
from shardline.parallel import (
    DistributedDataParallel,
    MemoryEstimate,
    MixedPrecision,
    ShardedDataParallel,
    as_distributed,
    clip_grad_norm_,
    distribute,
    estimate_memory,
    make_deterministic,
    pipeline,
    plan_strategy,
    rank_microbatches,
    register_optimizer,
    tensor_parallel,
)

__all__ = [
    "AuthenticationError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorClosedError",
    "DeviceMesh",
    "DistributedDataParallel",
    "DistributedSampler",
    "InvalidArgumentError",
    "MembershipChanged",
    "MemoryEstimate",
    "MixedPrecision",
    "MonitoredBarrierError",
    "PeerLostError",
    "ProcessGroup",
    "ProtocolError",
    "ShardedDataParallel",
    "ShardlineError",
    "TransportError",
    "Work",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "as_distributed",
    "barrier",
    "broadcast",
    "broadcast_object",
    "checkpoint",
    "clip_grad_norm_",
    "compression",
    "distribute",
    "elastic",
    "estimate_memory",
    "gather",
    "get_rank",
    "get_world_size",
    "init",
    "init_process_group",
    "is_initialized",
    "make_deterministic",
    "new_group",
    "optim",
    "pipeline",
    "plan_strategy",
    "rank_microbatches",
    "recv",
    "reduce",
    "reduce_scatter",
    "register_optimizer",
    "scatter",
    "send",
    "shutdown",
    "symmetric_empty",
    "tensor_parallel",
    "trace",
]

# What this import brought in (torch with it: some 200,000 objects, nearly all functions,
# classes and constants that live as long as the process) leaves the cycle collector's reach.
# Each full collection walked them all (0.1 s on 2 cores: a stall that every other rank of a
# synchronous step waits out), and so did the interpreter's last collections at exit, 0.6-0.9
# s of every worker's and launcher's exit (`python -c "import shardline"`, 4 runs each way,
# alternated: 2.3-2.6 s of CPU with this, 3.1-3.4 s without). Objects created later (the
# model, the optimizer) are collected as usual; an object from before this import that later
# becomes cyclic garbage is never freed. (Freezing at exit instead leaves unfreed the objects
# of libraries imported later, and triton's, through nanobind, then report themselves as
# leaked.)
_gc.freeze()
