"""Asynchronous SGD: workers push gradients to a sharded parameter server, with no barrier.

``sl.distribute(model, opt, strategy="async", staleness=s, on_stale="wait" | "drop",
servers=k)`` splits the model's flattened parameters over ``k`` server ranks (ranks
``0 .. k-1``, which also train: every rank is a worker). Each ``opt.step()`` pushes this rank's
gradient to every server over the engine's point-to-point paths (one two-rank group per server
and worker, served by a thread on the server) and takes the parameters each one sends back;
no rank waits for another, but as the staleness rule says (see ``param_server``). The server
steps its shard with the optimizer's class and hyperparameters, once per round of ``n``
gradients, so ``staleness=0`` with ``"wait"`` is synchronous SGD with that optimizer.

The returned optimizer is an ``AsyncOptimizer`` over the replica's parameters: ``zero_grad``
as usual, ``step`` pushes and pulls. ``model.close()`` ends training collectively: the servers
finish every round, then every replica takes the final parameters. ``model.staleness()`` tells
how old the gradients applied by this rank's server were, ``model.comm_stats()`` the bytes.

Limits: parameters of one floating dtype and one optimizer param group; a learning-rate
scheduler on the loop's optimizer does not reach the servers; the servers' optimizer state is
not in checkpoints (save after ``close()``: the model is then the same everywhere).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any

import torch
from torch import nn

from shardline.comm import traffic
from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.parallel._common import check_same_model
from shardline.parallel.replica.base import Replica, split_like
from shardline.parallel.replica.param_server import ShardServer

__all__ = ["AsyncOptimizer", "AsyncSGD"]

_MIB = 1 << 20
_BYE = -1


class AsyncSGD(Replica):
    """A replica whose optimizer steps go through a sharded parameter server.

    ``comm_stats()`` counts what this rank sent and received as a worker (its server's replies
    are not included).

    Args:
        module: The plain model (on the CPU for the native or gloo backend, on this rank's
            GPU for nccl).
        group: The ranks; the default group when ``None``. Its ``timeout`` bounds every wait:
            a server's for a round's gradients (``"wait"``), the messages between ranks.
        staleness: ``s >= 0``: the most versions a gradient may lag the server.
        on_stale: ``"wait"`` (stale synchronous parallel) or ``"drop"`` (see ``param_server``).
        servers: Server ranks ``k`` (``1 <= k <= world_size``); the parameters are split
            into ``k`` contiguous shards.
        init_sync: Broadcast rank 0's parameters and buffers first.
    """

    strategy = "async"

    def __init__(
        self,
        module: nn.Module,
        *,
        group: ProcessGroup | None = None,
        staleness: int = 1,
        on_stale: str = "wait",
        servers: int = 1,
        init_sync: bool = True,
    ) -> None:
        super().__init__()
        self.group = group if group is not None else default_group()
        n = self.group.world_size
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise InvalidArgumentError(
                f"async: staleness must be an integer >= 0, not {staleness!r}"
            )
        if on_stale not in ("wait", "drop"):
            raise InvalidArgumentError(
                f'async: on_stale must be "wait" or "drop", not {on_stale!r}'
            )
        if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= n:
            raise InvalidArgumentError(
                f"async: servers must be between 1 and the world size {n}, not {servers!r}"
            )
        self.module = module
        self.staleness_bound = staleness
        self.on_stale = on_stale
        self.num_servers = servers
        named = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise InvalidArgumentError("async: the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise InvalidArgumentError(
                f"async: parameters must share one floating dtype, got {sorted(map(str, dtypes))}"
            )
        self._names = [k for k, _ in named]
        self._params = [p for _, p in named]
        check_same_model(self.group, self._names, self._params, "async")
        if init_sync:
            with traffic.charged_to(self._traffic):
                tensors = [p.data for p in self._params] + [
                    b for b in module.buffers() if b.numel()
                ]
                broadcast_coalesced(self.group, tensors, 0, 25 * _MIB)
        total = sum(p.numel() for p in self._params)
        size = -(-total // servers)
        self._ranges = [(s * size, min(total, (s + 1) * size)) for s in range(servers)]
        # One two-rank group per (server, worker): each pair keeps its own message order.
        self._pairs: dict[tuple[int, int], ProcessGroup] = {}
        for s in range(servers):
            for w in range(n):
                if w != s:
                    g = self.group.new_group([s, w])
                    if g is not None:
                        self._pairs[(s, w)] = g
        self._versions = [0] * servers  # the version of each shard this replica holds
        self.clock = 0
        self.dropped = 0
        self._server: ShardServer | None = None
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._closed = False
        self._timeout = self.group.timeout  # a server's wait for a round (see Args: group)
        # Messages and the servers' shards live where the group's tensors do (CUDA on nccl,
        # else CPU, whatever the model's device).
        self._dev = self.group.device

    # -- binding -------------------------------------------------------------------------------

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> AsyncOptimizer:
        """Starts this rank's server with ``optimizer``'s class and hyperparameters.

        Returns the optimizer to use in the loop (``step`` pushes and pulls).
        """
        if len(optimizer.param_groups) != 1:
            raise InvalidArgumentError(
                "async: the optimizer must have one param group (the server steps one flat "
                f"shard), it has {len(optimizer.param_groups)}"
            )
        ids = {id(p) for p in self._params}
        if {id(p) for p in optimizer.param_groups[0]["params"]} != ids:
            raise InvalidArgumentError(
                "async: build the optimizer from model.parameters() (all trainable ones)"
            )
        accepted = inspect.signature(type(optimizer).__init__).parameters
        hyper = {
            k: v for k, v in optimizer.param_groups[0].items() if k != "params" and k in accepted
        }
        rank = self.group.rank
        if rank < self.num_servers:
            lo, hi = self._ranges[rank]
            self._server = ShardServer(
                self._flat()[lo:hi].to(self._dev),
                type(optimizer),
                hyper,
                workers=self.group.world_size,
                staleness=self.staleness_bound,
                on_stale=self.on_stale,
                timeout=self._timeout,
            )
            for w in range(self.group.world_size):
                if w != rank:
                    t = threading.Thread(
                        target=self._serve, args=(w,), name=f"shardline-ps{rank}-w{w}", daemon=True
                    )
                    t.start()
                    self._threads.append(t)
        return AsyncOptimizer(self, optimizer.param_groups[0]["params"], hyper)

    def _ints(self, a: int, b: int) -> torch.Tensor:
        """A two-value message header on the group's device."""
        return torch.tensor([a, b], dtype=torch.int64, device=self._dev)

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    # -- server side ---------------------------------------------------------------------------

    def _serve(self, w: int) -> None:
        """Answers worker ``w``'s pushes until it says goodbye (a thread per worker)."""
        server = self._server
        assert server is not None
        g = self._pairs[(self.group.rank, w)]
        peer = 1 - g.rank  # the pair's other rank
        lo, hi = self._ranges[self.group.rank]
        try:
            # On CUDA a stream of its own: this thread's wait for the next push must not hold
            # up what the training thread queues on its stream (its sends would never start).
            own = torch.cuda.Stream(self._dev) if self._dev.type == "cuda" else None  # type: ignore[no-untyped-call]
            with torch.cuda.stream(own) if own is not None else contextlib.nullcontext():
                header = torch.empty(2, dtype=torch.int64, device=self._dev)
                grad = torch.empty(hi - lo, dtype=torch.float32, device=self._dev)
                while True:
                    g.recv(header, peer)
                    clock, computed_on = int(header[0]), int(header[1])
                    if clock == _BYE:
                        return
                    g.recv(grad, peer)
                    reply = server.handle(clock, computed_on, grad)
                    g.send(self._ints(reply.version, int(reply.accepted)), peer)
                    g.send(reply.params.float(), peer)
        except BaseException as exc:  # reported on the main thread at the next step
            self._errors.append(exc)

    # -- worker side ---------------------------------------------------------------------------

    def _raise_errors(self) -> None:
        if self._errors:
            exc = self._errors[0]
            raise ShardlineError(
                f"async on rank {self.group.rank}: the parameter server failed: {exc}"
            ) from exc

    @torch.no_grad()
    def push_pull(self) -> None:
        """Pushes this replica's gradient to every server and takes the parameters back."""
        if self._closed:
            raise ShardlineError(f"async on rank {self.group.rank}: step after close()")
        self._raise_errors()
        grad = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in self._params
            ]
        ).to(self._dev)
        rank = self.group.rank
        new = torch.empty_like(grad)
        pending = []
        with traffic.charged_to(self._traffic):
            for s, (lo, hi) in enumerate(self._ranges):
                if s == rank:
                    continue
                g = self._pairs[(s, rank)]
                peer = 1 - g.rank
                g.send(self._ints(self.clock, self._versions[s]), peer)
                g.send(grad[lo:hi].contiguous(), peer)
                pending.append((s, g, peer))
            if self._server is not None:
                lo, hi = self._ranges[rank]
                reply = self._server.handle(self.clock, self._versions[rank], grad[lo:hi])
                self._take(rank, reply.version, reply.accepted, reply.params, new)
            for s, g, peer in pending:
                lo, hi = self._ranges[s]
                header = torch.empty(2, dtype=torch.int64, device=self._dev)
                g.recv(header, peer)
                g.recv(new[lo:hi], peer)
                self._take(s, int(header[0]), bool(header[1]), None, new)
        for p, value in zip(self._params, split_like(new, self._params), strict=True):
            p.copy_(value)
        self.clock += 1

    def _take(
        self, s: int, version: int, accepted: bool, params: torch.Tensor | None, into: torch.Tensor
    ) -> None:
        if params is not None:
            lo, hi = self._ranges[s]
            into[lo:hi] = params
        self._versions[s] = version
        if not accepted:
            self.dropped += 1

    @torch.no_grad()
    def close(self) -> None:
        """Ends training (a collective): servers finish, then every replica takes the result."""
        if self._closed:
            return
        self._closed = True
        rank = self.group.rank
        with traffic.charged_to(self._traffic):
            for s in range(self.num_servers):
                if s != rank:
                    g = self._pairs[(s, rank)]
                    g.send(self._ints(_BYE, 0), 1 - g.rank)
            for t in self._threads:
                t.join()
            self._raise_errors()
            if self._server is not None:
                self._server.flush()
            numel = sum(p.numel() for p in self._params)
            flat = torch.empty(numel, dtype=torch.float32, device=self._dev)
            if self._server is not None:
                lo, hi = self._ranges[rank]
                flat[lo:hi] = self._server.param.detach().float()
            for s, (lo, hi) in enumerate(self._ranges):
                part = flat[lo:hi].contiguous()
                self.group.broadcast(part, src=s)
                flat[lo:hi] = part
        for p, value in zip(self._params, split_like(flat, self._params), strict=True):
            p.copy_(value)

    # -- reports -------------------------------------------------------------------------------

    def staleness(self) -> dict[int, int]:
        """``{versions old: gradients applied}`` by this rank's server (empty on non-servers)."""
        return dict(sorted(self._server.ages.items())) if self._server is not None else {}

    def _report_steps(self) -> int:
        return self.clock

    def _report_extra(self) -> dict[str, Any]:
        return {"dropped": self.dropped}


class AsyncOptimizer(torch.optim.Optimizer):
    """The loop's optimizer under ``strategy="async"``: ``step()`` pushes and pulls.

    Its param group holds the replica's parameters and the hyperparameters the servers use.
    """

    def __init__(
        self, wrapper: AsyncSGD, params: list[torch.Tensor], hyper: dict[str, Any]
    ) -> None:
        super().__init__(params, dict(hyper))
        self._wrapper = wrapper

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Pushes this rank's gradients, takes the servers' parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wrapper.push_pull()
        return loss
