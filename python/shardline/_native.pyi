"""Type stubs for shardline._native, the Rust collective engine (PyO3)."""

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeAlias, TypedDict, final, type_check_only

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

__version__: str
__all__ = [
    "Group",
    "Listener",
    "ShardReader",
    "SymmetricSegment",
    "Work",
    "__version__",
    "adam_step",
    "arena_create",
    "arena_sweep",
    "arena_unlink",
    "onebit_decode",
    "onebit_encode",
    "onebit_encode_chunks",
    "sgd_step",
    "symmetric_create",
    "symmetric_register",
    "symmetric_unlink",
    "write_shard",
]

@type_check_only
class _CpuTensor(Protocol):
    """A contiguous CPU torch tensor, as the engine sees it (Rust never imports torch)."""

    @property
    def is_cpu(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    def is_contiguous(self) -> bool: ...
    def data_ptr(self) -> int: ...

@type_check_only
class _NumpyArray(Protocol):
    """A numpy array: a buffer-protocol object, typed apart because numpy's stubs declare
    ``__buffer__`` only for Python 3.12+."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...

_Memory: TypeAlias = Buffer | _CpuTensor | _NumpyArray
"""_Memory an op reads or writes in place: a buffer-protocol object or a CPU tensor."""

@final
class Listener:
    """A bound TCP listener for incoming peer connections of one communicator."""

    def __new__(cls, host: str = "127.0.0.1") -> Listener: ...
    @property
    def address(self) -> str:
        """``"ip:port"`` to publish at rendezvous."""

def arena_create(path: str, num_ranks: int, slot_bytes: int) -> None:
    """Creates a shared-memory arena file (O_EXCL, mode 0600) for ``num_ranks`` local ranks."""

def arena_unlink(path: str) -> None:
    """Removes the arena's name; mapped ranks keep using it."""

def arena_sweep(directory: str = "/dev/shm") -> int:
    """Removes arena files left by dead processes; returns how many were removed."""

@final
class SymmetricSegment:
    """One rank's segment of a symmetric allocation; while it lives, so does the mapping."""

    @property
    def address(self) -> int:
        """Address of the mapping."""
    @property
    def nbytes(self) -> int:
        """Length in bytes."""
    @property
    def index(self) -> int:
        """The allocation's index in its group (the same on every rank)."""

def symmetric_create(path: str, nbytes: int) -> None:
    """Creates this rank's segment file (O_EXCL, mode 0600, zero-filled) of ``nbytes``."""

def symmetric_unlink(path: str) -> None:
    """Removes a segment file's name; ranks that mapped it keep it."""

def symmetric_register(group: Group, paths: list[str], nbytes: int) -> SymmetricSegment:
    """Maps every rank's segment file of one allocation (``paths`` by group rank) into
    ``group``'s collectives; this rank's segment."""

def symmetric_release(group: Group, index: int) -> None:
    """Forgets allocation ``index`` of ``group`` on this rank (its mappings of the peers')."""

@final
class Work:
    """A collective in flight."""

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done (raises the op's error); ``timeout`` in seconds."""

    def is_completed(self) -> bool: ...
    @property
    def source(self) -> int | None:
        """The rank a finished receive took its message from (``None`` for other ops, and
        for a receive that has not finished or failed)."""

@final
class Group:
    """A communicator: shared memory among ranks on one host, TCP between hosts.

    Buffers are writable, C-contiguous buffer-protocol objects of format ``'B'`` (uint8),
    e.g. ``tensor.view(torch.uint8).numpy()``; ``dtype`` names their element type
    (``"float32"``, ``"bfloat16"``, ...). The caller keeps them alive until the Work is done.
    """

    def __new__(
        cls,
        rank: int,
        world_size: int,
        *,
        name: str,
        secret: bytes,
        host_ids: Sequence[str],
        addrs: Sequence[str],
        listener: Listener | None,
        arena_path: str | None,
        timeout: float,
        machine_ranks: int | None = None,
        comm_threads: int = 1,
        comm_threads_min_bytes: int | None = None,
        spin_us: int | None = None,
        stream_stores: str | None = None,
        oneshot_bytes: int | None = None,
        keepalive: float | None = None,
        cancel: Callable[[], object] | None = None,
    ) -> Group:
        """``machine_ranks``: ranks of the job on this machine whatever their host ids say
        (default ``world_size``); TCP waits spin briefly only while each has a core.
        ``comm_threads``: threads per rank for the memory passes of blocking shared-memory ops of at
        least ``comm_threads_min_bytes`` (default 1 MiB); 1 for none.

        The engine reads no environment; these settings (``shardline.config``) arrive as
        arguments, ``None`` keeping the engine's default:

        - ``spin_us``: how long shared-memory and TCP waits spin before they sleep while every
          rank has a core (``SHARDLINE_SPIN_US``, default 50; 2 when ranks outnumber cores).
        - ``stream_stores``: ``"0"``, ``"1"`` or ``"2"`` (``SHARDLINE_STREAM_STORES``, default
          ``"2"``): which copies into shared memory use streaming stores.
        - ``oneshot_bytes``: all-reduces up to this size run in one shot on shared memory
          (``SHARDLINE_ONESHOT_BYTES``; default: measured on the group's ranks by its first
          all-reduce, at most 262144, or 262144 when the machine's ranks outnumber its cores).
        - ``keepalive``: seconds after which a TCP peer whose host stopped acknowledging is
          lost, whatever the op deadline (``SHARDLINE_KEEPALIVE``, default 30; 0: the
          kernel's defaults).

        ``cancel``, if given, is called about every 200 ms while the TCP mesh is linked; the
        exception it raises (another rank failed while joining) ends the setup and is raised
        here.

        Raises:
            InvalidArgumentError: A bad setting (a negative count, an unknown streaming mode,
                a non-positive timeout) or an inconsistent group description.
        """
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def transport(self) -> str:
        """``"single"``, ``"shm"``, ``"tcp"`` or ``"hierarchical"``."""
    @property
    def oneshot_bytes(self) -> int | None:
        """All-reduces on shared memory up to this many bytes are one-shot, larger ones
        two-phase: as set, else as the group's first all-reduce measured (the default before
        it). ``None``: no other rank of the group on this host. Waits for an op in progress."""

    def all_reduce(
        self, buf: _Memory, dtype: str, op: str = "sum", async_op: bool = False
    ) -> Work: ...
    def reduce_scatter(
        self, out: _Memory, inp: _Memory, dtype: str, op: str = "sum", async_op: bool = False
    ) -> Work: ...
    def all_gather(
        self,
        out: _Memory,
        inp: _Memory,
        dtype: str,
        counts: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Work:
        """``counts``: element count of every rank's input, for unequal sizes."""

    def broadcast(self, buf: _Memory, dtype: str, root: int, async_op: bool = False) -> Work: ...
    def reduce(
        self, buf: _Memory, dtype: str, op: str = "sum", root: int = 0, async_op: bool = False
    ) -> Work: ...
    def gather(
        self, out: _Memory | None, inp: _Memory, dtype: str, root: int = 0, async_op: bool = False
    ) -> Work: ...
    def scatter(
        self, out: _Memory, inp: _Memory | None, dtype: str, root: int = 0, async_op: bool = False
    ) -> Work: ...
    def all_to_all(
        self, out: _Memory, inp: _Memory, dtype: str, async_op: bool = False
    ) -> Work: ...
    def barrier(self, async_op: bool = False) -> Work: ...
    def send(
        self, buf: _Memory, dtype: str, dst: int, async_op: bool = False, tag: int = 0
    ) -> Work: ...
    def recv(
        self, buf: _Memory, dtype: str, src: int | None, async_op: bool = False, tag: int = 0
    ) -> Work:
        """Receives the next message tagged ``tag`` from ``src``, or from any rank when
        ``src`` is ``None``; the Work's ``source`` says which rank it came from."""
    def abort(self, reason: str) -> None:
        """Fails every pending and future op here and on every peer with ``reason``."""

    def close(self) -> None:
        """Waits for queued ops, then releases the transport; later calls raise."""

# Checkpoint shard files: one per rank, safetensors-compatible when uncompressed.

_ShardTensor: TypeAlias = tuple[str, str, Sequence[int], _Memory]
"""``(name, dtype, shape, data)``: dtype a safetensors name (``"F32"``, ``"BF16"``, ``"F8_E4M3"``,
...); ``data`` C-contiguous bytes of ``prod(shape) * itemsize`` bytes."""

@type_check_only
class _ShardTensorInfo(TypedDict):
    dtype: str
    shape: list[int]
    offset: int
    raw_bytes: int
    stored_bytes: int
    compressed: bool

@type_check_only
class _ShardHeader(TypedDict):
    metadata: dict[str, str]
    tensors: dict[str, _ShardTensorInfo]

def write_shard(
    path: str,
    tensors: Iterable[_ShardTensor],
    metadata: Mapping[str, str],
    compress: int | None = None,
    chunk_bytes: int = 4194304,
    threads: int = 0,
) -> dict[str, Any]:
    """Writes one shard file from the callers' buffers (zero copy, GIL released) and fsyncs it.

    Args:
        path: The file to create (replaced if it exists; removed again on failure).
        tensors: ``(name, dtype, shape, data)`` tuples, laid out in this order.
        metadata: Strings stored in the safetensors ``__metadata__`` (key ``"shardline"`` is
            reserved for the checksums).
        compress: ``None`` writes a valid safetensors file; a zstd level writes every tensor
            as ``chunk_bytes`` zstd frames (floats byte-shuffled when that compresses better),
            listed with dtype ``SHARDLINE_ZSTD`` so plain safetensors readers refuse the file.
        chunk_bytes: Checksum chunk and compression frame size (4 MiB = ``4 << 20``).
        threads: Compression threads; 0 = all cores.

    Returns:
        ``{name: {"offset", "stored_bytes", "raw_bytes", "crc32c"}}`` (offset absolute, one
        CRC32C per raw chunk) plus ``"__file__": {"bytes", "header_bytes"}``.

    Raises:
        InvalidArgumentError: A buffer's size does not match its shape and dtype, an unknown
            dtype, a duplicate or reserved name, or a bad option.
        CheckpointError: The file could not be written.
    """

@final
class ShardReader:
    """One open shard file, like safetensors' ``safe_open``: mapped once, its header read and
    validated once, serving reads from any thread (each releases the GIL) until ``close()``.

    Use it as a context manager, or call ``close()``; a reader that is garbage collected is
    closed too. Reads in flight when another thread closes it finish first.

    Raises:
        CheckpointError: The file is missing, truncated or malformed (on opening).
    """

    def __new__(cls, path: str) -> ShardReader: ...
    @property
    def path(self) -> str:
        """The file's path."""

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""

    def header(self) -> _ShardHeader:
        """The validated header.

        Returns:
            ``{"metadata": {...}, "tensors": {name: {"dtype", "shape", "offset", "raw_bytes",
            "stored_bytes", "compressed"}}}``, tensors in file order; dtype and shape are the
            real ones for compressed tensors too.
        """

    def read_range(
        self, key: str, byte_offset: int, out_buffer: _Memory, verify: bool = True
    ) -> None:
        """Copies raw bytes ``[byte_offset, byte_offset + len(out_buffer))`` of tensor ``key``
        into ``out_buffer`` (writable, C-contiguous): decodes the frames the range touches (in
        parallel for large ranges) with the GIL released; with ``verify``, checks the CRC32C of
        every chunk or frame touched, whole.

        Raises:
            InvalidArgumentError: No such tensor, the range lies outside it, or the reader
                was closed.
            CheckpointError: A checksum fails or a frame does not decode (the message names
                the file, the tensor and the chunk).
        """

    def verify(self) -> None:
        """Checks every checksum of every tensor, on all cores.

        Raises:
            CheckpointError: The file has no checksums, or a checksum fails.
            InvalidArgumentError: The reader was closed.
        """

    def close(self) -> None:
        """Releases the file (unmaps it once reads in flight are done); later calls raise.
        Closing twice is allowed."""

    def __enter__(self) -> ShardReader: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

def onebit_encode(
    values: Any, codes: Any, length: int, block: int, feedback: bool, threads: int = 1
) -> None:
    """Encodes rows of ``length`` float32 values as signs plus a mean magnitude per block.

    ``codes`` (uint8) receives ``length / 8 + 4 * length / block`` bytes per row; with
    ``feedback``, ``values`` is left holding what the encoding dropped. Runs on ``threads``
    threads with the GIL released.

    Raises:
        InvalidArgumentError: Shapes that do not match, or buffers that share memory.
    """

def onebit_encode_chunks(
    values: Any,
    residual: Any | None,
    codes: Any,
    chunk: int,
    length: int,
    block: int,
    threads: int = 1,
) -> None:
    """Encodes ``values + residual`` cut into chunks of ``chunk`` values, each zero-padded to
    ``length``, as ``onebit_encode``'s rows, without a padded copy; ``residual`` (when given)
    is left holding what the encoding dropped.

    Raises:
        InvalidArgumentError: Shapes that do not match, or buffers that share memory.
    """

def onebit_decode(
    codes: Any, out: Any, length: int, block: int, sum: bool, threads: int = 1
) -> None:
    """Decodes ``onebit_encode``'s rows into ``out`` (float32): every row, or with ``sum`` their
    sum (``length`` values).

    Raises:
        InvalidArgumentError: Shapes that do not match, or buffers that share memory.
    """

def adam_step(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: int,
    threads: int = 1,
) -> None:
    """One Adam (AdamW with ``decoupled``) step of float32 ``param``; moments in place.

    Raises:
        InvalidArgumentError: Buffers of different lengths, shared or misaligned memory, or
            ``step`` 0.
    """

def sgd_step(
    param: Any,
    grad: Any,
    momentum_buffer: Any | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    first: bool,
    threads: int = 1,
) -> None:
    """One SGD step of float32 ``param``; the momentum buffer (needed with ``momentum``) starts
    as the gradient when ``first``.

    Raises:
        InvalidArgumentError: Buffers of different lengths, shared or misaligned memory, or
            momentum without a buffer.
    """

def unit_products(
    dys: Any,
    xs: Any,
    out: Any,
    units: int,
    rows: int,
    outs: int,
    ins: int,
    start: int,
    stop: int,
    tree: bool,
    threads: int = 1,
    lookups: tuple[Any, Any, Any] | None = None,
) -> None:
    """Rows ``start..stop`` of a linear layer's weight gradient for each unit, or their sum.

    ``dys`` (float32, ``units x rows x outs``) and ``xs`` (``units x rows x ins``) are the
    units' output gradients and inputs; ``out`` gets ``units x (stop - start) x ins`` values,
    or with ``tree`` their canonical tree sum over the units. On ``threads`` threads; the bits
    are the same for any number, and for any rows asked for. ``lookups`` (``tree`` only):
    ``(offsets, idx, dy)``, an embedding's lookups of the weight's rows (int64 ``units + 1``
    offsets into int64 ``idx``, float32 ``dy`` of ``len(idx) x ins``), each unit's added in
    order onto its product before the tree.
    """

def unit_row_sums(rows: Any, out: Any, units: int, features: int, threads: int = 1) -> None:
    """Per-unit sums over rows: float32 ``rows`` (``units`` units of rows of ``features``)
    into ``out`` (``units x features``), each feature adding its unit's rows in order."""

def unit_norm_backward(
    x: Any,
    mean: Any,
    rstd: Any,
    dy: Any,
    weight: Any | None,
    bias: Any | None,
    units: int,
    features: int,
    threads: int = 1,
    gamma: Any | None = None,
    dx: Any | None = None,
) -> None:
    """A layer norm's backward (float32; ``mean`` and ``rstd`` one per row): the per-unit sums,
    ``weight`` of ``((x - mean) * rstd) * dy`` and ``bias`` of ``dy`` over each unit's rows in
    order, and the input's gradient ``dx`` (``gamma``: the norm's weight, if it has one), in one
    pass over the rows; any output may be ``None``."""

def tree_sum(parts: Any, out: Any, units: int, threads: int = 1) -> None:
    """Sums the ``units`` rows of float32 ``parts`` into ``out`` in the canonical tree.

    On ``threads`` threads; the bits are the same for any number.
    """

# -- CUDA events through the loaded driver (the tracer's GPU times) --------------------------

def cuda_events_available() -> bool:
    """Whether this process has loaded a CUDA driver these functions can use."""

def cuda_event_create(device: int, timing: bool = True) -> int:
    """A new event of GPU ``device`` (its handle; kept for the process's life): one that keeps
    its time, or with ``timing=False`` one only to order work by."""

def cuda_event_query(device: int, event: int) -> bool:
    """Whether GPU ``device`` is past ``event``."""

def cuda_event_record(device: int, event: int, stream: int) -> None:
    """Records ``event`` on ``stream`` (a raw stream handle; 0: the default stream)."""

def cuda_stream_create(device: int) -> int:
    """A new stream of GPU ``device`` that does not wait on the default stream (its handle;
    kept for the process's life)."""

def cuda_stream_wait(device: int, stream: int, event: int) -> None:
    """Makes ``stream`` wait on the GPU until ``event`` is reached; the host does not wait."""

def cuda_events_fork(device: int, stream: int, side: int, start: int, sync: int) -> None:
    """Records ``start`` then ``sync`` on ``stream`` and makes ``side`` wait for ``sync`` (a
    traced op's way onto its group's stream), in one call."""

def cuda_events_record_pair(device: int, stream: int, first: int, second: int) -> None:
    """Records ``first`` then ``second`` on ``stream``, in one call."""

def cuda_events_elapsed(device: int, firsts: list[int], seconds: list[int]) -> list[float]:
    """Milliseconds from each first event to its second; NaN where there is none (a pair the
    GPU is not past yet). Reads with the GIL released."""

# -- the tracer's timeline ----------------------------------------------------------------------

def trace_ops_line(records: list[Any], spans: list[Any], dtypes: dict[Any, str]) -> bytes:
    """``{"k":"ops","r":[...]}`` and a newline, as UTF-8, for the flight recorder's
    ``records``, each with its device span (or ``None``) appended, dtypes named by
    ``dtypes``. ``ValueError`` for a value it does not write (a float that is not finite),
    ``TypeError`` for a record that is not a list."""
