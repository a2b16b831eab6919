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
- the runtime moves one tensor across each stage boundary, and a stage's first input is the
  batch: a cut where several values cross (a residual kept from an earlier block) is refused
  before any work, naming them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.pipeline.state import Tied

__all__ = ["TracedSplit", "strip", "trace_split"]

# torch.export keeps global state while it traces: ranks that are threads of one process
# (tests, notebooks) trace one at a time.
_TRACING = threading.Lock()


@dataclass
class TracedSplit:
    """The stages of a traced model, the top-level names in each, and its tied weights."""

    stages: list[nn.Module]
    parts: list[list[str]]
    tied: list[Tied]


def _used(gm: fx.GraphModule) -> set[str]:
    """Names of the parameters and buffers ``gm``'s graph reads."""
    used: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            used |= {f"{node.target}.{n}" for n, _ in sub.named_parameters()}
            used |= {f"{node.target}.{n}" for n, _ in sub.named_buffers()}
        elif node.op == "get_attr":
            used.add(str(node.target))
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


def _check_boundaries(gm: fx.GraphModule, s: int, last: int, inputs: int) -> None:
    """Refuses a stage that takes or gives more than one tensor across a boundary.

    A stage that returns a 1-tuple is made to return the tensor.
    """
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    want = inputs if s == 0 else 1
    if len(placeholders) != want:
        raise InvalidArgumentError(
            f"pipeline: after tracing, stage {s} takes {len(placeholders)} tensors "
            f"({', '.join(placeholders)}) from stage {s - 1}; the pipeline moves one tensor "
            "between stages. Cut where only the hidden state crosses (before a block whose "
            "input is the previous block's output alone)"
            if s > 0
            else f"pipeline: the first stage takes {len(placeholders)} inputs; pass the "
            "model's input as one tensor (example=)"
        )
    node = next(n for n in gm.graph.nodes if n.op == "output")
    out = node.args[0]
    if s < last and isinstance(out, (tuple, list)):
        if len(out) != 1:
            names = ", ".join(str(v) for v in out)
            raise InvalidArgumentError(
                f"pipeline: after tracing, stage {s} gives {len(out)} tensors ({names}) to "
                f"stage {s + 1}; the pipeline moves one tensor between stages. Cut where "
                "only the hidden state crosses"
            )
        node.args = (out[0],)
        gm.recompile()


def _tied(replicated: Sequence[dict[str, str]], p: int) -> list[Tied]:
    out = []
    for group in replicated:
        stages = sorted(int(key.rsplit("_", 1)[1]) for key in group)
        names = [group[key] for key in sorted(group, key=lambda k: int(k.rsplit("_", 1)[1]))]
        if len(stages) > 1:
            out.append(Tied(names, stages, sorted({s % p for s in stages})))
    return out


def trace_split(model: nn.Module, starts: Sequence[str], example: Any, p: int) -> TracedSplit:
    """Traces ``model`` on ``example`` (one micro-batch) and cuts it before each of ``starts``.

    Raises:
        InvalidArgumentError: a split point that is not a submodule, points that do not give
            ``p`` stages, or a boundary that several tensors cross.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline  # noqa: PLC0415

    if len(starts) != p - 1:
        raise InvalidArgumentError(
            f"split={list(starts)} names {len(starts)} points but {p} stages need {p - 1}: name "
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
    args = example if isinstance(example, tuple) else (example,)
    if not all(torch.is_tensor(a) for a in args):
        raise InvalidArgumentError("pipeline: example= must be a tensor (or a tuple of tensors)")
    with _TRACING:
        pipe = pipeline(model, mb_args=args, split_spec=dict.fromkeys(starts, SplitPoint.BEGINNING))
    if pipe.num_stages != p:
        raise InvalidArgumentError(
            f"split={list(starts)} gave {pipe.num_stages} stages after tracing, not {p}: name "
            "points in the order the forward runs them, each once"
        )
    stages: list[nn.Module] = []
    parts: list[list[str]] = []
    for s in range(p):
        gm = pipe.get_stage_module(s)
        assert isinstance(gm, fx.GraphModule)
        _drop_unused(gm)
        _check_boundaries(gm, s, p - 1, len(args))
        stages.append(gm)
        parts.append([n for n, _ in gm.named_children()])
    return TracedSplit(stages, parts, _tied(pipe.replicated_params, p))


def strip(model: nn.Module) -> None:
    """Empties ``model`` once its stages were traced out of it (they hold copies).

    Its memory then goes as soon as nothing else refers to its tensors.
    """
    for name in list(model._modules):
        del model._modules[name]
    model._parameters.clear()
    model._buffers.clear()
