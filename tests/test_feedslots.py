"""Data-plane slots are shared fairly: per-role caps, watches per job, feed back-pressure."""
from __future__ import annotations


import grpc
import pytest

from fedpipe import net
from fedpipe.security import Identity, Role
from fedpipe.tracker.watches import WatchSlots

pytestmark = pytest.mark.timeout(30)


class _Ctx:
    """The little of a ServicerContext DataCallLimit reads."""

    def __init__(self, identity: Identity | None, peer: str = "ipv4:127.0.0.1:1"):
        self.identity, self._peer = identity, peer

    def peer(self) -> str:
        return self._peer


def _limit(monkeypatch) -> net.DataCallLimit:
    monkeypatch.setattr(net, "identity_of", lambda ctx: ctx.identity)
    return net.DataCallLimit({"/m"}, net.DATA_CALLS, net.PEER_DATA_CALLS, net.CLIENT_DATA_CALLS)


def _fill(limit: net.DataCallLimit, ctx: _Ctx) -> tuple[int, str | None]:
    """Take slots for ``ctx`` until refused: (taken, why refused)."""
    taken = 0
    while True:
        why = limit._take("/m", limit.peer_of(ctx), limit._cap(ctx))
        if why is not None:
            return taken, why
        taken += 1


def _identity(role: Role, name: str) -> Identity:
    return Identity(role=role, name=name, serial=1)


def test_a_few_clients_cannot_take_every_data_slot_but_nodes_get_their_share(monkeypatch):
    limit = _limit(monkeypatch)
    for name in ("mallory", "eve"):
        taken, why = _fill(limit, _Ctx(_identity(Role.CLIENT, name)))
        assert taken == net.CLIENT_DATA_CALLS
        assert "fedpipe.net.CLIENT_DATA_CALLS" in why
    # a third client's job and a node's peer streams still get theirs
    assert _fill(limit, _Ctx(_identity(Role.CLIENT, "victim")))[0] == net.CLIENT_DATA_CALLS
    assert _fill(limit, _Ctx(_identity(Role.NODE, "n1")))[0] == net.PEER_DATA_CALLS
    assert 3 * net.CLIENT_DATA_CALLS + net.PEER_DATA_CALLS <= net.DATA_CALLS


def test_watches_per_job_per_caller_are_capped_and_given_back():
    slots = WatchSlots()
    assert slots.take("j1", "c") is None and slots.take("j1", "c") is None
    why = slots.take("j1", "c")
    assert why is not None and "job j1" in why and "WATCHES_PER_JOB" in why
    assert slots.take("j2", "c") is None and slots.take("j1", "other") is None
    slots.give("j1", "c")
    assert slots.held("j1", "c") == 1
    assert slots.take("j1", "c") is None


class _Busy(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "busy"


def test_retry_treats_the_given_codes_as_transient_and_gives_up_after_its_attempts():
    calls = []

    def busy_twice():
        calls.append(1)
        if len(calls) < 3:
            raise _Busy()
        return "sent"

    codes = (grpc.StatusCode.RESOURCE_EXHAUSTED,)
    assert net.retry(busy_twice, "t", first_delay=0.01, codes=codes) == "sent"
    with pytest.raises(_Busy):  # not retried unless asked
        net.retry(lambda: (_ for _ in ()).throw(_Busy()), "t", first_delay=0.01)
    n = []
    with pytest.raises(_Busy):
        net.retry(lambda: n.append(1) or (_ for _ in ()).throw(_Busy()), "t", attempts=3,
                  first_delay=0.01, codes=codes)
    assert len(n) == 3


def test_a_corrupt_or_too_deep_checkpoint_is_a_checkpoint_error_naming_the_folder(tmp_path):
    from fedpipe.client import checkpoints
    (tmp_path / checkpoints.META).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(checkpoints.CheckpointError, match=str(tmp_path)):
        checkpoints.read(tmp_path)
    (tmp_path / checkpoints.META).write_text('{"format": "%s", "step": 1, "stages": []}'
                                             % checkpoints.FORMAT)
    (tmp_path / checkpoints.TENSORS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(checkpoints.CheckpointError, match=str(tmp_path)):
        checkpoints.read(tmp_path)

