"""Several tracker addresses, one leader: a channel that follows whichever leads.

Trackers that share a database (:mod:`fedpipe.tracker.leader`) elect one leader;
the others stand by and answer every call with UNAVAILABLE, naming the leader's
address in the trailing metadata :data:`LEADER_KEY` when one leads. A node, a
client or the CLI given ``--tracker a:7070,b:7070`` talks to them through one
:class:`LeaderChannel` (:func:`fedpipe.net.channel` makes one for a target with a
comma), so the code above it sees one channel, as with one tracker:

- a call goes to the address believed to lead (at first the first one);
- a standby's redirect (UNAVAILABLE with :data:`LEADER_KEY`) is followed at once,
  the call sent again to the leader it names: a standby runs nothing, so the call
  was not applied and sending it again is safe. At most one hop per address;
- a call that never reached a tracker (its address refused the connection: the
  tracker there is dead) goes on at once to the next address, as safe to send;
- any other UNAVAILABLE or DEADLINE_EXCEEDED (the tracker died, is stopped or cut
  off) moves the belief to the next address and is raised as it is: the caller's
  own retry (:func:`fedpipe.net.retry`) sends the next attempt there, since the
  call may or may not have been applied.

Nothing here imports torch or the tracker.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import grpc

from .address import problem

LEADER_KEY = "fedpipe-leader"
"""Trailing-metadata key under which a standby tracker names the leader's ``HOST:PORT``."""
SEPARATOR = ","
"""Between the addresses of several trackers in one target: ``a:7070,b:7070``."""
_FOLLOW = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
UNSENT = "failed to connect to all addresses"
"""gRPC core's details when no connection could be made: the call was never sent."""


def several(target: str) -> bool:
    """Whether ``target`` names more than one tracker (``a:7070,b:7070``)."""
    return SEPARATOR in target


def target_problem(target: str) -> str | None:
    """What is wrong with ``target`` as one tracker's ``HOST:PORT`` or several,
    comma-separated (:func:`fedpipe.net.address.problem` for each), naming the address
    at fault: ``"'127.0.0.1': expected HOST:PORT"``; None: nothing."""
    for part in target.split(SEPARATOR):
        address = part.strip()
        why = problem(address)
        if why is not None:
            if several(target):
                return (f"{address!r} in {target!r}: {why} (several trackers: "
                        f"HOST:PORT,HOST:PORT)")
            return f"{address!r}: {why}"
    return None


def addresses(target: str) -> list[str]:
    """The ``HOST:PORT`` addresses of ``target`` (comma-separated), in order, each once.

    Raises:
        ValueError: an address that is not ``HOST:PORT`` (:func:`target_problem`).
    """
    why = target_problem(target)
    if why is not None:
        raise ValueError(f"tracker {why}")
    out: list[str] = []
    for part in target.split(SEPARATOR):
        if part.strip() not in out:
            out.append(part.strip())
    return out


def unsent(error: grpc.RpcError) -> bool:
    """Whether ``error`` says the call never left this process (no connection to the
    address could be made), so no tracker applied it."""
    code = getattr(error, "code", None)
    details = getattr(error, "details", lambda: "")() or ""
    return (code is not None and code() == grpc.StatusCode.UNAVAILABLE
            and details.startswith(UNSENT))


def leader_of(error: grpc.RpcError) -> str | None:
    """The leader's address a standby named in ``error`` (None: it named none, or
    ``error`` is no standby's redirect)."""
    code = getattr(error, "code", None)
    if code is None or code() != grpc.StatusCode.UNAVAILABLE:
        return None
    trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
    for key, value in trailing:
        if key == LEADER_KEY and value:
            return value if isinstance(value, str) else value.decode()
    return None


class Trackers:
    """The trackers' addresses and which one is believed to lead; thread-safe.

    Args:
        target: ``HOST:PORT[,HOST:PORT...]``.

    Raises:
        ValueError: see :func:`addresses`.
    """

    def __init__(self, target: str):
        self.target = target
        self._addresses = addresses(target)
        self._lock = threading.Lock()
        self._current = self._addresses[0]

    @property
    def all(self) -> list[str]:
        """Every address known, in order (leaders named by redirects are added)."""
        with self._lock:
            return list(self._addresses)

    def current(self) -> str:
        """The address believed to lead now."""
        with self._lock:
            return self._current

    def redirected(self, error: grpc.RpcError, tried: str) -> bool:
        """Follow a standby's redirect in ``error`` from ``tried``: True if it named a
        leader other than ``tried`` (the call may be sent there again at once)."""
        leader = leader_of(error)
        if leader is None or leader == tried:
            return False
        with self._lock:
            if leader not in self._addresses:
                self._addresses.append(leader)  # the leader advertises another name
            self._current = leader
        return True

    def failed(self, error: grpc.RpcError, tried: str) -> None:
        """A call to ``tried`` failed with ``error``: if the tracker there may be gone
        (UNAVAILABLE, DEADLINE_EXCEEDED), believe the next address leads."""
        code = getattr(error, "code", None)
        if code is None or code() not in _FOLLOW or self.redirected(error, tried):
            return
        with self._lock:
            if self._current == tried:  # a concurrent failure moved it on already
                i = self._addresses.index(tried)
                self._current = self._addresses[(i + 1) % len(self._addresses)]


class LeaderChannel(grpc.Channel):
    """A channel to whichever of several trackers leads (see the module docstring).

    Args:
        target: ``HOST:PORT,HOST:PORT...``.
        connect: opens a channel to one address (:func:`fedpipe.net.channel` with the
            caller's TLS).

    Raises:
        ValueError: see :func:`addresses`.
    """

    def __init__(self, target: str, connect: Callable[[str], grpc.Channel]):
        self.trackers = Trackers(target)
        self._connect = connect
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def channel(self, address: str) -> grpc.Channel:
        """The one channel to ``address`` (opened on first use)."""
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = self._connect(address)
            return ch

    def _hops(self) -> int:
        return len(self.trackers.all) + 1

    def unary_unary(self, method, request_serializer=None, response_deserializer=None,
                    **kw):
        return _Unary(self, lambda ch: ch.unary_unary(method, request_serializer,
                                                      response_deserializer, **kw))

    def unary_stream(self, method, request_serializer=None, response_deserializer=None,
                     **kw):
        return _UnaryStream(self, lambda ch: ch.unary_stream(method, request_serializer,
                                                             response_deserializer, **kw))

    def stream_unary(self, method, request_serializer=None, response_deserializer=None,
                     **kw):
        # the tracker has no client-streaming call: sent to the believed leader, unfollowed
        return self.channel(self.trackers.current()).stream_unary(
            method, request_serializer, response_deserializer, **kw)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None,
                      **kw):
        return self.channel(self.trackers.current()).stream_stream(
            method, request_serializer, response_deserializer, **kw)

    def subscribe(self, callback, try_to_connect=False):
        self.channel(self.trackers.current()).subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        for ch in list(self._channels.values()):
            ch.unsubscribe(callback)

    def close(self):
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _Unary(grpc.UnaryUnaryMultiCallable):
    """One unary method over a :class:`LeaderChannel`: redirects followed, failures noted."""

    def __init__(self, owner: LeaderChannel, make: Callable[[grpc.Channel], Any]):
        self.owner, self.make = owner, make
        self._calls: dict[str, Any] = {}

    def _callable(self, address: str) -> Any:
        mc = self._calls.get(address)
        if mc is None:
            mc = self._calls[address] = self.make(self.owner.channel(address))
        return mc

    def _send(self, send: Callable[[Any, float | None], Any], timeout: float | None) -> Any:
        trackers = self.owner.trackers
        deadline = None if timeout is None else time.monotonic() + timeout
        for hop in range(self.owner._hops()):
            address = trackers.current()
            try:
                return send(self._callable(address), _left(deadline))
            except grpc.RpcError as e:
                last = hop + 1 == self.owner._hops()
                if not last and trackers.redirected(e, address):
                    continue  # a standby applied nothing: send it to the leader it named
                trackers.failed(e, address)
                if not last and unsent(e):
                    continue  # no tracker got it: try the next address
                raise
        raise AssertionError("unreachable: the last hop raises")

    def __call__(self, request, timeout=None, metadata=None, credentials=None,
                 wait_for_ready=None, compression=None):
        return self._send(lambda mc, left: mc(request, timeout=left, metadata=metadata,
                                              credentials=credentials,
                                              wait_for_ready=wait_for_ready,
                                              compression=compression), timeout)

    def with_call(self, request, timeout=None, metadata=None, credentials=None,
                  wait_for_ready=None, compression=None):
        return self._send(lambda mc, left: mc.with_call(request, timeout=left, metadata=metadata,
                                                        credentials=credentials,
                                                        wait_for_ready=wait_for_ready,
                                                        compression=compression), timeout)

    def future(self, request, timeout=None, metadata=None, credentials=None,
               wait_for_ready=None, compression=None):
        # a future is not resent: its failure only moves the belief for the next call
        address = self.owner.trackers.current()
        fut = self._callable(address).future(
            request, timeout=timeout, metadata=metadata, credentials=credentials,
            wait_for_ready=wait_for_ready, compression=compression)

        def noted(f) -> None:
            error = f.exception()
            if isinstance(error, grpc.RpcError):
                self.owner.trackers.failed(error, address)
        fut.add_done_callback(noted)
        return fut


class _UnaryStream(grpc.UnaryStreamMultiCallable):
    """One server-streaming method over a :class:`LeaderChannel`: a redirect before the
    first message is followed; a later failure moves the belief and is raised."""

    def __init__(self, owner: LeaderChannel, make: Callable[[grpc.Channel], Any]):
        self.owner, self.make = owner, make

    def __call__(self, request, timeout=None, metadata=None, credentials=None,
                 wait_for_ready=None, compression=None):
        def start(address: str) -> Any:
            return self.make(self.owner.channel(address))(
                request, timeout=timeout, metadata=metadata, credentials=credentials,
                wait_for_ready=wait_for_ready, compression=compression)
        return _Following(self.owner, start)


class _Following:
    """A server stream that follows a redirect met before its first message; the rest of
    the ``grpc.Call`` interface is the current call's."""

    def __init__(self, owner: LeaderChannel, start: Callable[[str], Any]):
        self.owner, self._start = owner, start
        self._address = owner.trackers.current()
        self._call = start(self._address)
        self._started = False
        self._hops = owner._hops()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        trackers = self.owner.trackers
        while True:
            try:
                out = next(self._call)
            except grpc.RpcError as e:
                if not self._started and self._hops > 1 and trackers.redirected(e, self._address):
                    self._hops -= 1
                    self._address = trackers.current()
                    self._call = self._start(self._address)
                    continue
                trackers.failed(e, self._address)
                raise
            self._started = True
            return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)
