"""The fields every part of ``ShardedDataParallel`` shares, declared once with their types.

``ShardedDataParallel`` (``wrapper.py``: construction and the public API) is an ``nn.Module``
deriving from ``ZeroBase`` (these fields, shared state) and owning one object per role, each
reaching the fields through a weak reference (so the wrapper is freed as before):
``UnitLayout`` (``layout.py``: units from a plan, re-formed in execution order),
``GatherReduceSchedule`` (``schedule.py``: forward and backward hooks, all-gathers and
reductions; the hooks call it), ``HeldSteps`` (``held.py``: steps a caller drives, parameters
held whole over its micro-batches, through the schedule), ``StateDicts`` (``state_dicts.py``:
full and sharded state dicts, the strategy contract) and ``OptimizerBinding``
(``binding.py``: optimizers pointed at the shards, whole parameters for those that need
them). The wrapper delegates its public methods to them. The fields are set in
``ShardedDataParallel.__init__``.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.comm.work import Work
from shardline.parallel.data.zero.grouping import UnitPlan
from shardline.parallel.data.zero.units import Unit
from shardline.parallel.placement import Placement
from shardline.parallel.precision import MixedPrecision

if TYPE_CHECKING:
    from shardline.compression.codec import Compressor

__all__ = ["TrainingState", "Waitable", "ZeroBase"]


class Waitable(Protocol):
    """A reduction in flight: a ``Work``, or a compressed one (``schedule.Finishing``)."""

    def is_completed(self) -> bool:
        """Whether it is done (a compressed one says no until waited for)."""

    def wait(self) -> None:
        """Blocks until it is done."""


class TrainingState(enum.Enum):
    """Where the wrapper is in a training step (as FSDP2's ``TrainingState``)."""

    IDLE = "idle"  # between steps: after backward, or before the first forward
    FORWARD = "forward"  # inside the wrapper's forward
    BACKWARD = "backward"  # a backward that uses this forward's graph is running


class ZeroBase(nn.Module):
    """Declarations only (see the module docstring)."""

    # configuration
    module: nn.Module
    stage: int
    group: ProcessGroup
    prefetch: int
    mixed_precision: MixedPrecision
    offload: str | None  # "optimizer" or "cpu": shards and optimizer state in host memory
    _device: torch.device  # where compute runs (the group's GPU for a host-kept model)
    _host_model: bool  # offload with the model built in host memory: units laid out one by one
    _own_groups: bool  # the two below are communicators of their own (else ``group``)
    _gather_group: ProcessGroup  # all-gathers, in their own order
    _reduce_group: ProcessGroup  # gradient reductions, in their own order
    _symmetric_choice: bool | None  # the constructor's ``symmetric`` (see ``symmetric``)
    symmetric: bool  # flat buffers in symmetric memory (CPU, one host; ``units.Unit.rehome``)
    _symmetric_due: bool  # ... not moved there yet (``layout.UnitLayout.adopt_symmetric``)
    _replicate: ProcessGroup | None  # HSDP: the replicas this rank's shards are averaged over
    _replicating: list[tuple[Unit, Work, torch.Tensor, bool]]  # ... averages in flight
    _by_name: dict[str, nn.Parameter]  # the plain model's parameters
    _dtypes: dict[str, torch.dtype]  # their original dtypes
    _placements: dict[str, Placement]  # parameters that are slices of bigger tensors
    _module_names: dict[nn.Module, str]
    _handles: list[Any]  # hooks to remove with the wrapper
    _reorder: bool
    _optimizer: torch.optim.Optimizer | None  # the one bound by distribute(), if any
    _compression: Compressor | None  # reduces gradients compressed (shardline.optim)
    _synced_steps: int  # synchronised backwards so far (comm_stats)
    # the units (layout.py)
    _plan: UnitPlan
    _units: list[Unit]
    _unit_of: dict[int, Unit]  # id(parameter) -> its unit
    _slot: dict[int, int]  # id(parameter) -> its index in the unit
    _local_ids: set[int]  # ids of the local parameters optimizers step
    _module_units: dict[nn.Module, list[Unit]]  # the units each module's parameters are in
    _bw_order: list[Unit]  # backward's all-gather order
    _bw_pos: dict[int, int]  # unit index -> position in it
    _rs_order: list[Unit]  # backward's reduction order
    _order: list[str]  # module names in the order the units were planned for
    _whole: frozenset[str]  # parameters kept whole (for their optimizer: optimizers.py)
    _whole_reasons: dict[str, str]  # optimizer class -> why it needs whole parameters
    _checked_optimizers: weakref.WeakSet[torch.optim.Optimizer]  # layouts applied for them
    _trace: list[str] | None  # module names in the order the first forward ran
    _traced: bool
    # one step (schedule.py)
    _state: TrainingState
    _require_sync: bool  # False inside no_sync()
    _sync_backward: bool  # whether this forward's backward reduces
    _needs_gather: bool  # stages 1/2: an optimizer stepped the shards
    _fwd_next: int  # next unit forward all-gathers (stage 3)
    _bw_next: int  # next position in _bw_order backward all-gathers
    _rs_next: int  # next position in _rs_order backward reduces
    _inflight: list[tuple[Unit, Waitable, torch.Tensor, bool]]  # reductions not yet finished
    _bw_gathered: set[int]  # units gathered for this backward (stage 3), by index
    _unit_stack: list[list[Unit]]  # units of the modules running now
    _drop: list[Unit]  # gathered in backward only to keep ranks in step
    _releasable: list[Unit]  # done in backward, freed at the next event
    _graph_done: bool  # the last forward's graph was fully used by a backward
    # a step the caller drives (held.py)
    _held: bool  # units kept whole by unshard(); the module hooks stand aside
    _accumulating: bool  # ... and gradients add up whole until reduce_grads()
