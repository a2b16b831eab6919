"""Store failures become ShardlineErrors naming the rank, the task, the step and what to do.

A ``BreakingStore`` forwards to a real TCPStore and raises torch's own error (the one a vanished
store raises) at a chosen call, so every store call of a setup is made to fail in turn.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from shardline.comm import init_process_group
from shardline.comm.rendezvous.env import (
    RendezvousInfo,
    create_store,
    job_secret,
    launcher_hosts_store,
)
from shardline.comm.rendezvous.generations import agree_on_backend
from shardline.comm.rendezvous.store import StoreClient, exchange
from shardline.errors import CollectiveTimeoutError, PeerLostError, ShardlineError
from tests._ranks import new_store


class BreakingStore:
    """A store whose call number ``break_at`` (0-based) fails as if the store host exited."""

    def __init__(self, inner: Any, break_at: int | None = None) -> None:
        self.inner = inner
        self.underlying_store = inner  # so messages can name the store's address
        self.break_at = break_at
        self.calls: list[str] = []

    def _call(self, name: str, *args: Any) -> Any:
        if len(self.calls) == self.break_at:
            self.calls.append(name)
            raise dist.DistNetworkError("Broken pipe")
        self.calls.append(name)
        return getattr(self.inner, name)(*args)

    def set(self, *args: Any) -> Any:
        return self._call("set", *args)

    def get(self, *args: Any) -> Any:
        return self._call("get", *args)

    def add(self, *args: Any) -> Any:
        return self._call("add", *args)

    def check(self, *args: Any) -> Any:
        return self._call("check", *args)

    def wait(self, *args: Any) -> Any:
        return self._call("wait", *args)

    @property
    def timeout(self) -> Any:
        return self.inner.timeout


def _create(store: Any) -> Any:
    # One rank, so every store call is this thread's; secret=None generates one: more steps.
    return init_process_group(store, 0, 1, host_id="h", timeout=5, secret=None)


@pytest.mark.usefixtures("native")
def test_every_store_call_of_group_creation_fails_as_peer_lost_naming_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SHARDLINE_SECRET", raising=False)
    counting = BreakingStore(new_store())
    _create(counting).shutdown()
    assert len(counting.calls) >= 5, counting.calls  # identities, secret, barrier
    steps = set()
    for k in range(len(counting.calls)):
        master = new_store()
        with pytest.raises(PeerLostError) as info:
            _create(BreakingStore(master, break_at=k))
        text = str(info.value)
        found = re.match(r"rank 0: creating group 'world': (.+?) failed: ", text)
        assert found, text
        steps.add(found.group(1))
        assert f"the rendezvous store at 127.0.0.1:{master.port} is gone (Broken pipe)" in text
        assert "shardline.shutdown()" in text and "shardline run" in text, text
        assert isinstance(info.value.__cause__, dist.DistNetworkError)
    # Each step of the setup is named apart.
    assert {"publishing its host identity", "reading rank 0's host identity"} <= steps, steps
    assert any("job secret" in s for s in steps) and any("every rank" in s for s in steps), steps


def test_backend_agreement_and_secret_name_their_steps() -> None:
    with pytest.raises(
        PeerLostError,
        match=r"rank 1: joining the job \(shardline.init\): "
        r"reading the backend rank 0 chose failed: .* is gone",
    ):
        agree_on_backend(BreakingStore(new_store(), break_at=0), 1, "native", explicit=False)
    with pytest.raises(
        PeerLostError,
        match=r"rank 2: resolving the job secret: reading the "
        r"job secret rank 0 generated failed",
    ):
        job_secret(BreakingStore(new_store(), break_at=0), 2, ["h", "h", "h"], key="k", env={})


@pytest.mark.usefixtures("native")
def test_a_rank_that_never_comes_is_named_when_the_store_times_out() -> None:
    master = new_store()
    client = dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))
    client.set_timeout(timedelta(seconds=1))  # how long a get waits for a key
    with pytest.raises(CollectiveTimeoutError) as info:
        init_process_group(client, 0, 2, host_id="h", timeout=1, secret=b"s")
    text = str(info.value)
    assert "rank 0: creating group 'world': reading rank 1's host identity timed out" in text
    assert "rank(s) [1] of 2 never published theirs" in text, text


def test_store_errors_are_translated_by_kind() -> None:
    client = StoreClient(BreakingStore(new_store()), rank=3, task="doing a thing")
    cases = [
        (dist.DistNetworkError("Connection reset by peer"), PeerLostError, "is gone"),
        (
            dist.DistStoreError("wait timeout after 5ms, keys: /x"),
            CollectiveTimeoutError,
            "timed out",
        ),
        (RuntimeError("something else"), ShardlineError, "raised RuntimeError: something else"),
    ]
    for raised, kind, words in cases:
        with (
            pytest.raises(kind, match=rf"^rank 3: doing a thing: step .*{words}"),
            client.step("step"),
        ):
            raise raised
    mine = ShardlineError("ours")
    with pytest.raises(ShardlineError) as info, client.step("step"):
        raise mine
    assert info.value is mine  # our own errors pass through unchanged
    with pytest.raises(ValueError, match="bug"), client.step("step"):  # not a store error
        raise ValueError("bug")


def test_exchange_returns_every_rank_value_in_rank_order() -> None:
    store = new_store()
    clients = [StoreClient(store, rank=r, task="t") for r in (2, 0, 1)]
    for c in clients:
        c.set(f"p/{c.rank}", f"v{c.rank}", "seeding")
    assert exchange(clients[1], "p", 3, "v0", "value") == ["v0", "v1", "v2"]


def _info(port: int, rank: int = 0) -> RendezvousInfo:
    return RendezvousInfo("127.0.0.1", port, rank, 2, rank, 2, "env")


def test_the_launcher_convention_decides_who_hosts_the_store() -> None:
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    assert launcher_hosts_store(_info(9), agent)
    assert not launcher_hosts_store(_info(9), {**agent, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not launcher_hosts_store(_info(9), {**agent, "MASTER_PORT": "10"})  # not its store
    assert not launcher_hosts_store(_info(9), {})


def test_rank_0_connects_as_a_client_when_a_launcher_hosts_the_store() -> None:
    launcher = new_store()  # as `shardline run` or torchrun's agent would
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(launcher.port),
    }
    store = create_store(_info(launcher.port), timeout=5, env=env)  # no "address in use"
    store.set("from-rank-0", "hello")
    # Keys of this attempt (TORCHELASTIC_RESTART_COUNT, 0 when unset) live apart, as torch's.
    assert bytes(launcher.get("/worker/attempt_0/from-rank-0")) == b"hello"
    again = create_store(
        _info(launcher.port), timeout=5, env={**env, "TORCHELASTIC_RESTART_COUNT": "1"}
    )
    assert not again.check(["from-rank-0"])  # the next attempt reads nothing of this one
    with pytest.raises(ShardlineError, match="address already in use"):
        create_store(_info(launcher.port), timeout=5, env={})  # without: rank 0 would host
