"""Link emulation on one machine: shape a process's outgoing gRPC and socket traffic.

A node started with ``--link-profile profile.json`` sends to each peer through
a token bucket (bandwidth) and an added one-way delay (latency), both applied
inside fedpipe's own channels (:func:`fedpipe.net.channel`), and by the sender of a
socket data-plane link (:class:`Pacer`). Real traffic,
real time: the tracker's link measurements and the training's step times see
the emulated links as if they were real. The kernel's netem would do the
delay, but it is not available everywhere; rate limits can also come from
``tc qdisc ... tbf`` on real interfaces.

Profile JSON (node names, group names or "*" in ``from``/``to``; the first
matching entry wins; an entry applies both ways unless ``"oneway": true``)::

    {
      "groups": {"site-a": ["node0", "node1"], "site-b": ["node2", "node3"]},
      "links": [
        {"from": "site-a", "to": "site-b", "mbps": 20, "latency_ms": 30},
        {"from": "node3", "to": "*", "bandwidth": 1.25e6, "latency_ms": 5, "oneway": true}
      ]
    }

Bandwidth is ``bandwidth`` in bytes/s, or ``mbps``/``gbps`` in bits/s ×1e6/×1e9;
latency is ``latency_ms`` or ``latency_s`` (one way). Pairs no entry matches
are not shaped.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import grpc


@dataclass(frozen=True)
class EmulatedLink:
    """An emulated directed link: ``bandwidth`` in bytes/s (0: unlimited), ``latency``
    one way, s."""

    bandwidth: float
    latency: float


def parse_link(entry: dict[str, Any], where: str = "link") -> EmulatedLink:
    """An EmulatedLink from a JSON object with a bandwidth and a latency key.

    Raises:
        ValueError: an unknown key, several bandwidth keys, a negative figure, or a bad latency.
    """
    unknown = set(entry) - {"bandwidth", "mbps", "gbps", "latency_ms", "latency_s", "from", "to",
                            "oneway"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; a link has from, to, "
                         f"bandwidth|mbps|gbps, latency_ms|latency_s and oneway")
    bw_keys = [k for k in ("bandwidth", "mbps", "gbps") if k in entry]
    if len(bw_keys) > 1:
        raise ValueError(f"{where}: give one of bandwidth/mbps/gbps, not {bw_keys}")
    scale = {"bandwidth": 1.0, "mbps": 1e6 / 8, "gbps": 1e9 / 8}
    if "latency_ms" in entry and "latency_s" in entry:
        raise ValueError(f"{where}: give latency_ms or latency_s, not both")
    for k in [*bw_keys, "latency_ms", "latency_s"]:
        v = entry.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: {k} must be a finite number, got {v!r}")
    bandwidth = float(entry[bw_keys[0]]) * scale[bw_keys[0]] if bw_keys else 0.0
    latency = float(entry.get("latency_s", float(entry.get("latency_ms", 0.0)) / 1e3))
    if bandwidth < 0 or latency < 0 or latency > 60:
        raise ValueError(f"{where}: need bandwidth >= 0 and 0 <= latency <= 60 s, got "
                         f"{bandwidth}, {latency}")
    return EmulatedLink(bandwidth, latency)


SLACK_SECONDS = 0.005
"""How late a sender may come back to a busy link and still keep its place, seconds: a
sleep that overran by less (a loaded machine's scheduling) is made up by the next message,
so back-to-back messages keep the link's rate; a link idle for longer starts afresh."""


class TokenBucket:
    """Paces bytes to ``rate`` bytes/s as a link puts them on the wire; thread-safe.

    Every message of n bytes takes n / rate seconds, after the one before it, however
    long the link was idle: no credit builds up while it is. A token bucket with a burst
    (as this was, 64 KiB deep) lets messages up to its depth through at memory speed; it
    carried a step's 4 × 8 KiB activations of the digits MLP over 10 Mbit/s at no cost,
    so raw measured 94-101 ms a step where the link takes ~121 ms, and compressing looked
    useless there (issue 23). Only a sender back within :data:`SLACK_SECONDS` of the
    link coming free keeps its place (its sleep overran).
    """

    def __init__(self, rate: float, slack: float = SLACK_SECONDS):
        self.rate, self.slack = rate, slack
        self.free = time.monotonic()  # when the link is done with what it was given
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block until ``n`` bytes have gone at the link's rate."""
        if self.rate <= 0:
            return
        with self.lock:  # one sender at a time, as on one wire
            now = time.monotonic()
            start = self.free if now - self.free < self.slack else now
            self.free = start + n / self.rate
            if self.free > now:
                time.sleep(self.free - now)


def _size(message) -> int:
    """Bytes a request message takes on the wire: a data-plane frame is raw bytes
    (:mod:`fedpipe.wire.format`), every other message a protobuf."""
    return len(message) if isinstance(message, (bytes, bytearray, memoryview)) \
        else message.ByteSize()


class Shaper(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor,
             grpc.UnaryStreamClientInterceptor):
    """Client interceptor that delays and paces every call on a channel.

    Each request message is held until ``latency`` after the caller produced
    it (a delay line, so a stream's messages are in flight together, as on a
    real link), then passes a token bucket (serialised size). A blocking call's
    caller gets the answer ``latency`` after the peer gave it (the reply's
    trip back), so it costs two latencies plus size / bandwidth; a call started
    with ``.future()`` pays the reply's latency once, when it starts.
    """

    def __init__(self, link: EmulatedLink):
        self.link = link
        self.bucket = TokenBucket(link.bandwidth)

    def _pace_one(self, message):
        time.sleep(self.link.latency)
        self.bucket.take(_size(message))
        return message

    def _pace(self, messages: Iterator) -> Iterator:
        """The messages, each no earlier than ``latency`` after ``messages`` gave it."""
        if self.link.latency <= 0:
            for m in messages:
                self.bucket.take(_size(m))
                yield m
            return
        line: deque = deque()
        ready = threading.Condition()
        end = object()

        def pump():
            try:
                for m in messages:
                    with ready:
                        line.append((time.monotonic() + self.link.latency, m))
                        ready.notify()
            finally:
                with ready:
                    line.append((0.0, end))
                    ready.notify()

        threading.Thread(target=pump, name="link-delay", daemon=True).start()
        while True:
            with ready:
                ready.wait_for(lambda: line)
                due, m = line.popleft()
            if m is end:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            self.bucket.take(_size(m))
            yield m

    def _back(self, result):
        time.sleep(self.link.latency)
        return result

    def intercept_unary_unary(self, continuation, details, request):
        return self._back(continuation(details, self._pace_one(request)))

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return self._back(continuation(details, self._pace(request_iterator)))

    def intercept_unary_stream(self, continuation, details, request):
        return self._back(continuation(details, self._pace_one(request)))


class Pacer:
    """The same emulated link for a socket data-plane link (:mod:`fedpipe.net.dataplane`),
    where no interceptor sits: the sender asks :meth:`due` when a tensor is handed over,
    waits until then (a delay line: tensors in flight together, as :class:`Shaper`'s
    stream messages are), then takes its bytes from the token bucket; a flush
    waits :meth:`back` for the acknowledgement's trip home.
    """

    def __init__(self, link: EmulatedLink):
        self.link = link
        self.bucket = TokenBucket(link.bandwidth)

    def due(self) -> float:
        """When a tensor handed over now may go (``time.monotonic()`` seconds)."""
        return time.monotonic() + self.link.latency

    def take(self, nbytes: int) -> None:
        """Block until ``nbytes`` may go at the link's bandwidth."""
        self.bucket.take(nbytes)

    def back(self) -> None:
        """The reply's trip back: one latency."""
        if self.link.latency > 0:
            time.sleep(self.link.latency)


class LinkProfile:
    """Emulated links between named nodes, from a profile (see the module docstring).

    Raises:
        ValueError: a malformed profile (the message says where).
    """

    def __init__(self, profile: dict[str, Any]):
        if not isinstance(profile, dict):
            raise ValueError("a link profile must be a JSON object")
        unknown = set(profile) - {"groups", "links"}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)}; a profile has groups and links")
        groups, links = profile.get("groups", {}), profile.get("links", [])
        if not isinstance(groups, dict) or not all(
                isinstance(m, list) and all(isinstance(x, str) for x in m)
                for m in groups.values()):
            raise ValueError("groups must map each group name to a list of node names")
        if not isinstance(links, list) or not all(isinstance(e, dict) for e in links):
            raise ValueError("links must be a list of objects")
        self.groups = {g: set(members) for g, members in groups.items()}
        self.entries = []
        for i, e in enumerate(links):
            if not isinstance(e.get("from"), str) or not isinstance(e.get("to"), str):
                raise ValueError(f"links[{i}] needs 'from' and 'to' (node or group names)")
            if not isinstance(e.get("oneway", False), bool):
                raise ValueError(f"links[{i}]: oneway must be true or false")
            link = parse_link(e, f"links[{i}]")
            self.entries.append((e["from"], e["to"], link))
            if not e.get("oneway", False):
                self.entries.append((e["to"], e["from"], link))
        self._shapers: dict[tuple[str, str], Shaper] = {}
        self._pacers: dict[tuple[str, str], Pacer] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str) -> "LinkProfile":
        """Read a profile file. Raises OSError, ValueError (also for bad JSON)."""
        with open(path) as f:
            try:
                return cls(json.load(f))
            except ValueError as e:
                raise ValueError(f"link profile {path}: {e}") from None

    def _matches(self, pattern: str, name: str) -> bool:
        return pattern == "*" or pattern == name or name in self.groups.get(pattern, ())

    def link(self, src: str, dst: str) -> EmulatedLink | None:
        """The emulated link from node ``src`` to node ``dst``, or None (not shaped)."""
        if src == dst:
            return None
        for a, b, link in self.entries:
            if self._matches(a, src) and self._matches(b, dst):
                return link
        return None

    def shaper(self, src: str, dst: str) -> Shaper | None:
        """The shared interceptor for traffic from ``src`` to ``dst`` (one bucket per pair)."""
        link = self.link(src, dst)
        if link is None:
            return None
        with self._lock:
            return self._shapers.setdefault((src, dst), Shaper(link))

    def pacer(self, src: str, dst: str) -> Pacer | None:
        """The shared pacer for socket traffic from ``src`` to ``dst`` (one bucket per pair,
        apart from the gRPC channel's: the two are not used together on one link)."""
        link = self.link(src, dst)
        if link is None:
            return None
        with self._lock:
            return self._pacers.setdefault((src, dst), Pacer(link))
