"""What DDP and ZeRO share for gradient compression: state in checkpoints, traffic statistics.

A wrapper built with ``compression=`` keeps its compressor's per-rank state (residuals,
PowerSGD's ``Q``) beside the model's in ``sharded_state_dict()``, as ``Local`` values under
``_compression/<field>/<parameter name>`` (the strategy contract): saved per rank, loaded back only
into the same layout; after a change of world size the compressor starts again with a short
uncompressed warm-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from shardline.comm import traffic
from shardline.compression.registry import resolve
from shardline.errors import InvalidArgumentError
from shardline.parallel.contract import Local

if TYPE_CHECKING:
    import torch

    from shardline.compression.codec import Compressor, Entry

__all__ = [
    "PREFIX",
    "charged",
    "comm_stats",
    "resolve_compression",
    "split_state",
    "state_entries",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def charged(method: _F) -> _F:
    """Counts the collectives ``method`` issues in ``self._traffic`` (its wrapper's own)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with traffic.charged_to(self._traffic):
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


PREFIX = "_compression/"


def resolve_compression(value: object, comm_hook: object) -> Compressor | None:
    """The compressor for ``compression=`` (a name or an object); refuses it with a hook."""
    if value is None:
        return None
    if comm_hook is not None:
        raise InvalidArgumentError(
            "pass either compression= or comm_hook=, not both: a compressor replaces the hook"
        )
    return resolve(value)  # type: ignore[arg-type]


def state_entries(
    compressor: Compressor | None,
    buffers: Sequence[tuple[Hashable, list[Entry], int]],
    device: torch.device,
) -> dict[str, Any]:
    """The compressor's state as ``Local`` values, keyed for ``sharded_state_dict()``.

    ``buffers``: the wrapper's reduced buffers now (key, layout, number of elements); their
    state is allocated first, so a checkpoint loads into a wrapper that has not trained yet.
    """
    if compressor is None:
        return {}
    for key, layout, numel in buffers:
        compressor.prepare(key, layout, numel, device)
    return {PREFIX + k: Local(v) for k, v in compressor.state_tensors().items()}


def split_state(sd: dict[str, Any], compressor: Compressor | None) -> dict[str, Any]:
    """Hands the ``_compression/`` entries of ``sd`` to the compressor; returns the rest."""
    mine = {k[len(PREFIX) :]: v for k, v in sd.items() if k.startswith(PREFIX)}
    if mine:
        if compressor is None:
            raise InvalidArgumentError(
                "load_sharded_state_dict: the state holds compression state "
                f"({len(mine)} entries) but this model was wrapped without compression="
            )
        compressor.load_state_tensors(
            {k: v.tensor if isinstance(v, Local) else v for k, v in mine.items()}
        )
    return {k: v for k, v in sd.items() if not k.startswith(PREFIX)}


def comm_stats(
    counts: Sequence[dict[str, dict[str, int]]], compressor: Compressor | None, steps: int
) -> dict[str, Any]:
    """Bytes this rank moved for the wrapper so far: totals, per op, per step, the compressor.

    ``counts``: ``Traffic.snapshot()``s of what the wrapper issued; ``steps``: synchronised
    backwards so far (for the per-step figures).
    """
    by_op = traffic.merge(*counts)
    sent = sum(row["sent"] for row in by_op.values())
    received = sum(row["received"] for row in by_op.values())
    per = max(steps, 1)
    return {
        "sent": sent,
        "received": received,
        "steps": steps,
        "sent_per_step": sent / per,
        "received_per_step": received / per,
        "by_op": by_op,
        "compression": repr(compressor) if compressor is not None else None,
    }
