"""The lifetimes the memory planner's peaks assume, checked on the engine itself.

``estimate_memory`` counts ZeRO-1/2's re-gather inputs (a compute-dtype copy of every shard,
made as the forward after a step begins) at the forward's start and not beside the
activations. That holds only if the engine frees each copy when its unit's modules first run:
these tests watch the copies from inside the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.parallel import MixedPrecision, ShardedDataParallel
from shardline.parallel.planner import estimate_memory
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")

LAYERS, WIDTH = 4, 64


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_regather_inputs_are_freed_as_their_units_first_run(stage: int, precision: str) -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" else None
    n = 2
    planned = estimate_memory(
        _model(), world_size=n, strategy=f"zero{stage}", mixed_precision=mp, unit_mb=0
    )
    assert planned.regather > 0

    def body(g: ProcessGroup) -> list[tuple[int, int, bool]]:
        torch.set_num_threads(1)
        plain = _model()
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        model, opt = sl.distribute(
            plain, opt, strategy=f"zero{stage}", group=g, unit_mb=0, mixed_precision=mp
        )
        assert isinstance(model, ShardedDataParallel) and opt is not None
        units = model._units
        assert len(units) == LAYERS  # one unit per layer: the planner's grouping
        seen: list[tuple[int, int, bool]] = []

        def watch(layer: int) -> Callable[[nn.Module, object], None]:
            # Runs after the wrapper's own hook, which has waited for the layer's unit.
            def hook(module: nn.Module, args: object) -> None:
                held = [u.gather_input for u in units if u.gather_input is not None]
                mine = model._module_units[module][0]
                seen.append((layer, sum(t.nbytes for t in held), mine.gather_input is None))

            return hook

        x = torch.randn(8, WIDTH)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for i, layer in enumerate(plain):
            layer.register_forward_pre_hook(watch(i))
        model(x).square().mean().backward()  # the forward after a step re-gathers every unit
        return seen

    per_unit = planned.regather // LAYERS  # equal units
    for seen in run_ranks(n, body, timeout=60):
        assert [layer for layer, _, _ in seen] == list(range(LAYERS))
        for layer, held, freed in seen:
            assert freed, f"layer {layer}'s re-gather input outlived its first use"
            # the units not yet run still hold theirs: the planner's regather at the start
            assert held == (LAYERS - 1 - layer) * per_unit, (layer, held, per_unit)
