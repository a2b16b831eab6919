"""The memory planner: ZeRO formulas, mixed precision, optimizer states, activations, choice."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel import memory_available, planner
from shardline.parallel.data.zero.schedule import _MAX_INFLIGHT
from shardline.parallel.fit import available_memory, choose_strategy, plan_strategy
from shardline.parallel.memory_estimate import format_bytes
from shardline.parallel.planner import MemoryEstimate, estimate_memory, optimizer_states
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.recompute import recompute_blocks

FLATS = _MAX_INFLIGHT + 1  # full gradient flats in backward: reductions in flight + accumulating

WIDTH = 64  # every layer 64 x 64 = 4096 elements: divisible by 1, 2 and 4
LAYERS = 8


def even_model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def odd_model() -> nn.Module:
    # 7*5+5 = 40, 5*3 = 15, 3*3+3 = 12, 7*3 = 21 elements: most units need padding
    return nn.Sequential(
        nn.Linear(7, 5), nn.Linear(5, 3, bias=False), nn.Linear(3, 3), nn.Embedding(7, 3)
    )


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# fp32 Adam without mixed precision: (bytes per element, bytes per element / N)
FP32_ADAM = {"ddp": (16, 0), "zero1": (8, 8), "zero2": (4, 12), "zero3": (0, 16)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("strategy", list(FP32_ADAM))
def test_fp32_adam_bytes_per_param_exact(strategy: str, world_size: int) -> None:
    model = even_model()
    est = estimate_memory(model, world_size=world_size, strategy=strategy, unit_mb=0)
    full, shard = FP32_ADAM[strategy]
    psi = numel(model)
    assert est.num_params == psi == LAYERS * WIDTH * WIDTH
    assert est.num_units == LAYERS
    assert est.persistent == full * psi + shard * psi // world_size
    assert est.bytes_per_param == full + shard / world_size
    assert est.activations == 0 and not est.activations_estimated
    # On CPU AdamW steps one parameter at a time: one list of the largest (its shard here).
    largest = WIDTH * WIDTH if strategy == "ddp" else WIDTH * WIDTH // world_size
    assert est.step_scratch == 4 * largest
    # Without activations the peak is the largest of backward's buffers, the step's scratch and
    # (ZeRO-1/2) the re-gather's inputs as the next forward begins.
    assert est.total == est.persistent + max(est.comm_buffers, est.step_scratch, est.regather)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp32_components_and_comm_buffers(world_size: int) -> None:
    model, n = even_model(), world_size
    psi, unit = numel(model), WIDTH * WIDTH
    est = {s: estimate_memory(model, world_size=n, strategy=s, unit_mb=0) for s in FP32_ADAM}
    parts = {s: (e.params, e.grads, e.master, e.optimizer) for s, e in est.items()}
    assert parts["ddp"] == (4 * psi, 4 * psi, 0, 8 * psi)
    assert parts["zero1"] == (4 * psi, 4 * psi, 0, 8 * psi // n)
    assert parts["zero2"] == (4 * psi, 4 * psi // n, 0, 8 * psi // n)
    assert parts["zero3"] == (4 * psi // n, 4 * psi // n, 0, 8 * psi // n)
    assert est["ddp"].comm_buffers == 0  # gradients are views into the buckets
    # stages 1 and 2 re-gather every unit as the forward begins, from copies of the shards;
    # those are freed before backward, which holds only stage 2's gradient flats
    assert est["zero1"].regather == est["zero2"].regather == 4 * psi // n
    assert est["zero1"].comm_buffers == 0
    assert est["zero2"].comm_buffers == FLATS * 4 * unit
    assert est["zero3"].comm_buffers == (1 + 1) * 4 * unit + FLATS * 4 * unit  # prefetch=1
    assert est["zero3"].regather == est["ddp"].regather == 0
    prefetch2 = estimate_memory(model, world_size=n, strategy="zero3", unit_mb=0, prefetch=2)
    assert prefetch2.comm_buffers == 3 * 4 * unit + FLATS * 4 * unit
    fsdp = estimate_memory(model, world_size=n, strategy="fsdp", unit_mb=0)
    assert fsdp.strategy == "fsdp"
    assert fsdp.as_dict() | {"strategy": "zero3"} == est["zero3"].as_dict()


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", list(FP32_ADAM))
def test_fp32_adam_within_padding_on_odd_model(strategy: str, world_size: int) -> None:
    model, n = odd_model(), world_size
    est = estimate_memory(model, world_size=n, strategy=strategy, unit_mb=0)
    psi = numel(model)
    units = [40, 15, 12, 21]
    assert est.num_params == psi == sum(units) and est.num_units == len(units)
    full, shard = FP32_ADAM[strategy]
    if strategy == "ddp":
        assert est.persistent == 16 * psi  # DDP does not pad
        return
    shards = [math.ceil(u / n) for u in units]
    padded = n * sum(shards)
    assert padded > psi  # the model really needs padding
    assert est.persistent == full * padded + shard * sum(shards)
    # within padding: each unit grows by fewer than N elements
    lower = full * psi + shard * psi / n
    upper = full * (psi + len(units) * (n - 1)) + shard * (psi + len(units) * (n - 1)) / n
    assert lower < est.persistent <= upper


BF16 = MixedPrecision(param_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("model_dtype", "policy"),
    [(torch.float32, BF16), (torch.bfloat16, MixedPrecision())],
    ids=["fp32-model-bf16-compute", "bf16-model-fp32-master"],
)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mixed_precision_bf16_params_fp32_master(
    model_dtype: torch.dtype, policy: MixedPrecision, world_size: int
) -> None:
    model, n = even_model().to(model_dtype), world_size
    psi, unit = numel(model), WIDTH * WIDTH
    c, w, r, k = 2, 4, 2, 2  # bf16 compute and reduce, fp32 master and Adam states
    expected = {
        "zero1": (c * psi, r * psi + w * psi // n, w * psi // n, k * w * psi // n, 0),
        "zero2": (
            c * psi,
            w * psi // n,
            w * psi // n,
            k * w * psi // n,
            # full gradient flats and bf16 reduce-scatter outputs (r != w)
            FLATS * r * unit + _MAX_INFLIGHT * r * unit // n,
        ),
        "zero3": (
            w * psi // n,
            w * psi // n,
            0,
            k * w * psi // n,
            # 2 gathered units and their cast inputs, gradient flats, bf16 outputs
            2 * c * unit + 2 * c * unit // n + FLATS * r * unit + _MAX_INFLIGHT * r * unit // n,
        ),
    }
    for strategy, want in expected.items():
        e = estimate_memory(
            model, world_size=n, strategy=strategy, mixed_precision=policy, unit_mb=0
        )
        assert (e.params, e.grads, e.master, e.optimizer, e.comm_buffers) == want, strategy
        # stages 1 and 2 re-gather from bf16 copies of the shards as the forward begins
        assert e.regather == (c * psi // n if strategy != "zero3" else 0), strategy
    assert (
        estimate_memory(
            model, world_size=n, strategy="zero1", mixed_precision=policy, unit_mb=0
        ).bytes_per_param
        == 4 + 16 / n
    )
    ddp = estimate_memory(model, world_size=n, strategy="ddp", mixed_precision=policy, unit_mb=0)
    m = model_dtype.itemsize
    assert (ddp.params, ddp.grads, ddp.master, ddp.optimizer) == (m * psi, m * psi, 0, 2 * m * psi)
    assert any("ddp ignores mixed_precision" in note for note in ddp.notes)


def test_zero1_full_gradients_live_in_the_reduce_dtype() -> None:
    model, n = even_model(), 2
    psi = numel(model)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    e = estimate_memory(model, world_size=n, strategy="zero1", mixed_precision=policy, unit_mb=0)
    # fp32 full gradients; the fp32 shard gradient is a view of them; bf16 params, fp32 master
    assert (e.params, e.grads, e.master) == (2 * psi, 4 * psi, 4 * psi // n)
    assert e.regather == 2 * psi // n  # bf16 copies of the shards, re-gathered
    assert e.comm_buffers == 0


def test_sharded_default_keeps_fp32_master_for_a_bf16_model() -> None:
    model, n = even_model().to(torch.bfloat16), 2
    psi = numel(model)
    # the wrapper's default policy is MixedPrecision(): fp32 master and Adam states
    zero2 = estimate_memory(model, world_size=n, strategy="zero2", unit_mb=0)
    assert (zero2.params, zero2.grads, zero2.master, zero2.optimizer) == (
        2 * psi,
        4 * psi // n,
        4 * psi // n,
        8 * psi // n,
    )
    ddp = estimate_memory(model, world_size=n, strategy="ddp", unit_mb=0)
    assert ddp.persistent == 8 * psi  # DDP steps the bf16 parameters themselves


def test_frozen_parameters() -> None:
    model = even_model()
    model[0].weight.requires_grad_(False)
    psi, unit = numel(model), WIDTH * WIDTH
    ddp = estimate_memory(model, world_size=2, strategy="ddp", unit_mb=0)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * psi, 4 * (psi - unit), 8 * (psi - unit))
    assert not any("frozen" in note for note in ddp.notes)
    zero3 = estimate_memory(model, world_size=2, strategy="zero3", unit_mb=0)
    assert zero3.persistent == 16 * psi // 2  # an upper bound, said in a note
    assert any(note.startswith(f"{unit:,} frozen parameters") for note in zero3.notes)
    assert "note: 4,096 frozen" in str(zero3)


def test_optimizer_names_and_instances() -> None:
    assert [optimizer_states(n) for n in planner.OPTIMIZERS] == [2, 2, 0, 1, 1, 1, 0]
    assert optimizer_states(None) == 0
    params = [nn.Parameter(torch.zeros(3))]
    cases = [
        (torch.optim.SGD(params, lr=0.1), 0),
        (torch.optim.SGD(params, lr=0.1, momentum=0.9), 1),
        (torch.optim.Adam(params), 2),
        (torch.optim.Adam(params, amsgrad=True), 3),
        (torch.optim.AdamW(params, amsgrad=True), 3),
        (torch.optim.Adagrad(params), 1),
        (torch.optim.RMSprop(params, momentum=0.9, centered=True), 3),
    ]
    for opt, k in cases:
        assert optimizer_states(opt) == k, opt
    # a param group may override the defaults; the largest count wins
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    mixed = torch.optim.SGD([{"params": [a]}, {"params": [b], "momentum": 0.5}], lr=0.1)
    assert optimizer_states(mixed) == 1

    model, n = even_model(), 4
    psi = numel(model)
    by_name = estimate_memory(model, world_size=n, strategy="zero3", optimizer="sgd-momentum")
    by_instance = estimate_memory(
        model,
        world_size=n,
        strategy="zero3",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    )
    assert by_name == by_instance
    assert by_name.optimizer == 4 * psi // n and by_name.optimizer_states == 1
    ams = estimate_memory(
        model,
        world_size=n,
        strategy="ddp",
        optimizer=torch.optim.Adam(model.parameters(), amsgrad=True),
    )
    assert ams.optimizer == 3 * 4 * psi and ams.bytes_per_param == 20


def measure_saved_bytes(model: nn.Module, *args: torch.Tensor) -> int:
    """Bytes autograd saves in a real forward, each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args)
    out.sum().backward()  # the graph was real
    return sum(saved.values())


@pytest.mark.parametrize(
    ("act", "saved_per_row"),
    [
        (nn.ReLU, 16 + 32),  # input of layer 1; ReLU output (saved by ReLU and layer 2, once)
        (nn.GELU, 16 + 32 + 32),  # GELU also saves its input
        (nn.Tanh, 16 + 32),  # tanh saves its output, which layer 2 saves too
    ],
)
def test_activations_match_a_real_forward(act: type[nn.Module], saved_per_row: int) -> None:
    torch.manual_seed(0)
    batch = 4
    model = nn.Sequential(nn.Linear(16, 32), act(), nn.Linear(32, 8))
    x = torch.randn(batch, 16)
    by_hand = batch * saved_per_row * 4
    assert measure_saved_bytes(model, x) == by_hand
    est = estimate_memory(model, world_size=2, strategy="zero3", example_input=x)
    assert est.activations == by_hand and est.activations_estimated
    # zero3's gradients are made as backward frees the activations: the larger of the two
    assert est.total == est.persistent - est.grads + est.comm_buffers + max(by_hand, est.grads)
    # tuple and keyword forms of the same input
    assert estimate_memory(model, world_size=2, example_input=(x,)).activations == by_hand
    assert estimate_memory(model, world_size=2, example_input={"input": x}).activations == by_hand
    # bf16 compute halves them; ddp ignores the policy
    bf16 = estimate_memory(model, world_size=2, mixed_precision=BF16, example_input=x)
    assert bf16.activations == by_hand // 2
    ddp = estimate_memory(
        model, world_size=2, strategy="ddp", mixed_precision=BF16, example_input=x
    )
    assert ddp.activations == by_hand
    # the real model was not touched
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_meta_model_allocates_nothing() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(4)])
    x = torch.empty(2, 8192, device="meta")
    est = estimate_memory(model, world_size=8, strategy="zero3", example_input=x)
    psi = 4 * (8192 * 8192 + 8192)
    assert est.num_params == psi and est.persistent == 16 * psi // 8
    assert est.activations == 4 * 2 * 8192 * 4


def test_failed_meta_forward_becomes_a_note() -> None:
    class NeedsData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * float(x.sum().item())

    est = estimate_memory(NeedsData(), world_size=2, example_input=torch.ones(2, 4))
    assert not est.activations_estimated and est.activations == 0
    assert any(n.startswith("activations not estimated") for n in est.notes)


def test_str_and_as_dict() -> None:
    est = estimate_memory(even_model(), world_size=4, strategy="zero2", unit_mb=0)
    text = str(est)
    assert text.startswith("zero2 on N=4 ranks: 32,768 params in 8 units")
    assert re.search(r"grads\s+32\.00 KiB\s+4/N = 1\.00", text)
    assert re.search(r"persistent\s+224\.00 KiB\s+4 \+ 12/N = 7\.00", text)
    assert "not estimated" in text
    d = est.as_dict()
    assert d["total"] == est.total and d["persistent"] == est.persistent
    assert d["bytes_per_param"] == 7.0 and d["formulas"]["optimizer"] == "8/N"
    assert isinstance(est, MemoryEstimate)


def totals(model: nn.Module, world_size: int) -> dict[str, int]:
    return {
        s: estimate_memory(model, world_size=world_size, strategy=s, unit_mb=0).total
        for s in FP32_ADAM
    }


def test_choose_strategy_as_memory_shrinks() -> None:
    model = even_model()
    t = totals(model, 4)
    assert t["ddp"] > t["zero1"] > t["zero2"] > t["zero3"]
    headroom = 0.5
    order = ["ddp", "zero1", "zero2", "zero3"]
    for i, name in enumerate(order):
        available = int(t[name] / headroom)
        chosen, reason, est = choose_strategy(
            model, world_size=4, available_bytes=available, headroom=headroom, unit_mb=0
        )
        assert chosen == name and est.strategy == name and est.total == t[name]
        assert re.match(
            rf"{name}: [\d.]+ (KiB|MiB) per rank of [\d.]+ (KiB|MiB) available \(50% headroom\)",
            reason,
        )
        # one byte short (after headroom): the next, more sharded strategy, or a warning
        smaller, why, _ = choose_strategy(
            model, world_size=4, available_bytes=available - 2, headroom=headroom, unit_mb=0
        )
        if name == "zero3":
            assert smaller == "zero3" and "may not fit" in why
        else:
            assert smaller == order[i + 1] and f"{name} (" in why

    plenty, reason, _ = choose_strategy(model, world_size=4, available_bytes=12 * 2**30)
    assert plenty == "ddp"
    # 512 KiB of state, and in the step one list of the largest parameter (16 KiB)
    assert reason.startswith("ddp: 528.0 KiB per rank of 12.0 GiB available (70% headroom)")


def test_choose_strategy_reports_when_nothing_fits() -> None:
    model = even_model()
    t = totals(model, 4)
    chosen, reason, est = choose_strategy(
        model, world_size=4, available_bytes=t["zero3"] // 2, headroom=1.0, unit_mb=0
    )
    assert chosen == "zero3" and est.total == t["zero3"]
    assert "may not fit" in reason and "short by" in reason


def test_choose_strategy_counts_activations() -> None:
    model = even_model()
    x = torch.randn(256, WIDTH)
    plain = choose_strategy(model, world_size=4, available_bytes=10**9)[2]
    with_act = choose_strategy(model, world_size=4, available_bytes=10**9, example_input=x)[2]
    assert with_act.activations == LAYERS * 256 * WIDTH * 4
    assert with_act.total == plain.backward_peak + with_act.activations


def test_plan_strategy_prices_every_strategy_and_explains_the_choice() -> None:
    model = even_model()
    t = totals(model, 4)
    available = int(t["zero1"] / 0.5)  # ddp does not fit half of it, zero1 and on do
    plan = plan_strategy(model, world_size=4, available_bytes=available, headroom=0.5, unit_mb=0)
    assert [c.name for c in plan.candidates] == ["ddp", "zero1", "zero2", "zero3"]  # on CPU
    assert {c.strategy: c.estimate.total for c in plan.candidates} == t
    assert [c.fits for c in plan.candidates] == [False, True, True, True]
    assert plan.choice.name == "zero1" and plan.budget == available * 0.5
    assert (
        plan.reason
        == choose_strategy(model, world_size=4, available_bytes=available, headroom=0.5, unit_mb=0)[
            1
        ]
    )
    table = plan.explain().splitlines()
    rows = {line.split()[0]: line for line in table[1:5]}
    over = format_bytes(t["ddp"] - available * 0.5)
    assert rows["ddp"].endswith(f"no (over by {over})")
    assert rows["zero1"].endswith("yes  <- chosen")
    assert rows["zero3"].endswith("yes") and format_bytes(t["zero3"]) in rows["zero3"]
    assert sum("<- chosen" in line for line in table) == 1
    assert "activations not counted (pass example_input)" in table[-2]
    assert table[-1] == f"chosen: {plan.reason}"


def test_plan_strategy_prices_recomputation_when_it_counts_activations() -> None:
    model = even_model()
    x = torch.randn(256, WIDTH)
    plan = plan_strategy(model, world_size=4, available_bytes=10**9, example_input=x, unit_mb=0)
    assert [(c.recompute, c.strategy) for c in plan.candidates] == [
        (policy, s) for policy in (None, "selective", "full") for s in FP32_ADAM
    ]
    for c in plan.candidates:
        alone = estimate_memory(
            model, world_size=4, strategy=c.strategy, example_input=x, unit_mb=0,
            recompute=c.recompute,
        )  # fmt: skip
        assert c.estimate.total == alone.total, c.name
    # Nothing to recompute without activations counted, or once the blocks recompute.
    assert {c.recompute for c in plan_strategy(model, world_size=4, unit_mb=0).candidates} == {None}
    recompute_blocks(model, "full")
    again = plan_strategy(model, world_size=4, available_bytes=10**9, example_input=x, unit_mb=0)
    assert [c.name for c in again.candidates] == list(FP32_ADAM)


def _saved_by_a_real_forward(model: nn.Module, args: tuple, inside: nn.Module | None = None) -> int:
    """Bytes autograd saves in a real CPU forward (storages once, parameters not); when
    ``inside`` is given, only those saved while it runs, its inputs not."""
    params = {id(p) for p in model.parameters()}
    saved: dict[int, tuple[torch.Tensor, int]] = {}
    running = [inside is None]

    def enter(_m: nn.Module, args: tuple) -> None:
        running[0] = True
        params.update(id(a) for a in args if isinstance(a, torch.Tensor))

    if inside is not None:
        inside.register_forward_pre_hook(enter)
        inside.register_forward_hook(lambda *_: running.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if running[0] and id(base) not in params and id(base) not in saved:
            saved[id(base)] = (base, base.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(n for _, n in saved.values())


def test_attention_and_recomputation_are_counted_as_a_real_forward_saves_them() -> None:
    """The meta-device count against a real CPU forward of the main job's GPT: attention as
    its fused kernel saves it (no attention weights), and under full recomputation the
    largest block's tensors, made again in backward, in ``recomputed``."""
    from shardline.examples.model import Config, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(Config(d_model=128, num_layers=2, num_heads=4, seq_len=64))
    x, y = torch.randint(0, 256, (2, 8, 64))
    real = _saved_by_a_real_forward(model, (x, y))
    plain = estimate_memory(model, world_size=1, strategy="ddp", example_input=(x, y))
    assert plain.activations == real and plain.recomputed == 0
    block = model.blocks[0]
    full = estimate_memory(
        model, world_size=1, strategy="ddp", example_input=(x, y), recompute="full"
    )
    assert full.recomputed == _saved_by_a_real_forward(model, (x, y), inside=block)
    assert full.total == full.persistent + full.activations + full.recomputed


def test_available_memory_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    monkeypatch.setattr(memory_available, "_MEMINFO", str(meminfo))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert available_memory("cpu") == 8_000_000 * 1024
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert available_memory(torch.device("cpu")) == 2_000_000 * 1024
    monkeypatch.setattr(memory_available, "_MEMINFO", str(tmp_path / "missing"))
    assert available_memory("cpu") > 0  # os.sysconf
    chosen, reason, _ = choose_strategy(even_model(), world_size=2, device="cpu")
    assert chosen == "ddp" and "available" in reason
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(InvalidArgumentError, match="LOCAL_WORLD_SIZE"):
        available_memory("cpu")
    with pytest.raises(InvalidArgumentError, match="cpu and cuda"):
        available_memory("meta")


def test_bad_arguments_name_the_choices() -> None:
    model = even_model()
    with pytest.raises(InvalidArgumentError, match="ddp, zero1, zero2, zero3, fsdp"):
        estimate_memory(model, world_size=2, strategy="zero4")
    with pytest.raises(InvalidArgumentError, match="adamw, adam, sgd, sgd-momentum"):
        estimate_memory(model, world_size=2, optimizer="lion")
    with pytest.raises(InvalidArgumentError, match="SGD, Adam"):
        optimizer_states(torch.optim.LBFGS([nn.Parameter(torch.zeros(1))]))
    for bad in [0, -1, 1.5, True]:
        with pytest.raises(InvalidArgumentError, match="world_size"):
            estimate_memory(model, world_size=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="world_size"):
            choose_strategy(model, world_size=bad, available_bytes=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="headroom"):
        choose_strategy(model, world_size=2, available_bytes=1, headroom=0)
    with pytest.raises(InvalidArgumentError, match="prefetch"):
        estimate_memory(model, world_size=2, prefetch=-1)
    with pytest.raises(ValueError, match="unknown optimizer"):  # also a ValueError
        choose_strategy(model, world_size=2, available_bytes=1, optimizer="nope")


def test_the_peak_is_in_backward_in_the_step_or_as_the_forward_begins() -> None:
    """fp32 AdamW on 2 ranks, each byte counted by hand: the peak's parts as they are alive."""
    model, n = even_model(), 2
    psi, unit = numel(model), WIDTH * WIDTH

    def est(strategy: str, rows: int | None) -> MemoryEstimate:
        x = torch.zeros(rows, WIDTH) if rows else None
        return estimate_memory(model, world_size=n, strategy=strategy, example_input=x, unit_mb=0)

    acts = LAYERS * 256 * WIDTH * 4  # each layer's input, 256 rows: 512 KiB
    zero3_buffers = 2 * 4 * unit + FLATS * 4 * unit  # 2 gathered units, gradient flats
    # zero3's shard gradients (4 psi / N, 64 KiB) are made as backward frees the activations:
    # the peak holds the parameters and optimizer states beside the activations alone.
    big = est("zero3", 256)
    assert big.activations == acts
    assert big.total == 12 * psi // n + zero3_buffers + acts
    assert "the peak, in backward" in str(big)
    # 8 rows (16 KiB of activations): the gradients outgrow what backward frees.
    assert est("zero3", 8).total == 16 * psi // n + zero3_buffers
    # zero1 holds its full gradients through the forward: they add to the activations. Its
    # re-gather inputs (a copy of each shard) are freed as their units first run: not beside
    # the activations, but at the forward's start, the peak when the activations are small.
    zero1 = est("zero1", 256)
    assert zero1.total == 8 * psi + 8 * psi // n + acts
    assert "the peak, in backward" in str(zero1)
    small = est("zero1", 8)
    assert small.total == small.forward_peak == 8 * psi + 8 * psi // n + 4 * psi // n
    assert "the peak, as the forward begins" in str(small)
    # Without activations DDP peaks in its step (no buffers): every gradient, and AdamW's
    # square roots of one parameter at a time on CPU.
    ddp = est("ddp", None)
    assert ddp.total == 16 * psi + 4 * unit
    assert "the peak, in the step" in str(ddp)


def _many_layers() -> nn.Module:
    with torch.device("meta"):  # 384 MiB of 1 MiB layers: nothing is allocated
        return nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(384)])


def test_a_plan_for_cuda_prices_cuda_units_and_a_foreach_step() -> None:
    model, n = _many_layers(), 2
    plan = plan_strategy(model, world_size=n, available_bytes=1 << 50, device="cuda")
    by_name = {c.name: c.estimate for c in plan.candidates}
    # The model is on meta, where the CPU default (1 MiB units) would apply: priced as ZeRO
    # lays it out on CUDA, 32 MiB units under offload.
    cuda_units = estimate_memory(
        model, world_size=n, strategy="zero3", offload="cpu", unit_mb=32, units="size"
    )
    on_meta = estimate_memory(model, world_size=n, strategy="zero3", offload="cpu")
    assert by_name["zero3 offload=cpu"].num_units == cuda_units.num_units == 12
    assert on_meta.num_units == 384
    # AdamW's foreach step on CUDA: one list of every master shard at once (fp32: 4 bytes);
    # none on the device under offload, where the host steps.
    shards = 4 * numel(model) // n
    assert by_name["zero2"].step_scratch == by_name["zero3"].step_scratch == shards
    assert by_name["ddp"].step_scratch == 4 * numel(model)
    assert by_name["zero3 offload=cpu"].step_scratch == 0


@pytest.mark.parametrize(
    ("make", "lists"),
    [
        (lambda ps: torch.optim.AdamW(ps, weight_decay=0.1), 1),  # decoupled: in place
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), 2),  # added to the gradients
        (lambda ps: torch.optim.AdamW(ps, fused=True), 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1), 1),
    ],
    ids=["adamw", "adam-weight-decay", "fused", "sgd-momentum", "sgd-weight-decay"],
)
def test_the_step_scratch_follows_the_optimizer(make, lists: int) -> None:
    model, n = _many_layers(), 2
    real = [nn.Parameter(torch.zeros(1))]
    plan = plan_strategy(
        model, world_size=n, available_bytes=1 << 50, device="cuda", optimizer=make(real)
    )
    zero3 = next(c.estimate for c in plan.candidates if c.name == "zero3")
    assert zero3.step_scratch == lists * 4 * numel(model) // n
    one_at_a_time = torch.optim.AdamW(real, foreach=False)
    e = estimate_memory(model, world_size=n, strategy="zero3", optimizer=one_at_a_time)
    assert e.step_scratch == 4 * 512 * 512 // n  # the largest parameter's shard
