"""Quantising compressors: int8, fp8 and 1-bit (sign) values with a float32 scale per block.

Reducing a quantised buffer cannot be a plain all-reduce (the sum of int8 values overflows,
and ranks use different scales), so the reduction runs in two compressed phases, each with its
own error feedback, as 1-bit Adam's does:

1. **reduce-scatter**: each rank adds its residual, splits the buffer into one chunk per rank,
   quantises the chunks and sends chunk ``j`` to rank ``j`` (one ``all_to_all``). Rank ``j``
   decodes the ``n`` versions of its chunk and sums them in float32. The worker residual is
   what quantisation dropped. ZeRO-2/3 stop here.
2. **all-gather** (all-reduce only): each rank adds its *server* residual to its summed chunk,
   quantises it once and all-gathers the codes; every rank decodes the same bytes, so replicas
   stay identical.

Bytes per rank and step, for ``N`` float32 values on ``n`` ranks, compared with a ring
all-reduce's ``8 N (n-1)/n``: int8 and fp8 send about ``2 N (n-1)/n`` (4x fewer), 1-bit about
``N (n-1)/(4n)`` (28x fewer with the default blocks).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F

from shardline import _native
from shardline.comm.group import ProcessGroup
from shardline.compression.codec import Compressor, Entries, Entry, Finish
from shardline.errors import InvalidArgumentError

__all__ = ["FP8", "Cast", "Int8", "OneBit", "Quantizer"]

_TINY = 1e-30


class Quantizer(Compressor):
    """A block codec plus the two-phase compressed reduction (see the module docstring).

    Subclasses define ``bits`` (per value), ``encode_blocks`` and ``decode_blocks``.

    Args:
        block: Values per float32 scale (a multiple of 8).
        warmup_steps: Uncompressed steps first.
        error_feedback: Keep what quantisation dropped (both phases).
    """

    bits = 8

    def __init__(
        self, *, block: int = 256, warmup_steps: int = 2, error_feedback: bool = True
    ) -> None:
        if block <= 0 or block % 8:
            raise InvalidArgumentError(
                f"{self.name}: block must be a positive multiple of 8, not {block}"
            )
        super().__init__(warmup_steps=warmup_steps, error_feedback=error_feedback)
        self.block = int(block)
        self._servers: dict[Hashable, tuple[Entries, torch.Tensor]] = {}
        self._server_at: dict[Hashable, tuple[int, int]] = {}  # key -> (rank, chunk)
        self._server_pending: dict[str, torch.Tensor] = {}  # loaded, by parameter name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block})"

    # -- the codec -----------------------------------------------------------------------------

    def code_bytes(self, length: int) -> int:
        """Bytes of one encoded row of ``length`` values (a multiple of ``block``)."""
        return length * self.bits // 8 + 4 * (length // self.block)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``(r, L)`` float32, ``L`` a multiple of ``block`` -> ``(r, code_bytes(L))`` uint8."""
        r, length = rows.shape
        blocks = rows.reshape(r, length // self.block, self.block)
        codes, scales = self.encode_blocks(blocks)
        return torch.cat(
            [codes.reshape(r, -1), scales.contiguous().view(torch.uint8).reshape(r, -1)], 1
        )

    def decode(self, codes: torch.Tensor, length: int) -> torch.Tensor:
        """The inverse of ``encode``: ``(r, code_bytes(length))`` -> ``(r, length)`` float32."""
        r = codes.shape[0]
        nb = length // self.block
        body = codes[:, : length * self.bits // 8].reshape(r, nb, self.block * self.bits // 8)
        scales = codes[:, length * self.bits // 8 :].contiguous().view(torch.float32).reshape(r, nb)
        return self.decode_blocks(body, scales).reshape(r, length)

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(r, nb, block)`` float32 -> uint8 codes (``block*bits/8`` per block), scales."""
        raise NotImplementedError

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The inverse of ``encode_blocks``: ``(r, nb, block)`` float32."""
        raise NotImplementedError

    def encode_chunks(
        self, flat: torch.Tensor, res: torch.Tensor | None, n: int, chunk: int, length: int
    ) -> torch.Tensor:
        """``flat + res`` as ``n`` encoded rows: ``chunk`` values each, zero-padded to ``length``.

        ``res`` (when given) is left holding what the encoding dropped.
        """
        numel = flat.numel()
        padded = length != chunk or n * chunk != numel
        rows = (torch.zeros if padded else torch.empty)(
            n, length, dtype=torch.float32, device=flat.device
        )
        pieces = _pieces(n, chunk, numel)
        for r, (lo, hi) in enumerate(pieces):
            if res is None:
                rows[r, : hi - lo].copy_(flat[lo:hi])
            else:
                torch.add(flat[lo:hi], res[lo:hi], out=rows[r, : hi - lo])
        if res is None:
            return self.encode(rows)
        codes = self.encode_feedback(rows)
        for r, (lo, hi) in enumerate(pieces):
            res[lo:hi].copy_(rows[r, : hi - lo])
        return codes

    def encode_feedback(self, rows: torch.Tensor) -> torch.Tensor:
        """``encode(rows)``, leaving in ``rows`` what the encoding dropped (``rows - decoded``)."""
        codes = self.encode(rows)
        rows.sub_(self.decode(codes, rows.shape[1]))
        return codes

    def decode_into(self, codes: torch.Tensor, length: int, out: torch.Tensor) -> None:
        """``decode`` written into ``out`` (``(r, length)`` float32)."""
        out.copy_(self.decode(codes, length))

    def decode_sum(self, codes: torch.Tensor, length: int) -> torch.Tensor:
        """The sum of the decoded rows of ``codes``: ``(length,)`` float32."""
        return self.decode(codes, length).sum(0)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` for a 1-D tensor (padded to whole blocks and cut back)."""
        n = x.numel()
        length = -(-n // self.block) * self.block
        row = F.pad(x.float().reshape(1, -1), (0, length - n))
        return self.decode(self.encode(row), length).reshape(-1)[:n]

    # -- sizes ---------------------------------------------------------------------------------

    def memory_bytes(self, numel: int, world_size: int, *, sharded: bool) -> int:
        """The worker residual (whole gradient) plus, for an all-reduce, a chunk's server one."""
        if not self.error_feedback:
            return 0
        return 4 * numel + (0 if sharded else 4 * -(-numel // world_size))

    # -- the reduction -------------------------------------------------------------------------

    def _reduce(
        self,
        group: ProcessGroup,
        flat: torch.Tensor,
        key: Hashable,
        layout: Entries,
        out: torch.Tensor | None,
    ) -> Finish:
        n, numel = group.world_size, flat.numel()
        chunk = -(-numel // n)
        length = -(-chunk // self.block) * self.block  # a chunk, padded to whole blocks
        res = (
            self._buffer(key, "residual", numel, layout, flat.device)
            if self.error_feedback
            else None
        )
        codes = self.encode_chunks(flat, res, n, chunk, length)
        recv = torch.empty_like(codes)
        work = group.all_to_all(recv.view(-1), codes.view(-1), async_op=True)
        assert work is not None

        def finish() -> None:
            work.wait()
            mine = self.decode_sum(recv, length)  # this rank's chunk of the sum
            if out is not None:
                out.copy_(mine[: out.numel()])
                return
            self._all_gather_phase(group, flat, key, layout, mine, chunk, length)

        return finish

    def _all_gather_phase(
        self,
        group: ProcessGroup,
        flat: torch.Tensor,
        key: Hashable,
        layout: Entries,
        mine: torch.Tensor,
        chunk: int,
        length: int,
    ) -> None:
        n, numel = group.world_size, flat.numel()
        # Padding (past the chunk, or past the buffer's end) holds no value, nor residual.
        valid = max(0, min(chunk, numel - group.rank * chunk))
        mine[valid:].zero_()
        server = None
        if self.error_feedback:
            self._server_at[key] = (group.rank, chunk)
            server = self._server_residual(key, layout, length, flat.device)
        # One row: this chunk of the sum plus the server residual, which keeps what is dropped.
        code = self.encode_chunks(mine, server, 1, length, length)
        if server is not None:
            server[valid:].zero_()
        gathered = torch.empty(n, code.shape[1], dtype=torch.uint8, device=flat.device)
        group.all_gather(gathered.view(-1), code.view(-1))
        if flat.dtype == torch.float32 and length == chunk and n * chunk == numel:
            self.decode_into(gathered, length, flat.view(n, length))
            return
        decoded = self.decode(gathered, length)
        for r, (lo, hi) in enumerate(_pieces(n, chunk, numel)):
            flat[lo:hi].copy_(decoded[r, : hi - lo])

    def _server_residual(
        self, key: Hashable, layout: Entries, length: int, device: torch.device
    ) -> torch.Tensor:
        """The all-gather phase's residual of ``key`` (this rank's chunk).

        It starts from zero when the key's layout changes (its chunk holds other values), or
        from loaded values (``load_state_tensors``) for the parameters they name.
        """
        held = self._servers.get(key)
        if held is None or held[0] != layout or held[1].numel() != length:
            buf = torch.zeros(length, dtype=torch.float32, device=device)
            held = self._servers[key] = (layout, buf)
            for e, a, b, lo in self._chunk_pieces(key, layout):
                value = self._server_pending.pop(e.name, None)
                if value is not None:
                    buf[a - lo : b - lo] = value.reshape(-1)[a - e.offset : b - e.offset]
        return held[1]

    def _chunk_pieces(self, key: Hashable, layout: Entries) -> list[tuple[Entry, int, int, int]]:
        """Where this rank's chunk of ``key`` overlaps each tensor.

        As ``(entry, start, stop, chunk start)``, in buffer offsets.
        """
        rank, chunk = self._server_at[key]
        lo = rank * chunk
        out = []
        for e in layout:
            a, b = max(lo, e.offset), min(lo + chunk, e.offset + e.numel)
            if a < b:
                out.append((e, a, b, lo))
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The worker residuals (views), plus the all-gather phase's as ``server/<parameter>``.

        A server entry is a copy of the parameter's shape, zero outside this rank's chunk, so
        every rank has every key (one more value per parameter while it is saved).
        """
        out = super().state_tensors()
        if not self.error_feedback:
            return out
        server: dict[str, torch.Tensor] = {}
        for key, (layout, buf) in self._servers.items():
            for e, a, b, lo in self._chunk_pieces(key, layout):
                t = server.setdefault(e.name, torch.zeros(e.numel, device=buf.device))
                t[a - e.offset : b - e.offset] = buf[a - lo : b - lo]
        for name, (state, e) in sorted(self._where.items(), key=lambda kv: kv[0]):
            device = next(iter(state.flats.values())).device if state.flats else None
            value = server.get(name)
            if value is None:
                value = torch.zeros(e.numel, dtype=torch.float32, device=device)
            out[f"server/{name}"] = value.view(e.shape)
        return out

    def load_state_tensors(self, values: dict[str, torch.Tensor]) -> None:
        """As ``Compressor``'s; server residuals wait for their keys' first reduction."""
        rest = {}
        for k, v in values.items():
            if k.startswith("server/"):
                self._server_pending[k.removeprefix("server/")] = v.detach().clone()
            else:
                rest[k] = v
        self._servers.clear()
        self._server_at.clear()
        super().load_state_tensors(rest)

    def reset(self) -> None:
        """Drops residuals (both phases) and warms up again."""
        super().reset()
        self._servers.clear()
        self._server_at.clear()
        self._server_pending.clear()

    def held(self, key: Hashable, numel: int) -> torch.Tensor:
        """The worker residual plus the server residual of this rank's chunk, in place."""
        out = super().held(key, numel)
        at = self._server_at.get(key)
        if at is not None:
            rank, chunk = at
            lo = rank * chunk
            hi = min(numel, lo + chunk)
            if hi > lo:
                out[lo:hi] += self._servers[key][1][: hi - lo].to(out.device)
        return out


def _pieces(n: int, chunk: int, numel: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` of the ``n`` chunks of a buffer of ``numel`` (the last may be short)."""
    return [(min(numel, r * chunk), min(numel, (r + 1) * chunk)) for r in range(n)]


class Int8(Quantizer):
    """int8 values with a float32 scale (absolute maximum / 127) per block: 4x fewer bytes.

    Round-to-nearest: each value is within ``scale / 2`` of the original.
    """

    name = "int8"
    bits = 8

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled, rounded and clamped to [-127, 127]."""
        scale = blocks.abs().amax(-1).clamp_min(_TINY) / 127.0
        q = torch.round(blocks / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        return q.view(torch.uint8), scale

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Values times their block's scale."""
        return codes.view(torch.int8).float() * scales[..., None]


class FP8(Quantizer):
    """fp8 (e4m3) values with a float32 scale per block (absolute maximum -> 448): 4x fewer bytes.

    Each value keeps 3 mantissa bits: a relative error of at most 1/16 above fp8's subnormal
    range.
    """

    name = "fp8"
    bits = 8
    _MAX = 448.0

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled to e4m3's range and rounded to it."""
        scale = blocks.abs().amax(-1).clamp_min(_TINY) / self._MAX
        q = (blocks / scale[..., None]).clamp_(-self._MAX, self._MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8), scale

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Values times their block's scale."""
        return codes.view(torch.float8_e4m3fn).float() * scales[..., None]


_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


class OneBit(Quantizer):
    """The sign of each value (1 bit) and one float32 scale per block, the mean absolute value.

    With error feedback (on by default) this is 1-bit SGD's compression (Seide et al.), usable
    with any optimizer; ``OneBitAdam`` applies it to Adam's momentum instead. On CPU the codec
    runs in Rust (``shardline._native``): one pass encodes and leaves the residual, one decodes
    and sums the ranks' rows; elsewhere it runs as torch ops, with the same bytes.
    """

    name = "onebit"
    bits = 1

    @staticmethod
    def _native_ok(*tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def _encode_native(self, rows: torch.Tensor, feedback: bool) -> torch.Tensor:
        r, length = rows.shape
        codes = torch.empty(r, self.code_bytes(length), dtype=torch.uint8)
        _native.onebit_encode(rows, codes, length, self.block, feedback, torch.get_num_threads())
        return codes

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Signs and scales per row (in Rust on CPU)."""
        if not self._native_ok(rows) or rows.dtype != torch.float32:
            return super().encode(rows)
        return self._encode_native(rows, False)

    def encode_feedback(self, rows: torch.Tensor) -> torch.Tensor:
        """Encodes and leaves the residual in ``rows``, in one pass on CPU."""
        if not self._native_ok(rows) or rows.dtype != torch.float32:
            return super().encode_feedback(rows)
        return self._encode_native(rows, True)

    def encode_chunks(
        self, flat: torch.Tensor, res: torch.Tensor | None, n: int, chunk: int, length: int
    ) -> torch.Tensor:
        """One pass on CPU: no padded copy of ``flat`` is made."""
        tensors = (flat,) if res is None else (flat, res)
        if not self._native_ok(*tensors) or flat.dtype != torch.float32:
            return super().encode_chunks(flat, res, n, chunk, length)
        codes = torch.empty(n, self.code_bytes(length), dtype=torch.uint8)
        _native.onebit_encode_chunks(
            flat, res, codes, chunk, length, self.block, torch.get_num_threads()
        )
        return codes

    def decode(self, codes: torch.Tensor, length: int) -> torch.Tensor:
        """Every row decoded (in Rust on CPU)."""
        if not self._native_ok(codes):
            return super().decode(codes, length)
        out = torch.empty(codes.shape[0], length, dtype=torch.float32)
        _native.onebit_decode(codes, out, length, self.block, False, torch.get_num_threads())
        return out

    def decode_into(self, codes: torch.Tensor, length: int, out: torch.Tensor) -> None:
        """Every row decoded straight into ``out`` on CPU."""
        if not self._native_ok(codes, out):
            super().decode_into(codes, length, out)
            return
        _native.onebit_decode(codes, out, length, self.block, False, torch.get_num_threads())

    def decode_sum(self, codes: torch.Tensor, length: int) -> torch.Tensor:
        """The rows decoded and summed in one pass on CPU."""
        if not self._native_ok(codes):
            return super().decode_sum(codes, length)
        out = torch.empty(length, dtype=torch.float32)
        _native.onebit_decode(codes, out, length, self.block, True, torch.get_num_threads())
        return out

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Signs packed eight to a byte (most significant bit first)."""
        scale = blocks.abs().mean(-1)
        bits = (blocks >= 0).to(torch.uint8).reshape(*blocks.shape[:-1], -1, 8)
        packed = (bits << _SHIFTS.to(blocks.device)).sum(-1, dtype=torch.uint8)
        return packed, scale

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """+scale or -scale per value."""
        bits = (codes[..., None] >> _SHIFTS.to(codes.device)) & 1
        signs = bits.reshape(*codes.shape[:-1], -1).float().mul_(2).sub_(1)
        return signs * scales[..., None]


class Cast(Quantizer):
    """Values cast to ``torch.float16`` or ``torch.bfloat16``, no scales: half the bytes.

    Summed in float32 by each chunk's owner, so only the two casts round; with error feedback
    (the default) both roundings are fed back. ``comm_hook="bf16"`` is the same cast as one
    all-reduce, without error feedback.
    """

    bits = 16

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        warmup_steps: int = 0,
        error_feedback: bool = True,
    ) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise InvalidArgumentError(
                f"Cast: dtype must be torch.float16 or torch.bfloat16, not {dtype}"
            )
        self.name = str(dtype).removeprefix("torch.")
        super().__init__(block=8, warmup_steps=warmup_steps, error_feedback=error_feedback)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Cast({self.dtype})"

    def code_bytes(self, length: int) -> int:
        """Two bytes per value."""
        return 2 * length

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rounded to the narrow dtype, as bytes."""
        return rows.to(self.dtype).view(torch.uint8)

    def decode(self, codes: torch.Tensor, length: int) -> torch.Tensor:
        """Back to float32."""
        return codes.view(self.dtype).float().reshape(codes.shape[0], length)
