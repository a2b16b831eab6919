"""What ``estimate_memory`` returns: bytes per rank by component, printed as a table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MemoryEstimate", "format_bytes"]

_COMPONENTS = ("params", "grads", "master", "optimizer")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for a strategy; ``str()`` prints a table.

    Attributes:
        strategy: The strategy estimated (``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp``).
        world_size: Ranks the model is spread over (N).
        params: Parameters held between steps (full, or this rank's shard).
        grads: Gradients held between steps (full flats, shard flats, or both).
        master: The higher-precision copy of this rank's shard, when it is not a view.
        optimizer: Optimizer states of this rank's shard (full for DDP).
        comm_buffers: Peak transient communication buffers in backward (gathered units,
            gradient flats).
        regather: ZeRO-1/2's all-gather inputs after a step: a compute-dtype copy of every
            shard, made as the next forward begins; each is freed when its unit's modules
            first run, before the activations they make, so they count at the forward's start
            (``forward_peak``), not in backward.
        compression: A gradient compressor's state (error-feedback residuals, PowerSGD's
            factors): under ZeRO-2/3 a residual still covers this rank's whole gradient.
        host: Host memory per rank under offload (master shard, its gradient, optimizer
            states); not part of ``persistent`` or ``total``, which count the device.
        offload: The ZeRO ``offload`` estimated (``"optimizer"``, ``"cpu"``) or ``None``.
        activations: Tensors saved for backward by one forward of ``example_input``.
        recomputed: What recomputing blocks make again in backward: the largest block call's
            tensors, alive while its backward runs (0 without recomputation).
        step_scratch: What the optimizer's step allocates while it runs, with every gradient
            alive: a foreach step (torch's default on CUDA) makes whole lists the size of
            the parameters it updates (Adam's square roots of its second moments); a step
            one parameter at a time, the largest parameter's.
        grads_in_backward: Whether the gradients are made in backward and dropped by
            ``zero_grad()`` (ZeRO-2/3, whose shard gradients are freed until backward needs
            them, unless ``zero_grad(set_to_none=False)`` zeroed them): they are then not
            alive with the forward's activations. Not so for a pipeline's stages, nor across
            the micro-batches of gradient accumulation (``no_sync``), which hold them.
        num_params: Parameters of the model (Ψ, unpadded, each shared tensor once).
        num_units: Sharding units the model was grouped into.
        optimizer_states: States per parameter (k).
        activations_estimated: Whether ``activations`` was measured (needs an example input).
        formulas: ``(component, bytes per parameter)`` with ``N`` for the world size, such as
            ``("optimizer", "8/N")``; empty strings where unit dtypes differ.
        notes: Caveats, one sentence each.
    """

    strategy: str
    world_size: int
    params: int
    grads: int
    master: int
    optimizer: int
    comm_buffers: int
    activations: int
    num_params: int
    num_units: int = 0
    optimizer_states: int = 0
    activations_estimated: bool = False
    formulas: tuple[tuple[str, str], ...] = field(default=())
    notes: tuple[str, ...] = field(default=())
    compression: int = 0
    host: int = 0
    offload: str | None = None
    recomputed: int = 0
    step_scratch: int = 0
    grads_in_backward: bool = False
    regather: int = 0

    @property
    def persistent(self) -> int:
        """Bytes held between steps: params + grads + master + optimizer + compression."""
        return self.params + self.grads + self.master + self.optimizer + self.compression

    @property
    def backward_peak(self) -> int:
        """The most bytes from the forward to the end of backward.

        The state, the communication buffers, the activations and what is recomputed.
        Gradients made in backward (``grads_in_backward``) take the place of the activations
        backward frees as it goes: the two count as the larger of them.
        """
        held = self.persistent + self.comm_buffers + self.recomputed
        if self.grads_in_backward:
            return held - self.grads + max(self.activations, self.grads)
        return held + self.activations

    @property
    def step_peak(self) -> int:
        """The most bytes in the optimizer's step: the state, every gradient, its scratch."""
        return self.persistent + self.step_scratch

    @property
    def forward_peak(self) -> int:
        """The most bytes as a forward begins: the state and ZeRO-1/2's re-gather inputs."""
        return self.persistent + self.regather

    @property
    def total(self) -> int:
        """Peak bytes per rank: the largest of the forward's, backward's and the step's peaks."""
        return max(self.forward_peak, self.backward_peak, self.step_peak)

    @property
    def bytes_per_param(self) -> float:
        """Persistent bytes per model parameter (16 for fp32 Adam under DDP)."""
        return self.persistent / self.num_params if self.num_params else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every field plus ``persistent``, ``total`` and ``bytes_per_param``."""
        out = asdict(self)
        out["formulas"] = dict(self.formulas)
        out["notes"] = list(self.notes)
        out.update(
            persistent=self.persistent,
            forward_peak=self.forward_peak,
            backward_peak=self.backward_peak,
            step_peak=self.step_peak,
            total=self.total,
            bytes_per_param=self.bytes_per_param,
        )
        return out

    def __str__(self) -> str:
        formulas = dict(self.formulas)
        n = self.world_size
        head = (
            f"{self.strategy}{f' (offload={self.offload})' if self.offload else ''} on N={n} "
            f"rank{'s' if n != 1 else ''}: {self.num_params:,} params "
            f"in {self.num_units} units, k={self.optimizer_states} optimizer states (per rank)"
        )
        rows = [head, f"  {'component':<14}{'bytes':>12}   bytes/param"]

        def row(name: str, nbytes: int, per_param: str) -> None:
            rows.append(f"  {name:<14}{format_bytes(nbytes, 2):>12}   {per_param}".rstrip())

        def per_param(name: str, nbytes: int) -> str:
            value = f"{nbytes / self.num_params:.2f}" if self.num_params else "-"
            formula = formulas.get(name, "")
            return f"{formula} = {value}" if "N" in formula else value

        for name in _COMPONENTS:
            row(name, getattr(self, name), per_param(name, getattr(self, name)))
        if self.compression:
            row("compression", self.compression, per_param("compression", self.compression))
        row("persistent", self.persistent, per_param("persistent", self.persistent))
        row("comm buffers", self.comm_buffers, "transient, in backward")
        if self.regather:
            row("re-gather", self.regather, "transient, as the forward begins")
        act = "one forward of the example input" if self.activations_estimated else "not estimated"
        row("activations", self.activations, act)
        if self.recomputed:
            row("recomputed", self.recomputed, "one block's, in backward")
        if self.step_scratch:
            row("step scratch", self.step_scratch, "the optimizer's step")
        peak = max(
            (self.backward_peak, "in backward"),
            (self.step_peak, "in the step"),
            (self.forward_peak, "as the forward begins"),
            key=lambda pair: pair[0],
        )[1]
        row("total", self.total, f"the peak, {peak}")
        if self.host:
            row("host (offload)", self.host, per_param("host", self.host))
        rows += [f"  note: {note}" for note in self.notes]
        return "\n".join(rows)


def format_bytes(nbytes: float, digits: int = 1) -> str:
    """``1288490188`` -> ``"1.2 GiB"``: bytes in the largest binary unit below the value."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{int(nbytes)} B"
