"""One node of an elastic job (``shardline run --nnodes MIN:MAX``): its launcher's loop.

The same command runs on every node. The first launcher to bind ``--master-addr:--master-port``
hosts the job's store and its ``membership.Coordinator``; the others connect to it. Each
launcher registers its node, starts ``--nproc-per-node`` workers, beats, and reports what
each of its slots holds (see [Note: generations] in ``shardline.comm.rendezvous.membership``).
A worker that fails is replaced at once while this node has restarts left (``--max-restarts``,
counted per node as torchrun does); the other workers are not restarted: they re-form the group
in place (``shardline.elastic.run``). A node whose launcher is gone leaves the job; a launcher
started later joins it. Workers die with their launcher (``PR_SET_PDEATHSIG``, set in
``shardline.init``), so a node goes as a whole.

The launcher that hosts the store stays up, once its own workers are done, until every slot
of every live node is done or gone: the store must outlive every worker. If it dies the job
is lost (as with torchrun's c10d rendezvous): its host is the job's single point of failure.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from shardline import config as settings
from shardline.comm.rendezvous.membership import BEAT_S, Coordinator, key
from shardline.comm.rendezvous.store import StoreClient
from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.launch.config import worker_env
from shardline.launch.workers import (
    Attempt,
    StopSignals,
    _describe_returncode,
    _signal_group,
    _Worker,
    say,
)

if TYPE_CHECKING:
    from shardline.launch.config import LaunchConfig

__all__ = ["run_node"]

_POLL_S = 0.05
_STORE_TIMEOUT = timedelta(minutes=5)


@dataclass
class _Slot:
    """A place this node runs a worker in, and the process there now."""

    name: str
    local_rank: int
    incarnation: int
    worker: _Worker
    state: str = "up"  # "up", "done" or "gone"


class _Node(Attempt):
    """The workers of one node, started and replaced one at a time."""

    def __init__(
        self, config: LaunchConfig, base: Mapping[str, str], secret: str | None,
        node: int, stop: StopSignals,
    ) -> None:  # fmt: skip
        super().__init__(config, [{"SHARDLINE_RESTART_COUNT": "0"}], stop)
        self.base, self.secret, self.node = dict(base), secret, node
        self.standby: tuple[str, _Worker] | None = None
        self.standbys = 0

    def env(self, local_rank: int, incarnation: int) -> dict[str, str]:
        """A worker's environment: torchrun's variables but the rank, which ``init`` learns."""
        assert self.config.master_port is not None
        env = worker_env(
            self.config, local_rank=local_rank, master_port=self.config.master_port,
            secret=self.secret, restart_count=incarnation, base=self.base,
        )  # fmt: skip
        for name in ("RANK", "WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"):
            env.pop(name, None)
        env.update(
            {
                "GROUP_RANK": str(self.node),
                "SHARDLINE_ELASTIC_SLOT": f"{self.node}.{local_rank}",
                "SHARDLINE_ELASTIC_INCARNATION": str(incarnation),
                "SHARDLINE_ELASTIC_NODES": f"{self.config.min_nodes}:{self.config.nnodes}",
            }
        )
        return env

    def label(self, local_rank: int) -> int:
        """The rank a slot of this node is printed as: its rank while every node is in.

        A label only: each generation numbers its ranks anew (``init`` learns the rank).
        """
        return self.node * self.config.nproc_per_node + local_rank

    def start(self, local_rank: int, incarnation: int) -> _Worker:
        env = self.env(local_rank, incarnation)
        worker = self._start(local_rank, env, rank=self.label(local_rank))
        self.workers.append(worker)
        return worker

    def _report(self, failed: _Worker) -> None:
        """Who failed and how, and the end of its stderr; the others run on (no restart)."""
        code = failed.proc.returncode
        assert code is not None
        tail = b"".join(failed.stderr_tail).decode("utf-8", "replace").rstrip("\n")
        lines = [f"node {self.node}: local rank {failed.local_rank} (pid {failed.proc.pid}) "
                 f"{_describe_returncode(code)}"]  # fmt: skip
        if tail:
            lines += [f"  {line}" for line in tail.splitlines()]
        say("\n".join(lines))

    def start_standby(self, number: int) -> tuple[str, _Worker]:
        """A warm spare: the script started, waiting in ``shardline.init`` for a slot."""
        name = f"{self.node}.s{number}"
        env = self.env(0, 0)
        env.pop("SHARDLINE_ELASTIC_SLOT")
        env["SHARDLINE_ELASTIC_STANDBY"] = name
        worker = self._start(0, env, rank=-1, label=f"standby {name}")
        self.workers.append(worker)
        return name, worker

    def take_standby(self, client: StoreClient, slot: _Slot, more: bool) -> bool:
        """Hands ``slot`` (a new incarnation) to the standby, if one is up.

        Starts the next standby when ``more`` restarts remain.
        """
        if self.standby is None or self.standby[1].proc.poll() is not None:
            return False
        name, worker = self.standby
        # Relabelled first: it may print as soon as it reads its slot.
        worker.rank, worker.local_rank = self.label(slot.local_rank), slot.local_rank
        worker.relabel(f"rank{worker.rank}", prefixed=self.config.prefix_output)
        client.set(key("standby", name), f"{slot.name}:{slot.incarnation}", "waking a standby")
        slot.worker = worker
        self.standbys += 1
        self.standby = self.start_standby(self.standbys) if more else None
        return True

    def stop_standby(self) -> None:
        """Ends the standby (SIGKILL: it only waits in ``shardline.init``)."""
        if self.standby is not None:
            _signal_group(self.standby[1].proc.pid, signal.SIGKILL)
            self.standby = None


def _open_store(config: LaunchConfig) -> tuple[Any, bool]:
    """The job's store: hosted here if this launcher binds the port first, else a client."""
    import torch.distributed as dist  # noqa: PLC0415

    assert config.master_port is not None
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            config.master_addr, config.master_port, None, True, _STORE_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip
        return store, True
    except (RuntimeError, OSError):
        pass  # taken: another launcher hosts it
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            config.master_addr, config.master_port, None, False, _STORE_TIMEOUT
        )
    except (RuntimeError, OSError) as exc:
        raise InvalidArgumentError(
            f"the elastic launcher can neither host nor reach the job's store at "
            f"{config.master_addr}:{config.master_port} ({exc}); check --master-addr and "
            "--master-port, and that the node hosting it is up"
        ) from exc
    return store, False


def run_node(
    config: LaunchConfig, base: Mapping[str, str], secret: str | None, stop: StopSignals
) -> int:
    """Runs this node of an elastic job until its workers are done; the launcher's exit code.

    0 when every worker of this node ended with 0 (replacements included); else the exit code
    of the last worker that failed with no restart left, or ``128 + signal`` when stopped.
    """
    store, hosting = _open_store(config)
    client = StoreClient(store, rank=-1, task="running an elastic node")
    node = client.add(key("nodes"), 1, "registering the node") - 1
    coordinator = None
    if hosting:
        coordinator = Coordinator(
            store,
            int(config.min_nodes or 1),
            config.nnodes,
            float(settings.get("SHARDLINE_TIMEOUT")),
        )
    workers = _Node(config, base, secret, node, stop)
    slots: list[_Slot] = []
    restarts = config.max_restarts
    for local in range(config.nproc_per_node):
        name = f"{node}.{local}"
        client.set(key("slot", name), "up:0", "reporting a slot")
        slots.append(_Slot(name, local, 0, workers.start(local, 0)))
    if restarts > 0:
        workers.standby = workers.start_standby(0)
    info = {"nproc": config.nproc_per_node, "host": socket.gethostname()}
    client.set(key("node", node), json.dumps(info), "registering the node")
    role = "hosts the job's store" if hosting else "joined"
    say(f"elastic node {node} {role} (--nnodes {config.min_nodes}:{config.nnodes})")
    failed: _Worker | None = None
    try:
        failed = _watch(client, slots, workers, coordinator, node, restarts, stop)
    except _JobFailed:
        return 1
    except ShardlineError as exc:  # the store is gone: its node left, or the job ended
        if all(s.state == "done" for s in slots):
            return 0
        say(f"node {node} stops: the job's store is gone ({exc})")
        return 1
    finally:
        workers._stop_all()
        workers._join_readers()
    if stop.signum is not None:
        return 128 + stop.signum
    return failed.exit_code if failed is not None else 0


class _JobFailed(Exception):
    """The coordinator published the job's failure (too few nodes for too long)."""


def _watch(
    client: StoreClient, slots: list[_Slot], workers: _Node, coordinator: Coordinator | None,
    node: int, restarts: int, stop: StopSignals,
) -> _Worker | None:  # fmt: skip
    """The node's loop: beats, replaces failed workers, coordinates (on the store's host).

    Returns the last worker that failed with no restart left, if any.
    """
    failed: _Worker | None = None
    next_beat = 0.0
    while stop.signum is None:
        now = time.monotonic()
        if now >= next_beat:
            client.add(key("beat", node), 1, "beating")
            next_beat = now + BEAT_S
        for s in slots:
            rc = s.worker.proc.poll() if s.state == "up" else None
            if rc is None:
                continue
            if rc == 0:
                s.state = "done"
            elif restarts > 0:
                restarts -= 1
                workers._report(s.worker)
                s.incarnation += 1
                warm = workers.take_standby(client, s, more=restarts > 0)
                say(f"replacing slot {s.name} (process {s.incarnation}"
                    f"{', a warm standby' if warm else ''}; {restarts} restart(s) left on "
                    "this node)")  # fmt: skip
                if not warm:
                    s.worker = workers.start(s.local_rank, s.incarnation)
            else:
                s.state = "gone"
                failed = s.worker
                workers._report(s.worker)
                say(f"slot {s.name} failed with no restart left: it leaves the job")
            value = s.state if s.state == "gone" else f"{s.state}:{s.incarnation}"
            client.set(key("slot", s.name), value, "reporting a slot")
        if coordinator is not None:
            gen = coordinator.poll()
            if gen is not None:
                who = ", ".join(f"{s}#{i}" for s, i in gen.members)
                say(f"generation {gen.number}: {gen.world_size} ranks "
                    f"(was {gen.previous_size}): {who}")  # fmt: skip
        if client.check([key("failed")], "looking for the job's failure"):
            say(f"the job failed: {client.get(key('failed'), 'reading why').decode()}")
            raise _JobFailed
        mine_over = all(s.state != "up" for s in slots)
        if mine_over:
            workers.stop_standby()  # nothing left to stand by for
        if mine_over and (coordinator is None or coordinator.finished):
            break
        time.sleep(_POLL_S)
    return failed
