"""The distributed activation store: ``ActivationCheckpointManager``.

It keeps activations by layer id under a placement policy (``policies``), fetches them from
their owners, and reports memory (``statistics``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardline import dtypes
from shardline.comm.group import ProcessGroup
from shardline.comm.objects import all_gather_object, broadcast_object
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError
from shardline.parallel.recompute.policies import (
    POLICIES,
    REPLICATED,
    LayerId,
    Policy,
    decode_holdings,
    decode_id,
    dtype_from_name,
    encode_id,
    holds_part,
    holds_whole,
    id_order,
    numel_of,
    owner_table,
    part_bounds,
    part_size,
)
from shardline.parallel.recompute.statistics import ActivationMemoryStats

__all__ = ["ACTIVE", "ActivationCheckpointManager"]

# The manager whose activate() block is running (checkpoint() records into it).
ACTIVE: contextvars.ContextVar[ActivationCheckpointManager | None] = contextvars.ContextVar(
    "shardline_activation_manager", default=None
)


@dataclass
class _Entry:
    """One layer's activation on this rank: the whole tensor, a part, or only its metadata."""

    policy: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    data: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    @property
    def whole(self) -> bool:
        return self.data is not None and self.policy != "partition"


class ActivationCheckpointManager:
    """Activations kept by layer id on the ranks of a group, under a placement policy.

    Policies (per manager, or per ``register`` call):

    - ``"local"``: the registering rank keeps the tensor; other ranks get it with ``fetch``.
    - ``"first_rank"``: for activations every rank computes alike (replicated): rank 0 of the
      group keeps the tensor, the others keep only its shape and dtype. ``get`` is collective
      and broadcasts it from rank 0.
    - ``"partition"``: also for replicated activations: every rank registers the same tensor
      and keeps 1/world_size of its flattened elements (the first ``numel % world_size`` ranks
      one more). ``get`` is collective and all-gathers the parts.

    ``register_and_broadcast`` gives every rank a full copy. Stored tensors are detached and
    share memory with the registered tensor (a partition part is a copy of its slice).

    Args:
        group: The ranks that share the store; ``None`` for the group of ``shardline.init()``.
        policy: Default placement for ``register``.

    Raises:
        InvalidArgumentError: ``policy`` is not one of ``POLICIES``.
    """

    def __init__(self, group: ProcessGroup | None = None, policy: Policy = "local") -> None:
        if group is None:
            group = default_group()
        self.group = group
        self.policy: str = self._check_policy(policy)
        self._entries: dict[LayerId, _Entry] = {}
        self._owners: dict[LayerId, tuple[int, ...]] = {}  # from the last sync_keys / fetch
        self._bytes = 0
        self._peak = 0
        self._recomputed = 0

    def __repr__(self) -> str:
        return (
            f"ActivationCheckpointManager(rank={self.rank}, world_size={self.world_size}, "
            f"policy={self.policy!r}, entries={len(self._entries)}, bytes={self._bytes})"
        )

    @property
    def rank(self) -> int:
        """This rank within the group."""
        return self.group.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self.group.world_size

    @property
    def stored_bytes(self) -> int:
        """Bytes of activations this rank holds now."""
        return self._bytes

    @property
    def peak_bytes(self) -> int:
        """The most bytes this rank has held at once."""
        return self._peak

    @property
    def recomputed_bytes(self) -> int:
        """Bytes ``checkpoint`` did not keep on this rank while this manager was active."""
        return self._recomputed

    def __contains__(self, layer_id: object) -> bool:
        return layer_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[LayerId]:
        """Layer ids this rank knows: held whole, as a part, or as metadata only."""
        return list(self._entries)

    def holds(self, layer_id: LayerId) -> bool:
        """Whether this rank holds the whole tensor of ``layer_id`` (``get`` is then local)."""
        entry = self._entries.get(layer_id)
        return entry is not None and entry.whole

    @contextlib.contextmanager
    def activate(self) -> Iterator[ActivationCheckpointManager]:
        """Within this block, ``checkpoint`` adds the bytes it does not keep to this manager.

        Per thread (a ``contextvars`` variable), so ranks running as threads stay apart.
        """
        token = ACTIVE.set(self)
        try:
            yield self
        finally:
            ACTIVE.reset(token)

    # -- storing -----------------------------------------------------------------------------

    def register(
        self, layer_id: LayerId, tensor: torch.Tensor, *, policy: Policy | None = None
    ) -> None:
        """Keeps ``tensor`` under ``layer_id`` on this rank, placed by ``policy``. Local.

        Args:
            layer_id: A str or int not registered yet on this rank.
            tensor: The activation; it is stored detached (no autograd history).
            policy: Overrides the manager's policy for this entry. With ``"first_rank"`` and
                ``"partition"`` every rank registers the same tensor.

        Raises:
            InvalidArgumentError: a bad or already registered id, a bad policy, or not a tensor.
        """
        what = "register"
        self._check_id(layer_id, what)
        chosen = self._check_policy(policy if policy is not None else self.policy)
        self._check_new(layer_id, what)
        t = self._check_tensor(tensor, layer_id, what).detach()
        shape = tuple(t.shape)
        data: torch.Tensor | None = t
        if chosen == "first_rank" and self.rank != 0:
            data = None
        elif chosen == "partition":
            start, stop = part_bounds(t.numel(), self.world_size, self.rank)
            data = t.reshape(-1)[start:stop].clone()  # a copy: the full tensor may be freed
        self._store(layer_id, _Entry(chosen, shape, t.dtype, data))

    def register_and_broadcast(
        self, layer_id: LayerId, tensor: torch.Tensor | None, src: int = 0
    ) -> torch.Tensor:
        """Keeps rank ``src``'s ``tensor`` under ``layer_id`` on every rank. Collective.

        Args:
            layer_id: A str or int, the same on every rank, not registered yet.
            tensor: The activation on ``src``; ignored elsewhere (may be ``None``).
            src: The rank of the group that has the tensor.

        Returns:
            This rank's copy.

        Raises:
            InvalidArgumentError: a bad id or ``src`` (before communicating), ``src`` passed no
                tensor (on every rank), or the id is already registered here (after the
                broadcast, so the other ranks finish).
        """
        what = "register_and_broadcast"
        self._check_id(layer_id, what)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise InvalidArgumentError(
                f"{what}({layer_id!r}) on rank {self.rank}: src={src!r} is not a rank of this "
                f"group (world_size {self.world_size})"
            )
        meta: dict[str, Any] = {}
        data: torch.Tensor | None = None
        if self.rank == src:
            if isinstance(tensor, torch.Tensor):
                data = tensor.detach().contiguous()
                meta = {"shape": list(data.shape), "dtype": dtypes.name_of(data.dtype)}
            else:
                meta = {"error": f"src rank {src} passed {type(tensor).__name__}, not a tensor"}
        meta = self._broadcast_object(meta, src)
        if "error" in meta:
            raise InvalidArgumentError(f"{what}({layer_id!r}) on rank {self.rank}: {meta['error']}")
        shape, dtype = tuple(int(n) for n in meta["shape"]), dtype_from_name(meta["dtype"])
        if data is None:
            data = torch.empty(shape, dtype=dtype, device=self.group.device)
        if data.numel():
            self.group.broadcast(_as_bytes(data), src)
        self._check_new(layer_id, what)
        self._store(layer_id, _Entry(REPLICATED, shape, dtype, data))
        return data

    def keep_boundary(self, stage_id: int, tensor: torch.Tensor, micro_batch: int = 0) -> None:
        """Keeps a pipeline stage's boundary activation on this rank (policy ``"local"``).

        The key is ``boundary_id(stage_id, micro_batch)``; read it back with ``boundary``.
        """
        self.register(self.boundary_id(stage_id, micro_batch), tensor, policy="local")

    def boundary(self, stage_id: int, micro_batch: int = 0) -> torch.Tensor:
        """The boundary activation ``keep_boundary`` kept for this stage and micro-batch."""
        return self.get(self.boundary_id(stage_id, micro_batch))

    def boundary_id(self, stage_id: int, micro_batch: int = 0) -> str:
        """The layer id of a pipeline stage's boundary activation."""
        for name, v in (("stage_id", stage_id), ("micro_batch", micro_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(
                    f"keep_boundary on rank {self.rank}: {name}={v!r} must be an int >= 0"
                )
        return f"{self._stage_prefix(stage_id)}mb{micro_batch}.boundary"

    def stage_checkpoints(self, stage_id: int) -> list[LayerId]:
        """Ids this rank knows for pipeline stage ``stage_id``, in id order.

        Its boundary activations (``keep_boundary``) and anything registered under an id
        that starts ``stage<stage_id>.``. Local.
        """
        prefix = self._stage_prefix(stage_id)
        ids = [k for k in self._entries if isinstance(k, str) and k.startswith(prefix)]
        return sorted(ids, key=id_order)

    def next_stage_boundaries(self, stage_id: int) -> list[LayerId]:
        """Ids of the boundary activations of stage ``stage_id + 1`` this rank knows.

        Those are the inputs the next stage keeps, i.e. what stage ``stage_id`` produced;
        after ``sync_keys`` (or a ``fetch``) other ranks' count too, and ``fetch`` brings
        them here (collective). Local.
        """
        ids = [k for k in self.stage_checkpoints(stage_id + 1) if ".boundary" in str(k)]
        known = {k for k in self._owners if isinstance(k, str) and ".boundary" in k}
        prefix = self._stage_prefix(stage_id + 1)
        ids += [k for k in known if k.startswith(prefix) and k not in self._entries]
        return sorted(ids, key=id_order)

    def clear_stage(self, stage_id: int) -> int:
        """Drops this rank's entries of pipeline stage ``stage_id``; returns how many. Local."""
        ids = self.stage_checkpoints(stage_id)
        for k in ids:
            self.remove(k)
        return len(ids)

    def _stage_prefix(self, stage_id: int) -> str:
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or stage_id < 0:
            raise InvalidArgumentError(
                f"activation manager on rank {self.rank}: stage_id={stage_id!r} must be an int >= 0"
            )
        return f"stage{stage_id}."

    # -- reading -----------------------------------------------------------------------------

    def get(self, layer_id: LayerId) -> torch.Tensor:
        """The activation registered under ``layer_id``.

        Local for entries this rank holds whole (``"local"`` on the registering rank, and
        ``register_and_broadcast``). Collective for ``"first_rank"`` entries (broadcast from
        rank 0) and ``"partition"`` entries (all-gather of the parts): every rank calls
        ``get(layer_id)`` at the same point. The result of a collective ``get`` is not kept.

        Raises:
            InvalidArgumentError: the id is invalid or unknown here, or only other ranks hold
                it (use ``fetch``, which is collective).
        """
        what = "get"
        self._check_id(layer_id, what)
        entry = self._entries.get(layer_id)
        if entry is None:
            raise self._unknown(layer_id, what)
        if entry.policy == "partition":
            return self._gather_partition(entry)
        if entry.policy == "first_rank":
            out = entry.data if entry.data is not None else self._empty_like(entry)
            if out.numel():
                self.group.broadcast(_as_bytes(out), 0)
            return out
        assert entry.data is not None  # local and replicated entries always hold data
        return entry.data

    def fetch(self, layer_ids: Iterable[LayerId]) -> dict[LayerId, torch.Tensor]:
        """Gets activations wherever they are held. Collective; each rank asks for its own.

        Every rank calls ``fetch`` with the ids it needs (possibly none). The ranks first
        all-gather their requests and what they hold; then each missing whole tensor travels
        from an owner by ``send``/``recv``, in one order every rank derives from the gathered
        requests (sorted by id, then destination), so the earliest unfinished transfer always
        has both ends waiting on it and none can deadlock. Partitioned entries anyone asked
        for are all-gathered. Also refreshes what ``sync_keys`` returns.

        Args:
            layer_ids: Ids this rank needs; duplicates are fetched once.

        Returns:
            ``{layer_id: tensor}`` for this rank's ids, in the order asked.

        Raises:
            InvalidArgumentError: on every rank, if any rank asked for an invalid id or one no
                rank holds; the message names the rank and the id.
        """
        what = "fetch"
        wanted = list(dict.fromkeys(layer_ids))
        error = None
        for k in wanted:
            try:
                self._check_id(k, what)
            except InvalidArgumentError as e:
                error = str(e)
        everyone = self._all_gather_object(
            {
                "need": [] if error else [encode_id(k) for k in wanted],
                "have": self._holdings(),
                "error": error,
            }
        )
        errors = [p["error"] for p in everyone if p["error"]]
        if errors:
            raise InvalidArgumentError("; ".join(errors))
        held = [decode_holdings(p["have"]) for p in everyone]
        self._owners = owner_table(held)

        transfers: list[tuple[LayerId, int, int]] = []  # (id, dst, src)
        gathers: set[LayerId] = set()
        problems: list[str] = []
        for dst, p in enumerate(everyone):
            for k in map(decode_id, p["need"]):
                if holds_whole(held[dst], k):
                    continue
                whole = [r for r in range(self.world_size) if holds_whole(held[r], k)]
                parts = [r for r in range(self.world_size) if holds_part(held[r], k)]
                if whole:
                    transfers.append((k, dst, whole[dst % len(whole)]))
                elif len(parts) == self.world_size:
                    gathers.add(k)
                elif parts:
                    problems.append(
                        f"rank {dst} asked for {k!r}, partitioned but only ranks {parts} of "
                        f"{self.world_size} hold parts; register it on every rank"
                    )
                else:
                    problems.append(f"rank {dst} asked for {k!r}, which no rank holds")
        if problems:
            raise InvalidArgumentError(f"{what} on rank {self.rank}: " + "; ".join(problems))

        mine = set(wanted)
        got: dict[LayerId, torch.Tensor] = {}
        for k in sorted(gathers, key=id_order):
            full = self._gather_partition(self._entries[k])
            if k in mine:
                got[k] = full
        for k, dst, src in sorted(transfers, key=lambda t: (id_order(t[0]), t[1])):
            if self.rank == src:
                data = self._entries[k].data
                assert data is not None
                if data.numel():
                    self.group.send(_as_bytes(data.contiguous()), dst)
            elif self.rank == dst:
                policy, shape, dtype, _ = held[src][k]
                buf = self._empty_like(_Entry(policy, shape, dtype, None))
                if buf.numel():
                    self.group.recv(_as_bytes(buf), src)
                got[k] = buf
        for k in wanted:
            if k not in got:
                data = self._entries[k].data
                assert data is not None
                got[k] = data
        return {k: got[k] for k in wanted}

    def sync_keys(self) -> dict[LayerId, tuple[int, ...]]:
        """Every id known on any rank, with the ranks that hold its data. Collective.

        A ``"partition"`` entry lists every rank holding a part; a ``"first_rank"`` entry
        lists rank 0 (the others know only its shape). Ids are sorted (ints, then strs).
        """
        held = [decode_holdings(p) for p in self._all_gather_object(self._holdings())]
        self._owners = owner_table(held)
        return dict(self._owners)

    # -- dropping ----------------------------------------------------------------------------

    def remove(self, layer_id: LayerId) -> None:
        """Drops ``layer_id`` on this rank. Local: for shared entries every rank calls it.

        Raises:
            InvalidArgumentError: the id is invalid or not registered here.
        """
        self._check_id(layer_id, "remove")
        entry = self._entries.pop(layer_id, None)
        if entry is None:
            raise self._unknown(layer_id, "remove")
        self._bytes -= entry.nbytes
        self._owners.pop(layer_id, None)

    def clear(self) -> None:
        """Drops every activation on every rank. Collective (ends with a barrier).

        Peak and recomputed byte counts are history and stay.
        """
        self._entries.clear()
        self._owners.clear()
        self._bytes = 0
        self.group.barrier()

    # -- statistics --------------------------------------------------------------------------

    def memory_stats(self) -> ActivationMemoryStats:
        """Bytes and tensor counts of every rank, gathered on every rank. Collective."""
        count = sum(1 for e in self._entries.values() if e.data is not None)
        local = torch.tensor([self._bytes, self._peak, count, self._recomputed], dtype=torch.int64)
        if self.group.device.type != "cpu":
            local = local.to(self.group.device)
        out = torch.empty(4 * self.world_size, dtype=torch.int64, device=local.device)
        self.group.all_gather(out, local)
        rows = out.cpu().view(self.world_size, 4).tolist()
        return ActivationMemoryStats(*(tuple(int(r[i]) for r in rows) for i in range(4)))

    # -- internals ---------------------------------------------------------------------------

    def _note_recomputed(self, nbytes: int) -> None:
        self._recomputed += nbytes

    def _store(self, layer_id: LayerId, entry: _Entry) -> None:
        self._entries[layer_id] = entry
        self._bytes += entry.nbytes
        self._peak = max(self._peak, self._bytes)

    def _check_policy(self, policy: object) -> str:
        if policy not in POLICIES:
            raise InvalidArgumentError(
                f"activation policy {policy!r} on rank {self.group.rank} is unknown; "
                f"use one of {list(POLICIES)}"
            )
        return policy

    def _check_id(self, layer_id: object, what: str) -> None:
        ok = (isinstance(layer_id, int) and not isinstance(layer_id, bool)) or (
            isinstance(layer_id, str) and layer_id != ""
        )
        if not ok:
            raise InvalidArgumentError(
                f"{what} on rank {self.rank}: layer id {layer_id!r} is invalid; "
                "use an int or a non-empty str"
            )

    def _check_new(self, layer_id: LayerId, what: str) -> None:
        if layer_id in self._entries:
            raise InvalidArgumentError(
                f"{what} on rank {self.rank}: layer id {layer_id!r} is already registered; "
                "remove() it first"
            )

    def _check_tensor(self, tensor: object, layer_id: LayerId, what: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"{what}({layer_id!r}) on rank {self.rank}: expected a torch.Tensor, "
                f"got {type(tensor).__name__}"
            )
        return tensor

    def _unknown(self, layer_id: LayerId, what: str) -> InvalidArgumentError:
        owners = self._owners.get(layer_id)
        if owners:
            return InvalidArgumentError(
                f"{what} on rank {self.rank}: layer id {layer_id!r} is held by rank(s) "
                f"{list(owners)}, not this one; call fetch([{layer_id!r}]) on every rank of "
                "the group (collective)"
            )
        known = sorted(self._entries, key=id_order)
        shown = ", ".join(repr(k) for k in known[:8]) + (", ..." if len(known) > 8 else "")
        return InvalidArgumentError(
            f"{what} on rank {self.rank}: no activation registered under layer id "
            f"{layer_id!r} (known here: [{shown}]); sync_keys() lists every rank's ids"
        )

    def _empty_like(self, entry: _Entry) -> torch.Tensor:
        return torch.empty(entry.shape, dtype=entry.dtype, device=self.group.device)

    def _gather_partition(self, entry: _Entry) -> torch.Tensor:
        assert entry.data is not None
        numel = numel_of(entry.shape)
        out = self._empty_like(entry)
        if numel == 0:
            return out
        size = entry.data.element_size()
        counts = [part_size(numel, self.world_size, r) * size for r in range(self.world_size)]
        flat = _as_bytes(out)
        parts = list(torch.split(flat, counts))
        self.group.all_gather(parts, _as_bytes(entry.data))
        return out

    def _holdings(self) -> list[list[Any]]:
        return [
            [encode_id(k), e.policy, list(e.shape), dtypes.name_of(e.dtype), e.data is not None]
            for k, e in self._entries.items()
        ]

    def _all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``shardline.comm.objects``)."""
        return all_gather_object(obj, self.group)

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank (``shardline.comm.objects``)."""
        return broadcast_object(obj, src, self.group)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype travels as bytes)."""
    return t.reshape(-1).view(torch.uint8)
