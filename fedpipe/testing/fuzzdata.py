"""Hostile byte streams to a node's socket data port (:mod:`fedpipe.net.dataplane`).

The socket listener's counterpart of :mod:`fedpipe.testing.fuzz`, whose
machinery it uses: the hostile wire frames and random values of
:mod:`fedpipe.testing.fuzzvalues`, the outcomes, report and batched run
(:class:`~fedpipe.testing.fuzz.Batches`, :class:`~fedpipe.testing.fuzz.Report`).
Each call opens a raw TCP connection (with TLS: a mutual TLS connection with a
certificate of the swarm) to the data port and sends one hostile sequence
(:class:`~fedpipe.testing.fuzzrecords.Records`, contract
``protos/fedpipe/v1/FRAMES.md``, "Connections"):

* before a preface: garbage (HTTP, HTTP/2, a TLS hello on a plain port), record
  prefixes with a bad magic, version or type, another record first, a preface
  longer than 4096 bytes or whose length lies, a preface body that is not JSON,
  or JSON with fields missing, unknown, of the wrong type, negative, huge, or
  naming another certificate, a preface cut short;
* after a good preface: TENSOR records around each of ``Frames``' hostile frame
  sequences; sane tensors with duplicate, skipping or huge sequence numbers;
  headers whose payload is shorter or longer than they say, or claims over the
  node's limits; envelopes of jobs and stages the node does not run, kinds a client
  may not send (with TLS, from a client certificate), unknown kinds; a second
  preface; ACK, SYNC, REFUSED and GOAWAY records with arguments out of range;
  more tensors than the node's credit grants; a flood of SYNCs;
* stalls: a connection that sends part of a preface (or nothing) and waits, and a
  half-open one that stops inside a record after its preface and is held open.

How a call ends (:class:`~fedpipe.testing.fuzzrecords.End`) and its outcome
(:class:`~fedpipe.testing.fuzz.Outcome`):

* ``HALF_CLOSE``: the sequence, then this side's sending half is shut; the node must
  close the connection within :attr:`DataFuzzer.deadline` (it answers with GOAWAY,
  REFUSED or ACKs, or just closes). ``STALL``: the same without the shut: the node's
  first-record deadline (:data:`fedpipe.net.timeouts.DATA_FIRST_RECORD`) must close
  it. No close in time: ``HANG``, unless it closes within one more deadline: then
  ``DEADLINE`` (slow, reported, as a gRPC call past its deadline to a server that
  still answers).
* ``HOLD``: the connection is held open while the node is probed (below): it must
  serve others meanwhile; then this side closes it.
* ``CRASH``: the node's process died, or it answered INTERNAL or UNKNOWN (a
  receiver's exception it did not map: a traceback in its log).

After every call the node is probed: its process is alive, it answers gRPC
``Ping``, and a good connection of the fuzzer's own
(:class:`~fedpipe.net.dataplane.DataPlane`, name ``fuzz-probe``) carries a probe
tensor to it, acknowledged. A probe that fails :data:`~fedpipe.testing.fuzz.PROBE_TRIES`
times is a ``HANG`` of that call. After each batch the good connection is made
afresh.

Call ``i`` of a run with seed ``s`` is a pure function of ``(s, i)``
(:meth:`DataFuzzer.make_call`), so any finding can be replayed alone.
"""
from __future__ import annotations

import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import grpc
import torch

from ..net import timeouts
from ..net.dataplane import DataPlane, LinkFailed, PeerRefused, Timeouts, records
from ..net.dataplane.records import Code, RecordType
from ..proto import node_pb2
from ..security import TlsConfig
from ..security.tls import client_context
from ..wire.format import WireError
from .fuzz import PROBE_TRIES, Batches, Outcome, Result, Target
from .fuzzrecords import PROBE_NAME, End, Records
from .fuzzvalues import Values

MAX_ANSWER_BYTES = 1 << 20
"""Bytes of a node's answers read per call at most (ACKs, refusals, a GOAWAY)."""
CRASH_CODES = frozenset({Code.INTERNAL, Code.UNKNOWN})
"""Codes that mean the node's receiver raised an exception it did not map."""


@dataclass(frozen=True)
class DataTarget:
    """A node's data port under fuzzing.

    Attributes:
        name: the node's name (its preface's; the good connection dials it by it).
        address: its data port, ``HOST:PORT``.
        node: its gRPC side (:func:`fedpipe.testing.fuzz.node_target`): ``Ping`` and
            the process check.
        tls: certificates the hostile connections show, one picked per call (empty:
            plaintext); their prefaces name the certificate's holder, but now and then
            another.
        probe_tls: the good connection's certificate (a node's), None in plaintext.
    """

    name: str
    address: str
    node: Target
    tls: tuple[TlsConfig, ...] = ()
    probe_tls: TlsConfig | None = None


@dataclass(frozen=True)
class DataCall:
    """One hostile sequence: call ``index`` of a run, to ``target``.

    Attributes:
        case: which kind of hostile sequence (:meth:`Records.one`).
        tls: the certificate the connection shows (None: plaintext).
        raw: to a TLS port, no TLS: plaintext bytes, or a handshake that stalls.
        sends: the bytes sent, in this order, one ``sendall`` each.
        end: how the sequence ends.
    """

    index: int
    target: DataTarget
    case: str
    tls: TlsConfig | None
    sends: tuple[bytes, ...]
    end: End
    raw: bool = False

    @property
    def key(self) -> tuple[str, str, str]:
        return ("data", self.case,
                "tls-port-raw" if self.raw else "tls" if self.tls is not None else "plain")

    def describe(self) -> str:
        sizes = ",".join(str(len(m)) for m in self.sends[:6])
        who = (" raw to the TLS port" if self.raw else
               f" as {self.tls.name}" if self.tls is not None else "")
        return (f"#{self.index} {self.target.name} data port {self.case}{who} "
                f"({len(self.sends)} writes: {sizes} bytes, {self.end.value})")


def answers(data: bytes) -> list[tuple[RecordType, int, Code | None, str]]:
    """The records in a node's answer bytes: ``(type, arg, code, text)`` (code and text
    for REFUSED and GOAWAY); stops at the first thing that is not a record."""
    out: list[tuple[RecordType, int, Code | None, str]] = []
    at = 0
    while len(data) - at >= records.PREFIX_BYTES:
        try:
            kind, arg = records.unpack(data[at:at + records.PREFIX_BYTES])
        except WireError:
            break
        at += records.PREFIX_BYTES
        if kind is RecordType.PREFACE:
            at += arg
            out.append((kind, arg, None, ""))
        elif kind in (RecordType.REFUSED, RecordType.GOAWAY):
            if len(data) - at < records.TEXT.size:
                break
            code, size = records.TEXT.unpack(data[at:at + records.TEXT.size])
            at += records.TEXT.size
            text = data[at:at + size].decode(errors="replace")
            at += size
            out.append((kind, arg, records.code_of(code), text))
        else:
            out.append((kind, arg, None, ""))
    return out


class DataFuzzer(Batches):
    """Send seeded, reproducible hostile sequences to the data ports of ``targets``.

    Args:
        targets: the nodes' data ports (:func:`data_targets`).
        seed: the run's seed; call ``i`` depends only on ``(seed, i)``.
        deadline: how long a node has to close a connection (a stall's: past its
            first-record deadline), and each probe's deadline, seconds.
    """

    def __init__(self, targets: Sequence[DataTarget], *, seed: int = 0,
                 deadline: float = timeouts.CONTROL_RPC):
        self.targets, self.seed, self.deadline = list(targets), seed, deadline
        self._channels = {t.address: grpc.insecure_channel(t.node.address)
                          if t.probe_tls is None else grpc.secure_channel(
                              t.node.address, t.probe_tls.channel_credentials())
                          for t in self.targets}
        self._contexts = {c.name: client_context(c) for t in self.targets for c in t.tls}
        self._probes: dict[str, DataPlane] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        with self._lock:
            for plane in self._probes.values():
                plane.close()
            self._probes.clear()

    def __enter__(self) -> "DataFuzzer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls --------------------------------------------------------------------------
    def make_call(self, index: int) -> DataCall:
        """Call ``index`` of this run (a pure function of the seed and ``index``)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        target = rng.choice(self.targets)
        tls = rng.choice(target.tls) if target.tls else None
        if tls is not None:
            name, role = tls.name, tls.identity.role.value
        else:
            role = rng.choice(("node", "client"))
            name = f"fuzz{rng.randrange(8)}" + ("#c1ent" if role == "client" else "")
        case, sends, end = Records(Values(rng), name, role).one()
        raw = tls is not None and case in ("garbage", "stall") and rng.random() < 0.5
        return DataCall(index, target, case, tls, tuple(sends), end, raw)

    def _connect(self, call: DataCall) -> socket.socket:
        host, _, port = call.target.address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=self.deadline)
        if call.tls is not None and not call.raw:
            try:
                return self._contexts[call.tls.name].wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
        return sock

    def invoke(self, call: DataCall) -> Result:
        """Send ``call``'s sequence and classify how it ended (the node probed after)."""
        t0 = time.monotonic()
        got, closed, note = bytearray(), False, ""
        served = True
        try:
            sock = self._connect(call)
        except OSError as e:
            return self._result(call, t0, got, closed=False, served=self.serving(call.target),
                                note=f"cannot connect: {e}")
        try:
            closed, note = self._send(sock, call)
            if call.end is End.HALF_CLOSE and not closed:
                socket.socket.shutdown(sock, socket.SHUT_WR)  # not SSLSocket's: no TLS close
            if call.end is End.HOLD and not closed:
                served = self.serving(call.target)  # while this connection is held open
                closed = True
            elif not closed:
                closed = self._read_until_closed(sock, got)
                if not closed:  # slow, or stuck? it gets one more deadline to tell
                    late = self._read_until_closed(sock, got)
                    note = f"closed after more than {self.deadline} s" if late else ""
        except OSError as e:
            closed, note = True, f"{type(e).__name__}: {e}"  # reset: refused
        finally:
            sock.close()
        return self._result(call, t0, got, closed, served and self.serving(call.target), note)

    def _send(self, sock: socket.socket, call: DataCall) -> tuple[bool, str]:
        """Write the sequence; (whether the node closed the connection meanwhile, why)."""
        if call.end is End.HOLD:
            sock.settimeout(min(1.0, self.deadline))  # a node that stops reading: go on
        try:
            for piece in call.sends:
                sock.sendall(piece)
        except TimeoutError:
            return False, "the node stopped reading (held)"
        except OSError as e:  # it refused and closed while we wrote
            return True, f"{type(e).__name__} while writing: {e}"
        finally:
            sock.settimeout(self.deadline)
        return False, ""

    def _read_until_closed(self, sock: socket.socket, got: bytearray) -> bool:
        """Read the node's answers until it closes; whether it did within the deadline."""
        end = time.monotonic() + self.deadline
        try:
            while time.monotonic() < end:
                sock.settimeout(max(0.01, end - time.monotonic()))
                piece = sock.recv(65536)
                if not piece:
                    return True
                if len(got) < MAX_ANSWER_BYTES:
                    got += piece
        except TimeoutError:
            return False
        except (OSError, ssl.SSLError):
            return True  # reset, or a TLS close without close_notify
        return False

    def _result(self, call: DataCall, t0: float, got: bytearray, closed: bool, served: bool,
                note: str) -> Result:
        said = answers(bytes(got))
        refusals: list[tuple[Code | None, str]] = [
            (code, text) for kind, _, code, text in said
            if kind in (RecordType.REFUSED, RecordType.GOAWAY) and code is not None]
        goaway = [(c, t) for k, _, c, t in said if k is RecordType.GOAWAY and c is not None]
        code, details = (goaway or refusals or [(None, note or _summary(said))])[0]
        outcome = Outcome.OK
        try:
            call.target.node.alive()
        except Exception as e:  # noqa: BLE001 — any way a process check fails is a crash
            outcome, details = Outcome.CRASH, f"the node's process died: {e}"
        else:
            crashed = [(c, t) for c, t in refusals if c in CRASH_CODES]
            if crashed:
                outcome, (code, details) = Outcome.CRASH, crashed[0]
            elif not closed:
                outcome = Outcome.DEADLINE if note else Outcome.HANG
                details = (f"the node did not close the connection within {self.deadline} s"
                           f"{' (' + note + ')' if note else ' nor the next'}; answers: "
                           f"{_summary(said)}")
            elif not served:
                outcome, details = Outcome.HANG, "the node stopped serving (probe failed)"
        return Result(call, outcome, code, details, time.monotonic() - t0)

    # -- the node still serves ------------------------------------------------------------
    def serving(self, target: DataTarget) -> bool:
        """Whether the node answers ``Ping`` and takes a probe tensor over a good connection,
        within :data:`PROBE_TRIES` tries."""
        path, request = target.node.probe
        for _ in range(PROBE_TRIES):
            try:
                self._channels[target.address].unary_unary(path)(request,
                                                                 timeout=self.deadline)
                self._probe(target)
                return True
            except (grpc.RpcError, LinkFailed, PeerRefused, OSError):
                self._fresh(target)
        return False

    def _plane(self, target: DataTarget) -> DataPlane:
        with self._lock:
            plane = self._probes.get(target.address)
            if plane is None:
                plane = self._probes[target.address] = DataPlane(
                    PROBE_NAME, _NoInbound(), listen=False, tls=target.probe_tls,
                    timeouts=Timeouts(credit=self.deadline, resume=self.deadline,
                                      handshake=self.deadline))
            return plane

    def _fresh(self, target: DataTarget) -> None:
        """Drop the good connection: the next probe dials a new one."""
        with self._lock:
            plane = self._probes.pop(target.address, None)
        if plane is not None:
            plane.close()

    def _probe(self, target: DataTarget) -> None:
        link = self._plane(target).link(target.name, target.address)
        link.send(torch.zeros(16), envelope=node_pb2.Envelope(kind=node_pb2.KIND_PROBE),
                  flush=True)

    def _alive(self, target: DataTarget) -> None:
        target.node.alive()

    def _unresponsive(self, target: DataTarget) -> str | None:
        self._fresh(target)
        return None if self.serving(target) else (
            "stopped serving (Ping and a probe tensor over a fresh connection)")


class _NoInbound:
    """The good connection's receiver: a node sends the fuzzer nothing."""

    def admit(self, peer, header) -> int:
        from ..net.dataplane import Refused
        raise Refused(Code.PERMISSION_DENIED, "the fuzzer takes no tensors")

    def deliver(self, peer, header, tensor) -> None:
        raise AssertionError("admit refuses every tensor")


def _summary(said: list[tuple[RecordType, int, Code | None, str]]) -> str:
    if not said:
        return "closed without a word"
    kinds = [k.name for k, _, _, _ in said]
    return "answered " + ", ".join(f"{k} x{kinds.count(k)}" for k in dict.fromkeys(kinds))


def data_targets(swarm, tls: Sequence[TlsConfig] = (),
                 probe_tls: TlsConfig | None = None) -> list[DataTarget]:
    """The data port of every live node of a :class:`~fedpipe.testing.LocalSwarm` that has
    one, each with its gRPC target (``Ping``, its process checked)."""
    from .fuzz import swarm_targets
    by_name = {t.name: t for t in swarm_targets(swarm) if t.name != "tracker"}
    with swarm._admin() as client:
        return [DataTarget(n.name, n.data_address, by_name[n.name], tuple(tls), probe_tls)
                for n in client.nodes() if n.data_address]
