"""The pipeline runtime: one rank's stages, running any schedule of ``schedules``.

[Note: messages between stages] Activations go forward and gradients backward as
point-to-point messages on two communicators of their own (four with virtual stages: the
wrap-around from the last rank to the first gets its own pair), so that a send forward and a
send backward never wait behind each other, and each communicator carries one direction
between any two ranks. Sends are asynchronous. Which message is the next one from a peer
follows from the peer's schedule (it sends right after the action that produced it), so a
rank that needs a message receives, in the peer's order, everything before it, keeping what
it does not need yet. The first activation across each stage boundary in a step is preceded
by the specs of the tensors that cross it (``boundary``: one message per micro-batch however
many tensors); gradients have the specs of the activations they belong to, which the
receiver produced.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.pipeline import boundary
from shardline.parallel.pipeline.actions import Action, stage_rank
from shardline.parallel.pipeline.clock import StepTimes
from shardline.parallel.pipeline.deferred import WeightStore, forwarding, install
from shardline.parallel.pipeline.deterministic import StepSums
from shardline.parallel.pipeline.messages import Key, StageMessages, Step
from shardline.parallel.pipeline.replicas import StageReplicas
from shardline.parallel.pipeline.schedules import SPLIT
from shardline.parallel.pipeline.split_backward import input_pass, weight_pass
from shardline.parallel.pipeline.stage_state import PipelineState
from shardline.parallel.pipeline.tied import TensorInfo, Tied, sum_tied_grads, sync_copies
from shardline.parallel.pipeline.trace import positional
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.recompute import checkpoint
from shardline.parallel.recompute.store import ACTIVE

__all__ = ["PipelineModule"]


class PipelineModule(StageMessages, PipelineState):
    """This rank's stages of a pipelined model (see ``shardline.pipeline``).

    Its children are the model's children this rank holds, under their original names, so
    ``parameters()`` and ``named_parameters()`` are this rank's share of the model's.

    Attributes:
        stages: The stage indices this rank runs (``rank, rank + p, ...``).
        recompute: Activation checkpointing per stage: a micro-batch keeps only each stage's
            input between its forward and backward; backward recomputes the rest.
        num_stages: Stages in the whole pipeline (``p * virtual_stages``).
        peak_activations: For the last ``step``, the most micro-batches whose activations a
            stage held at once, by stage (the runtime's own count).
        last_step: For the last ``step``: ``seconds`` it took on this rank, ``busy`` seconds
            of them computing (the rest waited for messages and reductions: the bubble), and the
            ``timeline`` of actions (kind, start, end in seconds from the step's start).
    """

    def __init__(
        self,
        parts: list[list[str]],
        children: dict[str, nn.Module],
        group: ProcessGroup,
        *,
        schedule: str,
        actions: list[list[Action]],
        microbatches: int,
        virtual_stages: int,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None,
        infos: dict[str, TensorInfo],
        tied: list[Tied],
        dp_group: ProcessGroup | None = None,
        dp_strategy: str = "ddp",
        recompute: bool = False,
        synchronize: bool = False,
        stage_modules: dict[int, nn.Module] | None = None,
        mixed_precision: MixedPrecision | None = None,
        compile: bool | dict[str, Any] = False,
        deterministic: int | None = None,
    ) -> None:
        super().__init__()
        p, r = group.world_size, group.rank
        self._group = group
        self._p = p
        self.num_stages = len(parts)
        self.stages = [c * p + r for c in range(virtual_stages)]
        self.schedule = schedule
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.recompute = recompute
        mp = mixed_precision or MixedPrecision()
        if mp.reduce_dtype is not None:
            raise InvalidArgumentError(
                "pipeline: mixed_precision.reduce_dtype is not supported; gradients are "
                "reduced in their own dtype (leave reduce_dtype=None)"
            )
        self._autocast = mp.param_dtype
        self.peak_activations: dict[int, int] = {}
        self._times: StepTimes | None = None
        self._last_step: dict[str, Any] | None = None
        for s in self.stages:
            for name in parts[s]:
                if hasattr(self, name) and name not in self._modules:
                    raise InvalidArgumentError(
                        f"the model's child {name!r} clashes with an attribute of the pipeline "
                        "stage; rename that child"
                    )
                self.add_module(name, children[name])
        self._stage_modules: dict[int, nn.Module]
        self._spread = stage_modules is not None  # traced stages take several arguments
        if stage_modules is None:  # the children under their names, as in the model
            self._stage_modules = {
                s: nn.Sequential(OrderedDict((n, children[n]) for n in parts[s]))
                for s in self.stages
            }
        else:  # traced stages (pipeline.trace): tensors of the graph's root are ours too
            self._stage_modules = stage_modules
            for m in stage_modules.values():
                for name, param in m._parameters.items():
                    self.register_parameter(name, param)
                for name, buf in m._buffers.items():
                    persistent = name not in m._non_persistent_buffers_set
                    self.register_buffer(name, buf, persistent=persistent)
        if compile and schedule in SPLIT:
            raise InvalidArgumentError(
                f"pipeline: compile= with schedule={schedule!r} is not supported: a compiled "
                "stage's backward is one fused node, which cannot be split into input and "
                "weight passes; use '1f1b', 'gpipe' or 'interleaved' with compile="
            )
        plain = dict(self._stage_modules)  # what data parallelism wraps (compiled or not)
        # Zero-bubble's later stages whose layers put off their own weight gradients
        # (``deferred``; stage -> its layer norms' parameters): no graph walked, none kept
        # between the input and weight passes. The first stage has no input pass;
        # recomputation reruns the forward in backward.
        self._deferred: dict[int, list[torch.Tensor]] = {}
        self._checked: set[int] = set()  # stages whose notes were checked (WeightStore.covers)
        if schedule in SPLIT and not recompute and deterministic is None:
            for s, m in plain.items():
                norms = install(m) if s > 0 else None
                if norms is not None:
                    self._deferred[s] = norms
        if compile:  # the same parameters and names: only what runs them changes
            options = compile if isinstance(compile, dict) else {}
            self._stage_modules = {
                s: cast(nn.Module, torch.compile(m, **options))
                for s, m in self._stage_modules.items()
            }
        self._actions = actions  # schedules.build(schedule, p, microbatches, virtual_stages)
        # Which message comes next from whom follows from the schedule: derived once (Note).
        self._orders: dict[bool, dict[tuple[str, int], list[Key]]] = {}
        self._infos = infos
        self._tied = tied
        self._replicas: StageReplicas | None = None  # data parallelism's, set below
        # Where received activations and gradients go: the device of this rank's stages.
        first = next(iter(self.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._dp = dp_group if dp_group is not None and dp_group.world_size > 1 else None
        self.dp_strategy = dp_strategy if self._dp is not None else None
        for t in tied:  # every rank, in the same order: new_group is collective
            t.group = group.new_group(t.ranks) if len(t.ranks) > 1 else None
        # Deterministic mode (``deterministic`` samples per unit): the sums of every
        # micro-batch's per-unit gradients in the canonical tree (pipeline.deterministic).
        self._det: StepSums | None = None
        if deterministic is not None:
            self._det = StepSums(deterministic, self, tied, r, p, microbatches)
        if synchronize:  # initialised per rank (a meta model): make the copies equal
            sync_copies(self, tied, r, self._dp)
        # DDP or ZeRO over the replicas, per chunk (pipeline.replicas; ZeRO: the optimizer
        # steps this rank's parts).
        if self._dp is not None:
            chunks = [plain[s] for s in self.stages]
            self._replicas = StageReplicas(chunks, self, self._dp, dp_strategy,
                                           compute=self._autocast)  # fmt: skip
        # One communicator per direction, and per direction for the wrap-around (Note).
        ranks = list(range(p))
        self._comms: dict[str, ProcessGroup | None] = {"fwd": None, "bwd": None}
        if p > 1:
            self._comms = {"fwd": group.new_group(ranks), "bwd": group.new_group(ranks)}
            if virtual_stages > 1:
                self._comms["fwd_wrap"] = group.new_group(ranks)
                self._comms["bwd_wrap"] = group.new_group(ranks)

    # -- actions -----------------------------------------------------------------------------

    def _amp(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to ``mixed_precision.param_dtype`` (forward and loss), or nothing."""
        if self._autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=self._autocast)

    def _one_cast(self) -> contextlib.AbstractContextManager[Any]:
        """Around a step's actions: each weight is cast to ``param_dtype`` once per step.

        Autocast caches a weight's cast until the outermost autocast region ends; this one,
        autocast off, holds that open over the step, so every micro-batch's forward reads
        the same low-precision copy (one per weight, not one per micro-batch in flight) and
        casts once. Outside the forwards autocast stays off. The weights change only in the
        optimizer step, after the region has ended (its end clears the cache). A leaf input
        that an autocast op casts (a received activation feeding a linear layer) is cached
        too, until the step ends: one low-precision copy per micro-batch.
        """
        if self._autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, enabled=False)

    def _forward(self, st: Step, a: Action) -> None:
        s, i = a.stage, a.mb
        inps: list[torch.Tensor] | None = None
        if s == 0:
            assert st.inputs is not None
            xs = list(st.inputs[i])
        else:
            xs = self._recv(st, ("act", s, i))  # takes the boundary's specs first (Note)
            if st.train:
                xs = [x.detach().requires_grad_(True) if x.is_floating_point() else x for x in xs]
            inps = xs
        if st.train and self.recompute:
            self._keep_boundary(st, s, i, xs)
        # A traced stage takes the boundary's tensors as its arguments; an nn.Sequential's
        # stage takes one argument, a tuple where its previous child returned one.
        args = xs if self._spread or len(xs) == 1 else [tuple(xs)]
        store = None
        if st.train and s in self._deferred:
            store = st.stores[(s, i)] = WeightStore(self._deferred[s])
        sums: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if st.train and self._det is not None:  # per-unit gradients, summed in the tree
            sums = self._det.forward(s, i, xs[0].shape[0], xs[0].device)
        with torch.set_grad_enabled(st.train), self._amp(), forwarding(store), sums:
            if st.train and self.recompute:
                # Only the stage's input is kept; backward recomputes the rest (same RNG).
                out = checkpoint(self._stage_modules[s], *args)
            else:
                out = self._stage_modules[s](*args)
        if s == self.num_stages - 1:
            if not st.train:
                st.outputs[i] = out.detach()
                return
            assert st.targets is not None and self.loss_fn is not None
            with self._amp():
                loss = self.loss_fn(out, st.targets[i])
            st.loss_sum = loss.detach() if st.loss_sum is None else st.loss_sum + loss.detach()
            outs = [loss / self.microbatches]
        else:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
                raise InvalidArgumentError(
                    f"pipeline stage {s} returned {type(out).__name__}; a stage must return a "
                    "tensor or a tuple of tensors (the next stage's inputs)"
                )
            specs = boundary.specs_of(outs)
            if s + 1 not in st.shapes:
                st.shapes[s + 1] = specs
                where = f"the boundary into stage {s + 1}"
                self._send(st, ("meta", s + 1, 0), boundary.encode(specs, self._device, where))
            elif specs != st.shapes[s + 1]:
                raise InvalidArgumentError(
                    f"pipeline stage {s}: micro-batch {i} gives outputs "
                    f"{boundary.describe(specs)}, micro-batch 0 gave "
                    f"{boundary.describe(st.shapes[s + 1])}; every micro-batch must have the "
                    "same shapes"
                )
            self._send(st, ("act", s + 1, i), outs)
        if st.train:
            st.saved[(s, i)] = (inps, outs)
            st.live[s] = st.live.get(s, 0) + 1
            st.peak[s] = max(st.peak.get(s, 0), st.live[s])

    def _keep_boundary(self, st: Step, s: int, i: int, xs: list[torch.Tensor]) -> None:
        """Registers a recomputed stage's input as its boundary in the active manager.

        With ``recompute`` inside an activation manager's ``activate()``, the stage's input
        (what recompute keeps) is stage ``s``'s boundary there until the micro-batch's
        backward, so the manager's stage calls and memory counts see it.
        """
        manager = ACTIVE.get()
        if manager is None:
            return
        first = manager.boundary_id(s, i)
        ids = [first] + [f"{first}.{j}" for j in range(1, len(xs))]
        for layer_id, x in zip(ids, xs, strict=True):
            manager.register(layer_id, x, policy="local")
        st.kept[(s, i)] = (manager, ids)

    def _drop_boundary(self, st: Step, s: int, i: int) -> None:
        kept = st.kept.pop((s, i), None)
        if kept is not None:
            manager, ids = kept
            for layer_id in ids:
                manager.remove(layer_id)

    def _grad_out(self, st: Step, s: int, i: int) -> list[torch.Tensor] | None:
        if s == self.num_stages - 1:
            return None  # the saved output is the loss
        return self._recv(st, ("grad", s, i))

    def _input_grads(self, inps: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The gradient message for a stage's inputs: its floating-point ones' gradients."""
        assert inps is not None
        grads = [_grad_of(x) for x in inps if x.is_floating_point()]
        return grads or [torch.zeros(1, device=self._device)]

    def _whole_backward(
        self,
        st: Step,
        s: int,
        i: int,
        saved: tuple[list[torch.Tensor] | None, list[torch.Tensor]],
        grads: list[torch.Tensor] | None,
    ) -> None:
        """Stage ``s``'s whole backward of micro-batch ``i``; its inputs' gradients sent."""
        inps, outs = saved
        roots, seeds = _roots(outs, grads)
        if roots:
            torch.autograd.backward(roots, seeds)
        if s > 0:
            self._send(st, ("grad", s - 1, i), self._input_grads(inps))

    def _backward(self, st: Step, a: Action) -> None:
        s, i = a.stage, a.mb
        grads = self._grad_out(st, s, i)  # (its specs are the saved outputs': before the pop)
        self._whole_backward(st, s, i, st.saved.pop((s, i)), grads)
        if self._det is not None:
            self._det.backward_done(s, i)
        self._drop_boundary(st, s, i)
        st.live[s] -= 1

    def _input_grad(self, st: Step, a: Action) -> None:
        # Zero-bubble: the inputs' gradients now, the weights' in _weight_grad (split_backward).
        s, i = a.stage, a.mb
        grads = self._grad_out(st, s, i)
        inps, outs = st.saved[(s, i)]
        st.grads_out[(s, i)] = grads
        if self._det is not None:  # the whole backward: the layers keep their weights' makings
            self._whole_backward(st, s, i, (inps, outs), grads)
            return
        if s > 0:
            assert inps is not None
            wanted = [x for x in inps if x.is_floating_point()]
            roots, seeds = _roots(outs, grads)
            store = st.stores.get((s, i))
            if store is not None and s not in self._checked and roots:
                # The first time: the layers' notes must be every use of their weights.
                self._checked.add(s)
                if not store.covers(roots, wanted, self._trained(s)):
                    del self._deferred[s], st.stores[(s, i)]
                    store = None
            if store is not None and s in self._deferred and roots:  # weights later; graph goes
                found = store.input_pass(roots, seeds, wanted)
                got = [torch.zeros_like(x) if g is None else g
                       for x, g in zip(wanted, found, strict=True)]  # fmt: skip
            else:
                got, st.split[(s, i)] = input_pass(roots, seeds, wanted, self._trained(s))
            self._send(st, ("grad", s - 1, i), got or [torch.zeros(1, device=self._device)])

    def _trained(self, s: int) -> list[torch.Tensor]:
        return [p for p in self._stage_modules[s].parameters() if p.requires_grad]

    def _weight_grad(self, st: Step, a: Action) -> None:
        s, i = a.stage, a.mb
        _, outs = st.saved.pop((s, i))
        roots, seeds = _roots(outs, st.grads_out.pop((s, i)))
        if self._det is not None:  # the weight pass is the sum of what the layers kept
            self._det.backward_done(s, i)
            roots = []
        store = st.stores.pop((s, i), None)
        state = st.split.pop((s, i), None)
        if store is not None or state is not None:
            if state is not None:  # split_backward's input pass ran (or nothing to defer)
                weight_pass(roots, seeds, state)
            else:
                assert store is not None
                store.run()
            if self._replicas is not None:  # set .grad by hand: no accumulation hook ran
                self._replicas.fold()
        elif roots:  # the first stage: no input pass ran, one whole backward
            params = self._trained(s)
            if params:
                torch.autograd.backward(roots, seeds, inputs=params)
        self._drop_boundary(st, s, i)
        st.live[s] -= 1

    # -- the step ----------------------------------------------------------------------------

    def _split_inputs(self, inputs: Any) -> list[tuple[torch.Tensor, ...]]:
        """The model's inputs (a tensor, or a tuple of them) per micro-batch."""
        if isinstance(inputs, (tuple, list)) and inputs:
            parts = [self._split(x, f"inputs[{k}]") for k, x in enumerate(inputs)]
            return list(zip(*parts, strict=True))
        return [(x,) for x in self._split(inputs, "inputs")]

    def _split(self, value: Any, what: str) -> list[Any]:
        m = self.microbatches
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(
                f"pipeline: {what} must be a tensor (split into {m} micro-batches along dim 0); "
                f"got {type(value).__name__}"
            )
        if value.dim() == 0 or value.shape[0] % m:
            raise InvalidArgumentError(
                f"pipeline: {what} has a batch of {value.shape[0] if value.dim() else 0} along "
                f"dim 0, not divisible into microbatches={m}; use a batch that is a multiple "
                f"of {m}, or other microbatches"
            )
        return list(value.chunk(m))

    def _guarded(
        self,
        actions: list[list[Action]],
        train: bool,
        inputs: Any,
        target: Any,
        times: StepTimes | None = None,
    ) -> Step:
        # Keyword inputs are checked on every rank given them, before any message.
        inputs = positional(inputs, self.input_names)
        # A rank that fails mid-step aborts the pipeline's communicators and its tied
        # weights' groups, so the ranks waiting for its messages or for the tied sum raise at
        # once (with its reason) instead of timing out.
        try:
            return self._run(actions, train, inputs, target, times)
        except Exception as exc:
            reason = f"pipeline stage(s) {self.stages} on rank {self._group.rank} failed: {exc}"
            tied = [t.group for t in self._tied]  # the copies' sum after the step waits too
            for comm in [*self._comms.values(), *tied]:
                if comm is not None:
                    with contextlib.suppress(Exception):
                        comm.abort(reason)
            raise

    def _run(
        self,
        actions: list[list[Action]],
        train: bool,
        inputs: Any,
        target: Any,
        times: StepTimes | None = None,
    ) -> Step:
        holds_first = 0 in self.stages
        holds_last = self.num_stages - 1 in self.stages
        st = Step(
            train=train,
            inputs=self._split_inputs(inputs) if holds_first else None,
            targets=self._split(target, "target") if (holds_last and train) else None,
            inbox=self._inboxes(actions, train),
            times=times,
        )
        if self._replicas is not None and train:  # ZeRO: whole parameters, once per step
            self._replicas.begin()
        if self._det is not None and train:
            self._det.begin()
        run = {"F": self._forward, "B": self._backward, "I": self._input_grad,
               "W": self._weight_grad}  # fmt: skip
        with self._one_cast():
            for a in actions[self._group.rank]:
                if times is None:
                    run[a.kind](st, a)
                    continue
                # What the action computed: its time less its waits for messages (a bubble).
                t0, w0 = times.mark(), len(times.waits)
                run[a.kind](st, a)
                times.actions.append((a.kind, t0, times.mark(), w0, len(times.waits)))
        for work, _ in st.sends:
            work.wait()
        st.sends.clear()
        if self._det is not None and train:  # every gradient set (inside the abort's reach)
            self._det.finish()
        return st

    @property
    def last_step(self) -> dict[str, Any]:
        """The last ``step``'s ``seconds``, ``busy`` seconds and ``timeline`` (see the class).

        On a GPU these are the device's times (CUDA events), so reading them waits for that
        step's work to finish; ``{}`` before the first step.
        """
        if self._last_step is None:
            self._last_step = self._times.resolve() if self._times is not None else {}
        return self._last_step

    def step(self, inputs: Any = None, target: Any = None) -> torch.Tensor:
        """Runs forward and backward of every micro-batch of one batch through the pipeline.

        Every rank of the pipeline calls it with the same arguments: the rank holding the
        first stage reads ``inputs`` (a tensor, or a tuple of tensors for a model of several
        inputs; each is split along dim 0), the one holding the last reads ``target``; the
        others may pass ``None``. Gradients accumulate into this rank's parameters (call
        ``opt.zero_grad()`` before, ``opt.step()`` after).

        With a data-parallel group (``dp_group``), every replica's gradients are then averaged
        over it, once per step.

        Returns:
            The mean of ``loss_fn`` over this replica's micro-batches, on every rank of the
            pipeline.

        Raises:
            InvalidArgumentError: no ``loss_fn``, or a batch not divisible into micro-batches
                (before any work).
        """
        if self.loss_fn is None:
            raise InvalidArgumentError("pipeline: step() needs loss_fn=; pass it to sl.pipeline")
        times = StepTimes.on(self._device)
        st = self._guarded(self._actions, True, inputs, target, times)
        self.peak_activations = dict(st.peak)
        replicas = self._replicas
        if self._det is not None and replicas is not None:  # ZeRO: the gradients set by hand
            replicas.fold()
        if replicas is not None and replicas.zero:  # tied copies summed first: parts differ
            sum_tied_grads(self, self._tied, self._group.rank, replicas.whole_grad)
            replicas.reduce()
        else:
            # DDP: each rank averages over its replicas as soon as its own last backward is
            # done, while earlier stages are still in their cool-down; the tied sum waits for
            # the first stage. Both are linear, so the order does not change the result.
            if replicas is not None:
                replicas.reduce()
            sum_tied_grads(self, self._tied, self._group.rank)
        loss = torch.zeros((), dtype=torch.float32, device=self._device)
        if st.loss_sum is not None:
            loss = (st.loss_sum / self.microbatches).to(torch.float32).reshape(())
        if self._p > 1:
            self._group.broadcast(loss, src=stage_rank(self.num_stages - 1, self._p))
        # The step ends with the loss everywhere: on a GPU, where each rank's clock starts
        # when its device gets to the step, this end brings every rank's window to the
        # pipeline's period (a middle stage done early still waits here, as it idles).
        times.end = times.mark()
        self._times, self._last_step = times, None
        return loss

    def forward(self, inputs: Any = None) -> torch.Tensor | None:
        """Inference through the pipeline (no autograd).

        Every rank calls it with the same arguments; the rank holding the last stage gets the
        output, the others ``None``.
        """
        v, p = len(self.stages), self._p
        m = self.microbatches
        actions = [
            [Action("F", c * p + r, i) for i in range(m) for c in range(v)] for r in range(p)
        ]
        with torch.no_grad(), self._whole():  # ZeRO-3: whole only while it runs
            st = self._guarded(actions, False, inputs, None)
        if self.num_stages - 1 not in self.stages:
            return None
        return torch.cat([st.outputs[i] for i in range(m)])


def _roots(
    outs: list[torch.Tensor], grads: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Where a stage's backward starts, and the gradients it starts with.

    The outputs that need a gradient, with the gradients that came back for them (for the
    floating-point outputs, in order); on the last stage, the loss, seeded with None.
    """
    if grads is None:
        return [o for o in outs if o.requires_grad], [None] * sum(o.requires_grad for o in outs)
    floats = [o for o in outs if o.is_floating_point()]
    pairs = [(o, g) for o, g in zip(floats, grads, strict=False) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _grad_of(t: torch.Tensor) -> torch.Tensor:
    if t.grad is None:  # the input did not influence the output
        return torch.zeros_like(t)
    return t.grad
