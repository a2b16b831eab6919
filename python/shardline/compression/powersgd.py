"""PowerSGD (Vogels et al., 2019): each gradient matrix sent as a rank-``r`` product.

For each parameter of at least two dimensions, seen as an ``a x b`` matrix ``M`` (gradient plus
residual), one step of power iteration with a warm-started ``Q`` (``b x r``):

1. ``P = M Q``; all-reduce every ``P`` of the buffer (and the uncompressed tensors) at once;
2. orthogonalise ``P`` (QR, on the tensor's device);
3. ``Q = M^T P``; all-reduce every ``Q``;
4. the update is ``P Q^T``; the residual is ``M - P Q^T / n`` (this rank's share of what the
   approximation missed), and ``Q`` is kept for the next step (warm start).

Because the all-reduce of ``P`` and ``Q`` is linear, ``P Q^T`` approximates the sum over
ranks. Tensors with fewer than two dimensions, and matrices that rank ``r`` would not shrink by
``min_compression_rate``, are all-reduced uncompressed in the first collective. At full rank
(``r = min(a, b)``) the result equals the dense all-reduce up to rounding.

Bytes per rank and step: ``r (a + b)`` float32 values per matrix instead of ``a b``. Under
ZeRO-2/3 every rank rebuilds the whole update and keeps its slice; the residual covers the
whole gradient (``sl.estimate_memory`` counts it).
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence

import torch

from shardline.comm.group import ProcessGroup
from shardline.compression.codec import Compressor, Entries, Entry, Finish
from shardline.errors import InvalidArgumentError

__all__ = ["PowerSGD"]


class PowerSGD(Compressor):
    """Low-rank compression of each gradient matrix, with error feedback and warm start.

    Args:
        rank: The approximation's rank ``r`` (torch's ``matrix_approximation_rank``).
        min_compression_rate: Compress a matrix only if ``a b >= rate * r (a + b)``.
        warm_start: Reuse last step's ``Q`` (else a fresh random one each step).
        warmup_steps: Uncompressed steps first (torch's ``start_powerSGD_iter``).
        error_feedback: Keep what the approximation missed for the next step.
        seed: Seeds the initial ``Q`` (the same on every rank).
    """

    name = "powersgd"

    def __init__(
        self,
        rank: int = 4,
        *,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        warmup_steps: int = 2,
        error_feedback: bool = True,
        seed: int = 0,
    ) -> None:
        if rank < 1:
            raise InvalidArgumentError(f"PowerSGD: rank must be >= 1, not {rank}")
        super().__init__(warmup_steps=warmup_steps, error_feedback=error_feedback)
        self.rank = int(rank)
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = bool(warm_start)
        self.seed = int(seed)
        self._fresh = 0  # draws of a fresh Q without warm start

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank})"

    def _shape(self, e: Entry) -> tuple[int, int, int] | None:
        """``(a, b, r)`` if ``e`` is compressed, else ``None``."""
        if len(e.shape) < 2:
            return None
        a = e.shape[0]
        b = e.numel // a if a else 0
        r = min(self.rank, a, b)
        if r == 0 or a * b < self.min_compression_rate * r * (a + b):
            return None
        return a, b, r

    def prepare(
        self, key: Hashable, layout: Sequence[Entry], numel: int, device: torch.device
    ) -> None:
        """The residual and each compressed matrix's ``Q``."""
        super().prepare(key, layout, numel, device)
        for e in layout:
            shape = self._shape(e)
            if shape is not None:
                self._q(e, shape[1], shape[2], device)

    def _q(self, e: Entry, b: int, r: int, device: torch.device) -> torch.Tensor:
        qs = self._per_name.setdefault("q", {})
        q = qs.get(e.name)
        if q is not None and q.shape == (b, r) and self.warm_start:
            return q
        loaded = self._pending.get("q", {}).pop(e.name, None)
        if loaded is not None and loaded.shape == (b, r) and self.warm_start:
            q = loaded.to(device)
        else:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(e.name.encode()) + self._fresh)
            q = torch.randn(b, r, generator=gen).to(device)
        qs[e.name] = q
        return q

    def _reduce(
        self,
        group: ProcessGroup,
        flat: torch.Tensor,
        key: Hashable,
        layout: Entries,
        out: torch.Tensor | None,
    ) -> Finish:
        n, numel, device = group.world_size, flat.numel(), flat.device
        m, res = self._plus_residual(flat, key, layout)
        if not self.warm_start:
            self._fresh += 1
        mats: list[tuple[Entry, int, int, int]] = []
        dense = torch.ones(numel, dtype=torch.bool, device=device)
        for e in layout:
            shape = self._shape(e)
            if shape is not None:
                mats.append((e, *shape))
                dense[e.offset : e.offset + e.numel] = False
        plain_idx = dense.nonzero().reshape(-1)
        sizes_p = [a * r for _, a, _, r in mats]
        p_buf = torch.empty(sum(sizes_p) + plain_idx.numel(), dtype=torch.float32, device=device)
        start = 0
        for (e, a, b, r), size in zip(mats, sizes_p, strict=True):
            mat = m[e.offset : e.offset + e.numel].view(a, b)
            torch.matmul(mat, self._q(e, b, r, device), out=p_buf[start : start + size].view(a, r))
            start += size
        p_buf[start:] = m[plain_idx]
        work = group.all_reduce(p_buf, "sum", async_op=True)
        assert work is not None

        def finish() -> None:
            work.wait()
            update = torch.empty(numel, dtype=torch.float32, device=device)
            update[plain_idx] = p_buf[start:]
            ps, q_parts, s = [], [], 0
            for (e, a, b, r), size in zip(mats, sizes_p, strict=True):
                p = torch.linalg.qr(p_buf[s : s + size].view(a, r)).Q
                ps.append(p)
                q_parts.append(m[e.offset : e.offset + e.numel].view(a, b).t() @ p)
                s += size
            if mats:
                q_buf = torch.cat([q.reshape(-1) for q in q_parts])
                group.all_reduce(q_buf, "sum")
                s = 0
                qs = self._per_name.setdefault("q", {})
                for (e, a, b, r), p in zip(mats, ps, strict=True):
                    q = q_buf[s : s + b * r].view(b, r)
                    s += b * r
                    torch.matmul(p, q.t(), out=update[e.offset : e.offset + e.numel].view(a, b))
                    qs[e.name] = q
            if res is not None:  # sent exactly where uncompressed: nothing left there
                torch.sub(m, update, alpha=1.0 / n, out=res)
                res[plain_idx] = 0.0
            if out is None:
                flat.copy_(update)
            else:
                size = out.numel()
                out.copy_(update[group.rank * size : (group.rank + 1) * size])

        return finish
