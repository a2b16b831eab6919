"""One choice the planner priced: a strategy, its settings, its bytes per rank and its step.

``fit.plan_strategy`` makes them; ``CHOICES`` is the order it prefers them in.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.parallel import strategies
from shardline.parallel.memory_estimate import MemoryEstimate
from shardline.parallel.pipeline_layout import SCHEDULE, SCHEDULES
from shardline.parallel.timing import StepTime

__all__ = ["CHOICES", "Candidate"]


@dataclass(frozen=True)
class Candidate:
    """One strategy priced: its estimate per rank and whether it fits the budget.

    Attributes:
        strategy: ``ddp``, ``zero1``, ``zero2`` or ``zero3``.
        offload: zero3's ``offload`` (``"optimizer"``, ``"cpu"``) or ``None``.
        estimate: Bytes per rank, by component (``estimate_memory``'s).
        fits: Its total is within the device budget, and under offload its host part within
            the host budget.
        recompute: The blocks' recompute policy, or ``None``; for a pipeline ``"full"``,
            each stage recomputing its forward (``sl.pipeline(recompute=True)``).
        time: Its predicted step (``StrategyPlan.timed``); ``None`` until timed, and for
            the offloads.
        tp: Tensor-parallel ranks per replica (``sl.tensor_parallel``'s ``"auto"`` plan), 1
            for none; ``strategy`` then keeps the ``N / tp`` replicas (with one there is
            nothing to average or shard, but the ZeRO stages compute in ``mixed_precision``).
        pp, microbatches: Pipeline stages per replica (``sl.pipeline``) and its
            micro-batches per step, 1 for none; ``strategy`` keeps the ``N / pp`` replicas
            (``N / (pp tp)`` where each stage splits over ``tp`` ranks too).
        schedule: The pipeline's schedule (``"1f1b"`` or ``"zero_bubble"``).
    """

    strategy: str
    offload: str | None
    estimate: MemoryEstimate
    fits: bool
    recompute: str | None = None
    time: StepTime | None = None
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = SCHEDULE

    @property
    def name(self) -> str:
        """Its name: ``"zero1 recompute=selective"``, ``"ddp tp=2"``, ``"ddp pp=2 m=4"``.

        Also ``"zero3"``, ``"zero3 offload=cpu"``, ``"ddp tp=2 pp=2 m=4"``, and for a
        pipeline not run by 1F1B ``"ddp pp=2 m=4 schedule=zero_bubble"``.
        """
        return (
            self.strategy
            + (f" recompute={self.recompute}" if self.recompute else "")
            + (f" offload={self.offload}" if self.offload else "")
            + (f" tp={self.tp}" if self.tp > 1 else "")
            + (f" pp={self.pp} m={self.microbatches}" if self.pp > 1 else "")
            + (f" schedule={self.schedule}" if self.pp > 1 and self.schedule != SCHEDULE else "")
        )

    @property
    def order(self) -> tuple[int, int, int, int, int]:
        """Its place among the choices: by pp, tp, ``CHOICES``, m, then schedule."""
        index = CHOICES.index((self.recompute, self.strategy, self.offload))
        return (self.pp, self.tp, index, self.microbatches, SCHEDULES.index(self.schedule))

    @property
    def batch_scale(self) -> int:
        """Ranks' batches a replica trains (``tp`` or ``pp``): the same global batch."""
        return self.tp * self.pp

    @property
    def distribute_strategy(self) -> str | dict[str, str]:
        """What ``sl.distribute`` takes for it: a name, or a strategy per mesh axis."""
        if self.pp > 1:  # with one replica, no data-parallel axis
            dp = {"dp": self.strategy} if self.estimate.world_size > 1 else {}
            tp = {"tp": "auto"} if self.tp > 1 else {}
            return {**dp, "pp": self.schedule, **tp}
        return self.strategy if self.tp == 1 else {"dp": self.strategy, "tp": "auto"}


# What plan_strategy may choose, in the order it prefers them: the least sharded strategy,
# then the same with the blocks recomputing their activations (selective, then full), then
# zero3 with its state offloaded to host memory (CUDA).
CHOICES: tuple[tuple[str | None, str, str | None], ...] = (
    *((None, s, None) for s in strategies.BY_MEMORY),
    *(("selective", s, None) for s in strategies.BY_MEMORY),
    *(("full", s, None) for s in strategies.BY_MEMORY),
    (None, "zero3", "optimizer"),
    (None, "zero3", "cpu"),
)
