"""Splitting a model that is not a chain of children, by tracing (torch's splitter).

``torch.distributed.pipelining.pipeline`` traces the model with ``torch.export`` on one
micro-batch of example input and cuts the graph before each submodule named as a split point;
each stage is a ``GraphModule`` whose parameters keep the model's names (``blocks.2.lin.weight``).
It is used as it is, with three additions:

- each stage keeps only the parameters and buffers its graph uses (torch's stages can carry
  unused copies, such as the tied head's weight in the first stage, which a checkpoint would
  then save with stale values);
- weights torch reports as used by several stages (``Pipe.replicated_params``: an embedding
  tied to the head) become ``Tied`` groups, whose gradients are summed after each step, as for
  an ``nn.Sequential``;
- several values may cross a cut (the hidden state and a residual kept from an early layer):
  the runtime moves them as one message (``boundary``), and their gradients back. torch's split
  graph lets a stage read any earlier stage's outputs; each stage is wrapped (``_Threaded``)
  to carry the values later stages need through it, so only neighbours talk. The first stage
  takes the model's inputs (``step`` splits each into micro-batches); one that later layers
  read (an attention mask) is carried to them the same way.

Every rank traces the whole model; torch's stages are copies, so a model built with its
weights is briefly held twice (the model is emptied once its stages are out). A model built
on the meta device traces without memory and materialises only this rank's stage.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.pipeline import boundary
from shardline.parallel.pipeline.tied import Tied

__all__ = ["TracedSplit", "positional", "rank_stages", "strip", "trace_split"]

_log = logging.getLogger("shardline")

# torch.export keeps global state while it traces: ranks that are threads of one process
# (tests, notebooks) trace one at a time.
_TRACING = threading.Lock()


@dataclass
class TracedSplit:
    """The stages of a traced model, the top-level names in each, and its tied weights."""

    stages: list[_Threaded]
    parts: list[list[str]]
    tied: list[Tied]


def _used(gm: nn.Module, prefix: str = "") -> set[str]:
    """Names of the parameters and buffers ``gm``'s graph reads.

    A submodule that has a graph of its own (torch.export's unflattened modules) counts what
    its graph reads: a module called twice keeps stale copies beside the ones it runs.
    """
    used: set[str] = set()
    graph = getattr(gm, "graph", None)
    if not isinstance(graph, fx.Graph):  # a plain module: everything it holds
        used |= {f"{prefix}{n}" for n, _ in gm.named_parameters()}
        return used | {f"{prefix}{n}" for n, _ in gm.named_buffers()}
    for node in graph.nodes:
        if node.op == "call_module":
            used |= _used(gm.get_submodule(node.target), f"{prefix}{node.target}.")
        elif node.op == "get_attr":
            used.add(f"{prefix}{node.target}")
    return used


def _drop_unused(gm: fx.GraphModule) -> None:
    used = _used(gm)
    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers()]
    for name, _ in tensors:
        if name not in used:
            owner, _, leaf = name.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            module._parameters.pop(leaf, None)
            module._buffers.pop(leaf, None)


def _tied(replicated: Sequence[dict[str, str]], p: int) -> list[Tied]:
    out = []
    for group in replicated:
        stages = sorted(int(key.rsplit("_", 1)[1]) for key in group)
        names = [group[key] for key in sorted(group, key=lambda k: int(k.rsplit("_", 1)[1]))]
        if len(stages) > 1:
            out.append(Tied(names, stages, sorted({s % p for s in stages})))
    return out


Value = tuple[int, int | None]  # (producing stage, -1 for the model's input; output index)


def _routes(split_gm: fx.GraphModule, p: int) -> tuple[list[list[Value]], int]:
    """For each stage, the values its graph takes, in order; and how many inputs the model has.

    Each is which stage made it (and which of its outputs), or the model's input. torch's split
    graph lets a stage read any earlier stage's outputs; the runtime moves values between
    neighbours only.
    """
    made: dict[fx.Node, Value] = {}
    needs: list[list[Value]] = [[] for _ in range(p)]
    inputs = 0
    for node in split_gm.graph.nodes:
        if node.op == "placeholder":
            made[node] = (-1, inputs)
            inputs += 1
        elif node.op == "call_module":
            k = int(str(node.target).rsplit("_", 1)[1])
            if not all(isinstance(a, fx.Node) for a in node.args) or node.kwargs:
                raise InvalidArgumentError(
                    f"pipeline: after tracing, stage {k} takes constants or keyword arguments "
                    "across a cut; cut elsewhere"
                )
            needs[k] = [made[a] for a in node.args]
            made[node] = (k, None)
        elif node.op == "call_function" and node.target is operator.getitem:
            src, idx = node.args
            assert isinstance(src, fx.Node) and isinstance(idx, int)
            made[node] = (made[src][0], idx)
    return needs, inputs


class _Threaded(nn.Module):
    """A traced stage that also carries the values later stages read from earlier ones.

    What crosses each boundary is then everything still needed after it. Its children,
    parameters and buffers are the graph module's own (same objects), so its names are the
    model's; the graph module is kept outside the module tree.
    """

    def __init__(
        self, gm: fx.GraphModule, takes: list[int], gives: list[tuple[str, int | None]] | None
    ) -> None:
        super().__init__()
        self.graph_module: fx.GraphModule
        object.__setattr__(self, "graph_module", gm)
        self.takes = takes  # for each of the graph's inputs: which of this stage's inputs
        self.gives = gives  # ("out", index | None) or ("in", index); None: the last stage
        self.adopt()

    def adopt(self) -> None:
        """(Re)registers the graph module's tensors and children as this module's own."""
        gm = self.graph_module
        for name, child in gm.named_children():
            self._modules[name] = child
        for name, param in gm._parameters.items():
            self._parameters[name] = param
        for name, buf in gm._buffers.items():
            self._buffers[name] = buf
            if name in gm._non_persistent_buffers_set:
                self._non_persistent_buffers_set.add(name)

    def forward(self, *xs: torch.Tensor) -> Any:
        out = self.graph_module(*[xs[t] for t in self.takes])
        if self.gives is None:
            return out
        return tuple(
            xs[i] if kind == "in" else (out if i is None else out[i])  # type: ignore[index]
            for kind, i in self.gives
        )


def _thread(gms: list[fx.GraphModule], needs: list[list[Value]], inputs: int) -> list[_Threaded]:
    """Wraps each stage so that only neighbours exchange values (see ``_Threaded``)."""
    p = len(gms)
    live: list[list[Value]] = [[(-1, k) for k in range(inputs)]]  # into each stage, in order
    for j in range(1, p):
        later = [v for k in range(j, p) for v in needs[k] if v[0] < j]
        live.append(list(dict.fromkeys(later)))
        if len(live[j]) > boundary.MAX_TENSORS:
            raise InvalidArgumentError(
                f"pipeline: after tracing, {len(live[j])} values cross into stage {j}; at most "
                f"{boundary.MAX_TENSORS} can. Cut where fewer values are live"
            )
    out = []
    for j, gm in enumerate(gms):
        takes = [live[j].index(v) for v in needs[j]]
        gives: list[tuple[str, int | None]] | None = None
        if j < p - 1:
            gives = [("out", v[1]) if v[0] == j else ("in", live[j].index(v)) for v in live[j + 1]]
        out.append(_Threaded(gm, takes, gives))
    return out


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """Traces a Hugging Face model with its key/value cache off, and says so.

    With ``config.use_cache`` its forward returns a ``DynamicCache``, which ``torch.export``
    cannot carry; a pipeline step keeps no cache between micro-batches anyway.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        yield
        return
    _log.warning(
        "pipeline: tracing %s with config.use_cache=False (a pipeline passes activations "
        "between stages and keeps no key/value cache)",
        type(model).__name__,
    )
    config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.use_cache = True  # type: ignore[union-attr]


def trace_split(
    model: nn.Module, starts: Sequence[str], example: Any, stages: int, p: int
) -> TracedSplit:
    """Traces ``model`` on ``example`` (one micro-batch) and cuts it before each of ``starts``.

    ``stages`` stages for ``p`` ranks; stage ``s`` runs on rank ``s % p``.

    Raises:
        InvalidArgumentError: a split point that is not a submodule, points that do not give
            ``stages`` stages, or more than ``boundary.MAX_TENSORS`` values live at a cut.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline  # noqa: PLC0415

    if len(starts) != stages - 1:
        raise InvalidArgumentError(
            f"split={list(starts)} names {len(starts)} points but {stages} stages need "
            f"{stages - 1}: name "
            "the submodule that starts every stage after the first"
        )
    names = {n for n, _ in model.named_modules() if n}
    for name in starts:
        if name not in names:
            some = sorted(names, key=len)[:12]
            raise InvalidArgumentError(
                f"split point {name!r} is not a submodule of {type(model).__name__}; some of its "
                f"submodules: {some}"
            )
    kwargs = dict(example) if isinstance(example, dict) else {}
    args = () if kwargs else example if isinstance(example, tuple) else (example,)
    if not all(torch.is_tensor(a) for a in (*args, *kwargs.values())):
        raise InvalidArgumentError(
            "pipeline: example= must be a tensor, a tuple of tensors (positional inputs) or a "
            "dict of tensors (keyword inputs, such as input_ids and attention_mask)"
        )
    with _TRACING, _no_cache(model):
        pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                        split_spec=dict.fromkeys(starts, SplitPoint.BEGINNING))  # fmt: skip
    if pipe.num_stages != stages:
        raise InvalidArgumentError(
            f"split={list(starts)} gave {pipe.num_stages} stages after tracing, not {stages}: "
            "name "
            "points in the order the forward runs them, each once"
        )
    gms: list[fx.GraphModule] = []
    for s in range(stages):
        gm = pipe.get_stage_module(s)
        assert isinstance(gm, fx.GraphModule)
        _drop_unused(gm)
        gms.append(gm)
    threaded = _thread(gms, *_routes(pipe.split_gm, stages))
    parts = [[n for n, _ in gm.named_children()] for gm in gms]
    return TracedSplit(threaded, parts, _tied(pipe.replicated_params, p))


def rank_stages(
    traced: TracedSplit, rank: int, p: int
) -> tuple[dict[int, _Threaded], dict[str, nn.Module]]:
    """This rank's stages (``rank, rank + p, ...``) and their top-level children by name.

    torch's stages hold copies: a tensor two of them read (a weight tied between them, a
    buffer) is made one object again here, so one rank holds it once and its gradient
    accumulates there. Children of one name in several stages (``blocks``, holding blocks 0-1
    in one stage and 4-5 in another) are merged into one container for naming; the stages
    keep running their own.
    """
    mine = {s: traced.stages[s] for s in range(rank, len(traced.stages), p)}
    first: dict[str, torch.Tensor] = {}  # a tensor's name -> the object this rank keeps
    for stage in mine.values():
        gm = stage.graph_module
        for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
            _replace(gm, name, first.setdefault(name, t))
    for tied in traced.tied:  # one weight under several names (an embedding and a head)
        here = [(s, n) for s, n in zip(tied.stages, tied.names, strict=True) if s in mine]
        for s, name in here[1:]:
            s0, name0 = here[0]
            _replace(mine[s].graph_module, name, mine[s0].graph_module.get_parameter(name0))
    for stage in mine.values():
        stage.adopt()
    named: dict[str, list[nn.Module]] = {}
    for stage in mine.values():
        for name, child in stage.named_children():
            named.setdefault(name, []).append(child)
    return mine, {name: _merged(mods) for name, mods in named.items()}


def _replace(gm: fx.GraphModule, name: str, t: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    table = module._parameters if leaf in module._parameters else module._buffers
    table[leaf] = t  # type: ignore[assignment]


def _merged(modules: list[nn.Module]) -> nn.Module:
    """One module holding the tensors and children of ``modules`` (children merged too)."""
    unique = list({id(m): m for m in modules}.values())
    if len(unique) == 1:
        return unique[0]
    out = nn.Module()
    children: dict[str, list[nn.Module]] = {}
    for m in unique:
        out._parameters.update(m._parameters)
        out._buffers.update(m._buffers)
        for name, child in m.named_children():
            children.setdefault(name, []).append(child)
    for name, group in children.items():
        out.add_module(name, _merged(group))
    return out


def strip(model: nn.Module) -> None:
    """Empties ``model`` once its stages were traced out of it (they hold copies).

    Its memory then goes as soon as nothing else refers to its tensors.
    """
    for name in list(model._modules):
        del model._modules[name]
    model._parameters.clear()
    model._buffers.clear()


def positional(inputs: Any, names: Sequence[str] | None) -> Any:
    """A traced model's keyword inputs (a dict) as the tuple its stages take.

    In ``names``' order (the example's); anything else is returned as it is.
    """
    if not isinstance(inputs, dict):
        return inputs
    if names is None or set(inputs) != set(names):
        raise InvalidArgumentError(
            f"pipeline: inputs with keys {sorted(inputs)}, but the model was traced on "
            + (f"keyword inputs {list(names)}" if names else "positional inputs (example=)")
            + "; pass the same inputs as example="
        )
    return tuple(inputs[n] for n in names)
