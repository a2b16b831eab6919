"""Who is in the job now: generations of members, published through the job's store.

[Note: generations] An elastic job (``shardline run --nnodes MIN:MAX``) runs as a sequence of
*generations*. Each is a list of members in rank order, published once under
``shardline/elastic/g/<n>`` and never changed; ``shardline/elastic/gen`` holds the newest
number. A member is a *slot* (``"<node>.<local rank>"``: a place a node's launcher runs a
worker in) and the *incarnation* of the process in it (0 for the first, +1 for each
replacement), so a replacement never takes the place of the process it replaces in a
generation made before it existed.

Every node's launcher (``shardline.launch.agent``) registers its node, beats (``beat/<node>``, a
counter) and says what each of its slots holds (``slot/<slot>``: ``up:<incarnation>``,
``done:<incarnation>`` or ``gone``). The launcher hosting the store also runs the
``Coordinator``: it watches those keys and publishes the next generation once the members it
sees have been the same for ``SETTLE_S``: the running slots of live nodes (a node whose beat
stopped for ``NODE_TIMEOUT_S`` is gone), ordered by (node, local rank), at most ``max_nodes``
nodes; the others wait as spares (the first generation also waits ``FIRST_WAIT_S`` after the
last node came, unless all came). A worker that finished leaves the members, but once one
returned from its training function (``finished``) nothing more is published, and a process
still waiting to join exits. Fewer than ``min_nodes`` live nodes for ``SHARDLINE_TIMEOUT``: the
job fails (``failed`` names why), and every worker waiting for a generation raises. A
generation replaced before its group formed gets a failure record under its own keys, so that
its ranks stop waiting for members that moved on. ``trained`` is set by the first commit: a
process that joins after it restores the state with the others (``shardline.elastic.job``).

Workers read: ``join`` (the first generation that lists this process, in ``shardline.init``),
``pending`` (has a newer generation been published: checked at ``State.commit``) and
``next_after`` (the generation after a loss, in ``world.reform``). Nothing secret goes through
the store: each worker brings the job secret in its environment.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardline import config
from shardline.comm.rendezvous.store import StoreClient, publish_failure
from shardline.errors import CollectiveTimeoutError, PeerLostError, ShardlineError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "BEAT_S",
    "NODE_TIMEOUT_S",
    "PREFIX",
    "SETTLE_S",
    "Coordinator",
    "Generation",
    "JobFinished",
    "generation_store",
    "join",
    "mark",
    "marked",
    "next_after",
    "pending",
    "wait_standby",
]

PREFIX = "shardline/elastic"
BEAT_S = 0.2
"""Seconds between two beats of a node's launcher."""
NODE_TIMEOUT_S = 2.0
"""A node whose launcher has not beaten for this long is gone (its slots leave the job)."""
SETTLE_S = 0.3
"""The members must be unchanged this long before a generation is published."""
FIRST_WAIT_S = 3.0
"""Before the first generation: how long after the last node came to wait for more."""
_POLL_S = 0.02
_log = logging.getLogger("shardline")


def key(*parts: object) -> str:
    """A membership key: ``shardline/elastic/<parts joined by />``."""
    return "/".join([PREFIX, *map(str, parts)])


@dataclass(frozen=True)
class Generation:
    """One generation of the job: its number and its members in rank order.

    Attributes:
        number: 1 for the first, +1 for each change.
        members: ``(slot, incarnation)`` of each rank, in rank order.
        previous_size: The world size of the generation before (0 for the first).
    """

    number: int
    members: tuple[tuple[str, int], ...]
    previous_size: int

    @property
    def world_size(self) -> int:
        """Ranks in this generation."""
        return len(self.members)

    def rank_of(self, slot: str, incarnation: int) -> int | None:
        """The rank of ``slot``'s process ``incarnation`` here; ``None`` if not a member."""
        try:
            return self.members.index((slot, incarnation))
        except ValueError:
            return None

    def to_json(self) -> str:
        """The generation as published in the store (its number is in the key)."""
        return json.dumps({"members": [list(m) for m in self.members],
                           "previous_size": self.previous_size})  # fmt: skip

    @staticmethod
    def from_json(number: int, text: bytes | str) -> Generation:
        """Generation ``number`` from what ``to_json`` published."""
        data = json.loads(text)
        members = tuple((str(s), int(i)) for s, i in data["members"])
        return Generation(number, members, int(data["previous_size"]))


def generation_store(store: Store, number: int) -> Store:
    """The keys of generation ``number``'s groups: ``/elastic/g<number>/...``."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.PrefixStore(f"/elastic/g{number}", store)  # type: ignore[attr-defined]


def _newest(client: StoreClient, step: str) -> int:
    return client.add(key("gen"), 0, step)


def _read(client: StoreClient, number: int, step: str) -> Generation:
    return Generation.from_json(number, client.get(key("g", number), step))


def _raise_if_failed(client: StoreClient, step: str) -> None:
    if client.check([key("failed")], step):
        why = client.get(key("failed"), step).decode()
        raise ShardlineError(f"the elastic job stopped: {why}")


class JobFinished(ShardlineError):
    """The elastic job finished while this process waited to join it: nothing left to do."""


def _wait_for(
    client: StoreClient, after: int, slot: str, incarnation: int, timeout: float, step: str
) -> Generation:
    """The newest generation numbered above ``after`` that lists this process (polls).

    A spare (the newest generation already runs on ``--nnodes`` MAX nodes) waits without a
    deadline, until a generation needs it or the job finishes (``JobFinished``).
    """
    deadline = time.monotonic() + timeout
    spare_said = False
    while True:
        newest = _newest(client, step)
        gen = None
        if newest > after:
            gen = _read(client, newest, step)
            if gen.rank_of(slot, incarnation) is not None:
                return gen
        if client.check([key("finished")], step):
            raise JobFinished(f"slot {slot}: the elastic job finished; this process has no work")
        _raise_if_failed(client, step)
        if gen is not None and _is_full(gen):
            # A replacement, whose node is in the generation, waits for the next one: no spare.
            if not spare_said and slot.split(".", maxsplit=1)[0] not in _nodes_of(gen):
                _log.warning("elastic: slot %s waits as a spare: the job runs on --nnodes MAX "
                             "nodes already", slot)  # fmt: skip
                spare_said = True
            deadline = time.monotonic() + timeout
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"slot {slot} (process {incarnation}) {step}: no generation after #{after} "
                f"lists it within {timeout:.0f} s (newest: #{newest}); are enough nodes up "
                "(--nnodes MIN:MAX)? SHARDLINE_TIMEOUT sets the wait"
            )
        time.sleep(_POLL_S)


def _nodes_of(gen: Generation) -> set[str]:
    """The nodes ``gen``'s members run on."""
    return {s.split(".")[0] for s, _ in gen.members}


def _is_full(gen: Generation) -> bool:
    """Whether ``gen`` runs on as many nodes as ``--nnodes`` MAX (from the launcher's env)."""
    spec = config.raw("SHARDLINE_ELASTIC_NODES") or ""
    most = int(spec.split(":")[1]) if ":" in spec else 0
    return most > 0 and len(_nodes_of(gen)) >= most


def mark(store: Store, what: str) -> None:
    """Sets the job-wide flag ``what`` (``"trained"``: a commit was made; ``"finished"``)."""
    StoreClient(store, rank=-1, task="the elastic job").set(key(what), "1", f"marking {what}")


def marked(store: Store, what: str) -> bool:
    """Whether the job-wide flag ``what`` is set (see ``mark``)."""
    client = StoreClient(store, rank=-1, task="the elastic job")
    return client.check([key(what)], f"reading {what}")


def wait_standby(store: Store, name: str) -> tuple[str, str]:
    """A standby's wait for a slot: ``(slot, incarnation)`` once its launcher hands one over.

    No deadline (a standby may wait the whole job); ``JobFinished`` when the job ends first.
    """
    client = StoreClient(store, rank=-1, task=f"standing by as {name}")
    while not client.check([key("standby", name)], "waiting for a slot"):
        if client.check([key("finished")], "reading whether the job finished"):
            raise JobFinished(f"standby {name}: the elastic job finished without needing it")
        time.sleep(_POLL_S)
    slot, incarnation = client.get(key("standby", name), "reading its slot").decode().split(":")
    return slot, incarnation


def join(store: Store, slot: str, incarnation: int, timeout: float) -> Generation:
    """The generation a starting worker joins: the first one that lists it (waits)."""
    client = StoreClient(store, rank=-1, task=f"joining the elastic job as slot {slot}")
    return _wait_for(client, 0, slot, incarnation, timeout, "waiting for a generation")


def next_after(
    store: Store, current: int, slot: str, incarnation: int, timeout: float
) -> Generation:
    """The generation after ``current`` that lists this process (waits for it)."""
    client = StoreClient(store, rank=-1, task=f"re-forming the elastic job after #{current}")
    return _wait_for(client, current, slot, incarnation, timeout, "waiting for the next generation")


def pending(store: Store, current: int) -> bool:
    """Whether a generation after ``current`` was published (one store round trip)."""
    client = StoreClient(store, rank=-1, task="looking for a membership change")
    return _newest(client, "reading the newest generation") > current


class Coordinator:
    """Publishes generations from what the nodes' launchers report (see [Note: generations]).

    ``poll()`` is called every few tens of milliseconds by the launcher that hosts the store;
    it reads every node's beat and slots and publishes a generation when the members changed
    and have settled.

    Args:
        store: The job's store (hosted by the caller).
        min_nodes: Fewest nodes the job runs on.
        max_nodes: Most nodes the job runs on (later nodes wait as spares).
        timeout: Seconds the job may stay below ``min_nodes`` before it fails.
    """

    def __init__(self, store: Store, min_nodes: int, max_nodes: int, timeout: float) -> None:
        self.client = StoreClient(store, rank=-1, task="coordinating the elastic job")
        self.min_nodes, self.max_nodes, self.timeout = min_nodes, max_nodes, timeout
        self.published: Generation | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last count, when it changed)
        self._seen: tuple[tuple[str, int], ...] | None = None
        self._seen_since = time.monotonic()
        self._short_since: float | None = None
        self.finished = False  # every slot done, or gone
        self._nproc: dict[int, int] = {}
        self._joined_at = time.monotonic()  # when the last node registered

    def _nodes(self) -> dict[int, int]:
        """Every registered node and its number of slots."""
        count = self.client.add(key("nodes"), 0, "counting nodes")
        out = {}
        for node in range(count):
            if node not in self._nproc:
                if not self.client.check([key("node", node)], "looking for a node"):
                    continue  # registering now (its slots are set first, then this key)
                raw = self.client.get(key("node", node), "reading a node")
                self._nproc[node] = int(json.loads(raw)["nproc"])
                self._joined_at = time.monotonic()
            out[node] = self._nproc[node]
        return out

    def _alive(self, node: int, now: float) -> bool:
        beat = self.client.add(key("beat", node), 0, "reading a node's beat")
        last = self._beats.get(node)
        if last is None or last[0] != beat:
            self._beats[node] = (beat, now)
            return True
        return now - last[1] < NODE_TIMEOUT_S

    def members(self, now: float) -> tuple[tuple[tuple[str, int], ...], bool]:
        """The members the nodes report now, and whether every slot is done or gone."""
        members: list[tuple[str, int]] = []
        nodes_in = 0
        all_over = True
        for node, nproc in self._nodes().items():
            alive = self._alive(node, now)
            slots = [f"{node}.{local}" for local in range(nproc)]
            states = [self.client.get(key("slot", s), "reading a slot").decode() for s in slots]
            up = [(s, int(v[3:])) for s, v in zip(slots, states, strict=True)
                  if v.startswith("up:")]  # fmt: skip
            if alive and up:
                all_over = False  # spares too: they leave once the job is finished
                if nodes_in < self.max_nodes:
                    members += up
                    nodes_in += 1
        return tuple(members), all_over

    def poll(self) -> Generation | None:
        """Looks at the nodes once; publishes and returns a new generation when one is due."""
        now = time.monotonic()
        members, all_over = self.members(now)
        if members != self._seen:
            self._seen, self._seen_since = members, now
        # Over once every slot is done or gone: after a generation, or before any if the
        # workers all ended first (a typo in the module's name, ``--help``); a node counts
        # from its registration, which comes after its slots are up.
        self.finished = all_over and (self.published is not None or bool(self._nproc))
        current = self.published.members if self.published is not None else ()
        if self.finished or members == current or now - self._seen_since < SETTLE_S:
            return None
        if self.client.check([key("finished")], "reading whether the job finished"):
            return None  # workers that end leave the members: no generation for that
        nodes = len({slot.split(".")[0] for slot, _ in members})
        # The first generation waits FIRST_WAIT_S after the last node came for more to come
        # (up to MAX), as torchrun's last call does: launchers start one by one.
        first = self.published is None and nodes < self.max_nodes
        if first and now - self._joined_at < FIRST_WAIT_S:
            return None
        if nodes < self.min_nodes:
            if self._short_since is None:
                self._short_since = now
            elif now - self._short_since > self.timeout:
                self.client.set(
                    key("failed"),
                    f"{nodes} node(s) up, fewer than --nnodes MIN = {self.min_nodes}, for "
                    f"{self.timeout:.0f} s",
                    "publishing the job's failure",
                )
            return None
        self._short_since = None
        number = (self.published.number if self.published is not None else 0) + 1
        gen = Generation(number, members, len(current))
        self.client.set(key("g", number), gen.to_json(), "publishing a generation")
        self.client.add(key("gen"), 1, "announcing the generation")
        if self.published is not None:
            # Ranks still forming the previous generation's group stop waiting for members
            # that moved on, and join this one (PeerLostError: see ``world.reform``).
            old = self.published.number
            publish_failure(
                generation_store(self.client.store, old), -1,
                PeerLostError(f"generation {old} was replaced by generation {number} (the "
                              "members changed) before it formed"),
            )  # fmt: skip
        self.published = gen
        return gen
