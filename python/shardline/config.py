"""Every environment variable shardline reads: declared once here, read only through here.

Each ``SHARDLINE_*`` variable has one row in ``SETTINGS`` (name, what a value looks like,
default, meaning). Code reads a setting only through ``get(name)`` (or ``raw(name)`` for the
text as given), at the moment its API call starts (``init``, creating a group, ``save``), and
passes the value down as an argument: the Rust engine reads no environment. A bad value fails
with an ``InvalidArgumentError`` that names the variable, its value and what it should be.
``default_timeout()`` is ``SHARDLINE_TIMEOUT`` as seconds: the deadline of a group created
without a timeout (every other wait of a group takes that group's ``timeout``).

The variables launchers set (torchrun's, SLURM's: ``RANK``, ``MASTER_ADDR``, ``SLURM_PROCID``
...) are listed in ``LAUNCHER_VARIABLES`` and read through ``env_var(name)``, as set; the
code that reads one parses it and words its own errors. Every accessor takes an optional
``env`` mapping to read instead of ``os.environ`` (tests, a launcher's environment). A test
(``tests/test_config.py``) fails on any read of ``os.environ`` outside this module.

The docs' settings page (``docs/settings.md``) is the ``SETTINGS`` table
(``markdown_table()`` renders it; a test keeps the two equal).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, overload

from shardline.errors import InvalidArgumentError

__all__ = [
    "LAUNCHER_VARIABLES",
    "SETTINGS",
    "Setting",
    "default_timeout",
    "env_required",
    "env_var",
    "get",
    "markdown_table",
    "raw",
    "setting",
]

BACKENDS = ("native", "gloo", "nccl", "mpi")


class _Invalid(ValueError):
    """A parser's reason for refusing a value (the text after ``NAME='value'``)."""


# The largest values taken: past them the engine's and torch's clocks and integers overflow
# (a deadline of 1e10 s wrapped the store's clock; 2**63 microseconds overflowed a C long)
# and the program failed far from the setting, in words that did not name it. A second's
# thousandth is the least time: under it a timeout rounded to 0 ms.
_MAX_SECONDS = 1e9  # some 31 years
_MIN_SECONDS = 1e-3
_MAX_COUNT = 2**31 - 1
_MAX_BYTES = 2**48  # 256 TiB


def _integer(minimum: int, expect: str, maximum: int = _MAX_COUNT) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _Invalid(f"must be {expect}") from None
        if value < minimum:
            raise _Invalid(f"must be {expect}")
        if value > maximum:
            raise _Invalid(f"must be {expect}, at most {maximum}")
        return value

    return parse


def _float_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _Invalid("is not a number of seconds") from None


def _seconds(text: str) -> float:
    value = _float_seconds(text)
    if not value > 0:
        raise _Invalid("must be a positive number of seconds")
    if not _MIN_SECONDS <= value <= _MAX_SECONDS:
        raise _Invalid(f"must be a number of seconds from {_MIN_SECONDS:g} to {_MAX_SECONDS:g}")
    return value


def _seconds_or_off(text: str) -> float:
    value = _float_seconds(text)
    if not (value == 0 or _MIN_SECONDS <= value <= _MAX_SECONDS):
        raise _Invalid(
            f"must be a number of seconds from {_MIN_SECONDS:g} to {_MAX_SECONDS:g}, 0 for off"
        )
    return value


def _choice(choices: tuple[str, ...], noun: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.lower()
        if value not in choices:
            raise _Invalid(f"is not {noun}; use one of {', '.join(choices)}")
        return value

    return parse


def _device(text: str) -> str:
    value = text.lower()
    if value in ("cpu", "cuda"):
        return value
    if value.startswith("cuda:") and value[len("cuda:") :].isdigit():
        return value
    raise _Invalid("is not a device; use cpu, cuda or cuda:N")


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise _Invalid("must be 1 (on) or 0 (off)")
    return text == "1"


def _determinism(text: str) -> bool | str:
    if text.lower() in ("repeat", "microbatch"):
        return text.lower()
    if text not in ("0", "1"):
        raise _Invalid(
            "must be 1 (every layout), microbatch (every layout, per micro-batch), repeat "
            "(one layout, run after run) or 0 (off)"
        )
    return text == "1"


def _text(text: str) -> str:
    return text


@dataclass(frozen=True)
class Setting:
    """One ``SHARDLINE_*`` variable.

    Attributes:
        name: The variable.
        value: What a value looks like, as the settings page shows it.
        default: The default as the settings page shows it (``get`` returns ``parsed_default``).
        meaning: What it does.
        parse: Text to value; raises ``_Invalid`` with the reason.
        parsed_default: What ``get`` returns when the variable is unset or empty; ``None``
            where the caller decides (an automatic choice).
        strip: Whether surrounding blanks are ignored (not for secrets).
    """

    name: str
    value: str
    default: str
    meaning: str
    parse: Callable[[str], Any]
    parsed_default: Any = None
    strip: bool = True


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "SHARDLINE_SECRET",
        "any string",
        "unset",
        "The job secret every TCP connection proves (HMAC); the same on every rank. Required "
        "across hosts; `shardline run` makes one for a single node.",
        _text,
        strip=False,
    ),
    Setting(
        "SHARDLINE_INSECURE",
        "`1`",
        "unset",
        "Accept unauthenticated connections in a multi-host job without a secret.",
        _flag,
        False,
    ),
    Setting(
        "SHARDLINE_TIMEOUT",
        "seconds",
        "300",
        "Deadline of every blocking wait (collectives, rendezvous, checkpoint commits).",
        _seconds,
        300.0,
    ),
    Setting(
        "SHARDLINE_FLIGHT_OPS",
        "integer >= 0",
        "1000",
        "Ops the flight recorder keeps per process (0: off); written out on an op's failure "
        "or SIGUSR1, read by `shardline why`.",
        _integer(0, "an integer >= 0"),
        1000,
    ),
    Setting(
        "SHARDLINE_FLIGHT_DIR",
        "path",
        "`$TMPDIR/shardline-flight/<job>`",
        "Where the flight recorder writes `rank<r>.json`.",
        _text,
    ),
    Setting(
        "SHARDLINE_TRACE",
        "path",
        "off",
        "Where every rank writes its timeline (communication, steps, spans), its settings and "
        "a heartbeat; read by `shardline doctor` and `shardline trace merge`.",
        _text,
    ),
    Setting(
        "SHARDLINE_TRACE_GPU",
        "`0`, `1`, `N`",
        "16",
        "While tracing, also place each NCCL op at the time it ran on its GPU (CUDA events), on "
        "one optimizer step in `N` (all of that step's ops; `1`: every step, at more cost), and "
        "on every step that `shardline doctor` asks for; `0` keeps host times only (when each "
        "op was queued and waited for).",
        _integer(0, "an integer >= 0 (0: host times only, 1: every step, N: one step in N)"),
        16,
    ),
    Setting(
        "SHARDLINE_TRACE_INTERVAL",
        "seconds > 0",
        "1",
        "How often a traced rank writes its timeline and heartbeat out.",
        _seconds,
        1.0,
    ),
    Setting(
        "SHARDLINE_KEEPALIVE",
        "seconds, 0: off",
        "30",
        "A TCP peer whose host stops answering for this long is lost (PeerLostError), whatever "
        "the op deadline; a slow but live peer is not.",
        _seconds_or_off,
        30.0,
    ),
    Setting(
        "SHARDLINE_HOST_ID",
        "any string",
        "hostname and boot id",
        "This host's identity: ranks with equal ids use shared memory, others TCP.",
        _text,
    ),
    Setting(
        "SHARDLINE_BIND_ADDR",
        "an address",
        "the route to `MASTER_ADDR`",
        "The address other hosts reach this rank at.",
        _text,
    ),
    Setting(
        "SHARDLINE_BACKEND",
        "`native`, `gloo`, `nccl`, `mpi`",
        "by device",
        "The backend `init(backend=None)` uses.",
        _choice(BACKENDS, "a backend"),
    ),
    Setting(
        "SHARDLINE_DEVICE",
        "`cpu`, `cuda`, `cuda:N`",
        "by device",
        "The device `init(backend=None)` trains on, and the GPU of the nccl backend.",
        _device,
    ),
    Setting(
        "SHARDLINE_SHM_SLOT_BYTES",
        "bytes, at least 4096",
        "by machine",
        "Bytes per shared-memory slot (4 MiB on few cores, 1 MiB with 4 comm threads, else "
        "256 KiB).",
        _integer(
            4096,
            "an integer of at least 4096 (bytes per shared-memory slot, page-sized)",
            _MAX_BYTES,
        ),
    ),
    Setting(
        "SHARDLINE_COMM_THREADS",
        "an integer, at least 1",
        "4 when every rank on the machine has 4 cores, else 1",
        "Threads per rank for large blocking shared-memory ops (`1`: none).",
        _integer(1, "an integer of at least 1 (threads per rank for large collectives; 1: none)"),
    ),
    Setting(
        "SHARDLINE_COMM_THREADS_MIN_BYTES",
        "bytes",
        "1 MiB with 4 threads, else 4 MiB",
        "The smallest op the comm threads split.",
        _integer(0, "an integer of at least 0 (bytes)", _MAX_BYTES),
    ),
    Setting(
        "SHARDLINE_SPIN_US",
        "microseconds",
        "50",
        "How long shared-memory and TCP waits spin before they sleep, while every rank on the "
        "machine has a core (2 µs when ranks outnumber cores).",
        _integer(0, "an integer of at least 0 (microseconds)"),
        50,
    ),
    Setting(
        "SHARDLINE_STREAM_STORES",
        "`0`, `1`, `2`",
        "2",
        "`2`: an all_reduce on one thread per rank copies large inputs into shared memory with "
        "streaming stores, and an all_gather on symmetric memory of 4 ranks or more streams "
        "into an output of 64 MiB or more; `1`: reduced parts too; `0`: off.",
        _choice(("0", "1", "2"), "a streaming-store mode"),
        "2",
    ),
    Setting(
        "SHARDLINE_ONESHOT_BYTES",
        "bytes",
        "measured",
        "Shared-memory all-reduces up to this size run in one shot (every rank reads every "
        "input), larger ones in two phases. Unset: each group's first all-reduce times both on "
        "its ranks and takes the crossover (at most 262144; 262144 when ranks outnumber cores).",
        _integer(0, "an integer of at least 0 (bytes)", _MAX_BYTES),
    ),
    Setting(
        "SHARDLINE_NCCL_MAX_CTAS",
        "an integer, at least 1",
        "unset (NCCL's choice)",
        "Thread blocks per NCCL collective of every group of ours.",
        _integer(1, "a positive integer (thread blocks per NCCL collective), or unset"),
    ),
    Setting(
        "SHARDLINE_NCCL_OVERLAP_CTAS",
        "an integer, at least 0",
        "8",
        "The same for groups made with `overlap_compute=True`, such as ZeRO's (`0`: NCCL's "
        "choice).",
        _integer(
            0,
            "a non-negative integer (0: NCCL's choice) (thread blocks per NCCL collective), "
            "or unset",
        ),
        8,
    ),
    Setting(
        "SHARDLINE_KEEP_FREED_MEMORY",
        "`0`, `1`",
        "1",
        "On CPU backends (native, Gloo, MPI; and torch's `shardline` backend) `init` has "
        "glibc's malloc keep freed memory for reuse: the top of its heap given back to the "
        "system only past 2 GiB free, blocks up to 32 MiB from the heap, so a step whose "
        "tensors vary in size stops faulting fresh pages in. The process keeps its peak "
        "step's memory. `0`: malloc's defaults.",
        _flag,
        True,
    ),
    Setting(
        "SHARDLINE_SYMMETRIC",
        "`0`, `1`",
        "1",
        "DDP's buckets and ZeRO's flat buffers in symmetric memory on CPU, where the group has "
        "it (native engine, one host): their collectives copy nothing through the slots. `0`: "
        "ordinary tensors (the wrappers' `symmetric=` argument decides per wrapper).",
        _flag,
        True,
    ),
    Setting(
        "SHARDLINE_DETERMINISTIC",
        "`0`, `1`, `microbatch`, `repeat`",
        "0",
        "Deterministic mode: `1`: gradients summed per sample in one fixed tree over the batch, "
        "so that one process, DDP, ZeRO-1/2/3, pipelines and tensor parallelism train to the "
        "same parameters, bit for bit, at any power-of-two world size; `microbatch`: the same "
        "across DDP and ZeRO layouts on the model's own kernels, each backward one "
        "micro-batch of one size in every layout; `repeat`: the same bits "
        "run after run for one layout, on the model's own kernels (torch's deterministic "
        "algorithms, sums across ranks in a fixed order) (`sl.distribute(deterministic=)` "
        "decides per call).",
        _determinism,
        False,
    ),
    Setting(
        "SHARDLINE_PROGRESS",
        "`0`, `1`",
        "rank 0, after 2 s",
        "Checkpoint progress lines: `0` none, `1` at once on every rank.",
        _flag,
    ),
    Setting(
        "SHARDLINE_ELASTIC_SLOT",
        "`<node>.<local rank>`",
        "unset",
        "Set by `shardline run --nnodes MIN:MAX` for its workers: the place this process runs "
        "in; `shardline.init` then joins the elastic job's current generation.",
        _text,
    ),
    Setting(
        "SHARDLINE_ELASTIC_INCARNATION",
        "an integer",
        "0",
        "Set by an elastic `shardline run`: 0 for a slot's first process, +1 per replacement.",
        _integer(0, "an integer of at least 0"),
        0,
    ),
    Setting(
        "SHARDLINE_ELASTIC_NODES",
        "`MIN:MAX`",
        "unset",
        "Set by an elastic `shardline run`: its `--nnodes`.",
        _text,
    ),
    Setting(
        "SHARDLINE_ELASTIC_STANDBY",
        "`<node>.s<k>`",
        "unset",
        "Set by an elastic `shardline run` for a warm standby: `shardline.init` waits until "
        "its launcher hands it the place of a worker that died.",
        _text,
    ),
    Setting(
        "SHARDLINE_RESTART_COUNT",
        "an integer",
        "0",
        "Set by `shardline run` for its workers: which attempt this is.",
        _integer(0, "an integer of at least 0"),
        0,
    ),
    Setting(
        "SHARDLINE_REQUIRE_NATIVE",
        "`1`",
        "unset",
        "Tests fail, instead of skipping, when the engine is not built (CI sets it).",
        _flag,
        False,
    ),
)

_BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    """The declaration of ``name``; ``KeyError`` names the table for an undeclared one."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in shardline.config.SETTINGS") from None


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The text of ``name`` as set (stripped unless it is a secret), ``None`` if unset/empty."""
    s = setting(name)
    text = (os.environ if env is None else env).get(name)
    if text is None:
        return None
    if s.strip:
        text = text.strip()
    return text if text != "" else None


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of ``name``, parsed and checked; its default when unset or empty.

    Args:
        name: A declared ``SHARDLINE_*`` variable.
        env: Variables to read; ``os.environ`` by default.

    Raises:
        InvalidArgumentError: the value is malformed (names the variable, value and rule).
    """
    s = setting(name)
    text = raw(name, env)
    if text is None:
        return s.parsed_default
    try:
        return s.parse(text)
    except _Invalid as exc:
        raise InvalidArgumentError(f"{name}={text!r} {exc}") from None


def default_timeout() -> float:
    """``SHARDLINE_TIMEOUT`` in seconds (300 when unset): a new group's deadline by default.

    Raises:
        InvalidArgumentError: the value is not a positive number of seconds.
    """
    return float(get("SHARDLINE_TIMEOUT"))


# -- the launchers' variables ------------------------------------------------------------------

LAUNCHER_VARIABLES: dict[str, str] = {
    "RANK": "the global rank (torchrun, `shardline run`)",
    "WORLD_SIZE": "ranks in the job",
    "LOCAL_RANK": "the rank among this host's processes",
    "LOCAL_WORLD_SIZE": "processes on this host",
    "MASTER_ADDR": "host of the rendezvous store",
    "MASTER_PORT": "port of the rendezvous store",
    "TORCHELASTIC_USE_AGENT_STORE": "`True`: the launcher hosts the store at MASTER_ADDR:PORT",
    "TORCHELASTIC_RESTART_COUNT": "which attempt of the launcher this is",
    "TORCHELASTIC_RUN_ID": "the job's id under torchrun",
    "SLURM_PROCID": "the global rank under srun",
    "SLURM_NTASKS": "ranks in the job under srun",
    "SLURM_LOCALID": "the rank among this node's tasks under srun",
    "SLURM_NODEID": "this node's index in the allocation",
    "SLURM_TASKS_PER_NODE": "tasks per node, e.g. `4(x2),3`",
    "SLURM_LAUNCH_NODE_IPADDR": "address of the node srun ran on",
    "SLURM_JOB_NODELIST": "the allocation's hosts, e.g. `gpu[007-010]`",
    "CUBLASLT_WORKSPACE_SIZE": "cuBLASLt's workspace (KiB); deterministic mode on a GPU sets 0",
    "MKL_CBWR": "MKL's reproducible mode; deterministic mode on CPU sets `AUTO,STRICT`",
    "CUBLAS_WORKSPACE_CONFIG": "cuBLAS's workspace per stream; `deterministic='repeat'` sets "
    "`:4096:8` on a GPU",
}
"""The variables of torchrun, ``shardline run`` and SLURM that shardline reads (and cuBLAS's,
cuBLASLt's and MKL's, which deterministic mode sets), and what each says. ``env_var`` refuses a name
missing here."""


def _launcher_variable(name: str) -> str:
    if name not in LAUNCHER_VARIABLES:
        where = "get/raw (a setting)" if name in _BY_NAME else "LAUNCHER_VARIABLES"
        raise KeyError(f"{name} is not a launcher variable of shardline.config; see {where}")
    return name


@overload
def env_var(
    name: str, env: Mapping[str, str] | None = None, default: None = None
) -> str | None: ...
@overload
def env_var(name: str, env: Mapping[str, str] | None = None, *, default: str) -> str: ...
@overload
def env_var(name: str, env: Mapping[str, str] | None, default: str) -> str: ...
def env_var(
    name: str, env: Mapping[str, str] | None = None, default: str | None = None
) -> str | None:
    """The text of launcher variable ``name`` exactly as set (not stripped), else ``default``.

    Args:
        name: A variable of ``LAUNCHER_VARIABLES`` (``KeyError`` for any other name).
        env: Variables to read; ``os.environ`` by default.
        default: What an unset variable gives (an empty one gives ``""``, as set).
    """
    return (os.environ if env is None else env).get(_launcher_variable(name), default)


def env_required(name: str, env: Mapping[str, str] | None = None) -> str:
    """The text of launcher variable ``name``, which the caller's launcher always sets.

    Raises:
        KeyError: ``name`` is unset (as ``os.environ[name]`` does), or not a launcher variable.
    """
    return (os.environ if env is None else env)[_launcher_variable(name)]


def markdown_table() -> str:
    """The settings table of ``docs/settings.md``."""
    rows = ["| variable | value | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.value} | {s.default} | {s.meaning} |" for s in SETTINGS]
    return "\n".join(rows)
