"""A fuzz harness: malformed input to every RPC of the Tracker and Node services.

Every method is found from the generated service descriptors
(``fedpipe.v1.Tracker`` in :mod:`fedpipe.proto.tracker_pb2`, ``fedpipe.v1.Node``
in :mod:`fedpipe.proto.node_pb2`); the data-plane methods whose requests are
wire frames, not protobuf (``Send``, ``SendOne``, ``PutSnapshot``:
:data:`fedpipe.wire.rpc.FRAMES_IN`, contract
``protos/fedpipe/v1/FRAMES.md``), get frame sequences. Calls go over gRPC as
raw bytes, so nothing on the client side checks or fixes what is sent.

Each call is one :class:`Mutation` of one method's request:

* ``RANDOM_BYTES``: random bytes (for a request stream, several messages of them);
* ``RANDOM_FIELDS``: a request that parses, with random field values from a walk
  of the descriptor: ints at their type's limits, negative and huge; floats
  inf/nan/denormal; unknown enum values; random, empty, long and non-ASCII
  strings; repeated fields of random length; nested messages (for frame
  methods: frames with a random ``fedpipe.v1.Frame`` header and random payload);
* ``TRUNCATED``: such a request cut short at a random byte;
* ``OVERSIZED``: a message over the server's receive limit
  (:data:`fedpipe.net.MAX_MESSAGE_BYTES`, by default);
* ``FRAMES`` (frame methods only): sequences of hostile wire frames: bad magic,
  bad version, unknown kind, truncated prefixes, header lengths that lie or are
  huge, headers that do not parse or lack a tensor, MORE without HEAD, payloads
  shorter or longer than declared, declared sizes near 2**63, a valid header
  with a garbage (or zstd-garbage) payload;
* ``NEAR_VALID`` (methods with seed requests, :func:`sample_seeds`): a valid request
  with one to three fields changed anywhere in its tree, so the call gets past
  the first checks (a job the tracker plans and deploys, a stage a node builds).

Call ``i`` of a run with seed ``s`` is a pure function of ``(s, i)``
(:meth:`Fuzzer.make_call`), so any finding can be replayed alone.

Outcomes (:class:`Outcome`), as a call is classified:

* ``OK``: the server answered (which includes a refusal with a status code
  other than those below: INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...);
  the code is counted per name.
* ``CRASH``: a defect. The call ended with ``UNKNOWN`` (gRPC Python's answer when a
  handler raised an exception it did not map: a traceback on the server), or the
  target's process died (``alive`` raised).
* ``DEADLINE``: the call got no final status within its deadline
  (:attr:`Fuzzer.deadline`, seconds) but the server answered its liveness probe
  right after: a slow call, reported, not a hang.
* ``HANG``: the call got no status within its deadline *and* the server then did
  not answer its liveness probe (a node's ``Ping``, the tracker's
  ``ListNodes``; :attr:`Fuzzer.probe_deadline` seconds each, :data:`PROBE_TRIES`
  tries). A server found unresponsive by the probe after every batch is a hang too
  (counted once per batch and server), whatever the calls' outcomes were.

A server-streaming call whose server keeps sending (a valid ``WatchJob``) is read
for at most :data:`MAX_REPLIES` messages and then cancelled: an answer, ``OK``.
"""
from __future__ import annotations

import enum
import random
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory

from .. import net
from ..proto import node_pb2, tracker_pb2
from ..security import TlsConfig
from ..wire import rpc
from .fuzzvalues import Frames, Values, frame_head

PROBE_TRIES = 3
"""Liveness probes before a server is declared unresponsive (each with the probe deadline)."""
MAX_REPLIES = 64
"""Replies read from a server-streaming call before it is cancelled as answered."""

_TRACKER = tracker_pb2.DESCRIPTOR.services_by_name["Tracker"]
_NODE = node_pb2.DESCRIPTOR.services_by_name["Node"]
_FD = _descriptor.FieldDescriptor


class Mutation(enum.Enum):
    """How a request is malformed (see the module docstring)."""

    RANDOM_BYTES = "random-bytes"
    RANDOM_FIELDS = "random-fields"
    TRUNCATED = "truncated"
    OVERSIZED = "oversized"
    FRAMES = "frames"
    NEAR_VALID = "near-valid"


class Outcome(enum.Enum):
    """How a call ended (see the module docstring for the precise rules)."""

    OK = "ok"
    DEADLINE = "deadline"
    CRASH = "crash"
    HANG = "hang"


@dataclass(frozen=True)
class Method:
    """One RPC of a fedpipe service, as its descriptor declares it.

    Attributes:
        path: the full gRPC name, ``/fedpipe.v1.Node/Send``.
        request: the request's descriptor (for frame methods, the header's: ``Frame``).
        client_streaming, server_streaming: the RPC's shape.
        frames_in: the requests are wire frames, not serialized ``request``s.
    """

    path: str
    request: _descriptor.Descriptor
    client_streaming: bool
    server_streaming: bool
    frames_in: bool

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]


def methods(service: _descriptor.ServiceDescriptor) -> list[Method]:
    """Every RPC of ``service`` (a generated service descriptor), in declaration order."""
    frames_in = rpc.FRAMES_IN if service.full_name == rpc.SERVICE else frozenset()
    return [Method(f"/{service.full_name}/{m.name}", m.input_type, m.client_streaming,
                   m.server_streaming, m.name in frames_in) for m in service.methods]


def mutations_of(method: Method, seeds: Mapping[str, Sequence[bytes]]) -> tuple[Mutation, ...]:
    """The mutations that apply to ``method``: ``FRAMES`` only to frame methods,
    ``NEAR_VALID`` only to those with seed requests in ``seeds``."""
    return tuple(m for m in Mutation
                 if (m is not Mutation.FRAMES or method.frames_in)
                 and (m is not Mutation.NEAR_VALID or method.request.full_name in seeds))


def sample_seeds() -> dict[str, list[bytes]]:
    """Valid requests to start ``NEAR_VALID`` mutations from, by request type's full name.

    A ``SubmitJobRequest`` the tracker accepts (a two-layer MLP, as
    :meth:`fedpipe.Client.submit` packs it) and a ``LoadStageRequest`` of its
    first layer on a one-stage plan, which a node loads from a loopback caller.
    A mutation changes one to three of their fields, so calls reach the code
    behind the first checks (planning, stage building).
    """
    import torch  # only here: the rest of the harness needs no torch
    from torch import nn

    from .. import optimizer
    from ..client.packaging import dumps, pack_layers
    from ..client.profile import profile_model
    from ..spec import JobSpec

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    layers = pack_layers(model)
    spec = JobSpec(steps=4, microbatches=2, schedule="gpipe", batch_size=4,
                   optimizer=dumps(optimizer(torch.optim.SGD, lr=0.1)),
                   loss_fn=dumps(nn.functional.cross_entropy), stages=1, replicas=1,
                   activation_compression="none", gradient_compression="none"
                   ).validate(len(layers))
    config = spec.to_proto()
    submit = tracker_pb2.SubmitJobRequest(
        name="fuzz", layers=layers, config=config,
        profile=profile_model(model, torch.zeros(4, 4)))
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=0, node_id="n", address="127.0.0.1:1", layer_start=0,
        layer_end=len(layers), activation_codec="raw", gradient_codec="raw", node_name="n")],
        replicas=[node_pb2.ReplicaInfo(microbatches=2)])
    load = node_pb2.LoadStageRequest(job_id="fuzz-job", replica=0, stage=0, plan=plan,
                                     config=config, layers=layers)
    return {tracker_pb2.SubmitJobRequest.DESCRIPTOR.full_name: [submit.SerializeToString()],
            node_pb2.LoadStageRequest.DESCRIPTOR.full_name: [load.SerializeToString()]}


@dataclass(frozen=True)
class Target:
    """One server under fuzzing.

    Attributes:
        name: how reports call it ("tracker", "node0").
        address: ``HOST:PORT``.
        methods: its RPCs (:func:`methods`).
        probe: the liveness probe, a unary method path, and its request.
        alive: raises if the server's process died (e.g. ``Popen.poll`` wrapped);
            the default never raises.
    """

    name: str
    address: str
    methods: tuple[Method, ...]
    probe: tuple[str, bytes]
    alive: Callable[[], None] = lambda: None


def tracker_target(address: str, alive: Callable[[], None] = lambda: None) -> Target:
    """The tracker at ``address``, probed with ``ListNodes``."""
    return Target("tracker", address, tuple(methods(_TRACKER)),
                  (f"/{_TRACKER.full_name}/ListNodes",
                   tracker_pb2.ListNodesRequest().SerializeToString()), alive)


def node_target(name: str, address: str, alive: Callable[[], None] = lambda: None) -> Target:
    """The node ``name`` at ``address``, probed with ``Ping``."""
    return Target(name, address, tuple(methods(_NODE)),
                  (f"/{_NODE.full_name}/Ping", node_pb2.PingRequest().SerializeToString()),
                  alive)


# -- calls ------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One fuzzed call: call ``index`` of a run, to ``method`` of ``target``."""

    index: int
    target: Target
    method: Method
    mutation: Mutation
    messages: tuple[bytes, ...]
    unary_send: bool = False
    """A single-frame Send made as a unary call (served too; :func:`fedpipe.wire.rpc.send`
    uses ``SendOne``, which the harness calls as the unary method it is)."""

    def describe(self) -> str:
        sizes = ",".join(str(len(m)) for m in self.messages[:6])
        return (f"#{self.index} {self.target.name}{self.method.path} {self.mutation.value} "
                f"({len(self.messages)} messages: {sizes} bytes)")

    @property
    def key(self) -> tuple[str, str, str]:
        """What a report counts it under: (the server's kind, the method, the mutation)."""
        kind = "tracker" if self.target.name == "tracker" else "node"
        return kind, self.method.name, self.mutation.value


class AnyCall(Protocol):
    """What a :class:`Report` needs of a call: a gRPC :class:`Call`, or a hostile sequence
    of records to a socket data port (:class:`fedpipe.testing.fuzzdata.DataCall`)."""

    @property
    def key(self) -> tuple[str, str, str]: ...

    def describe(self) -> str: ...


class StatusCode(Protocol):
    """A status code: gRPC's, or a socket data port's (:class:`fedpipe.net.dataplane.Code`)."""

    @property
    def name(self) -> str: ...


@dataclass
class Result:
    """How one call ended: its outcome, the status code (None: answered OK) and details."""

    call: AnyCall
    outcome: Outcome
    code: StatusCode | None
    details: str
    seconds: float


@dataclass
class Report:
    """What a run found.

    Attributes:
        calls: calls made.
        outcomes: calls per :class:`Outcome` value.
        codes: calls per final status name ("OK" for an answer without error).
        by_method: calls per (target's kind, method name, mutation value).
        crashes, hangs, deadlines: the calls (or liveness failures) of each kind.
        seconds: wall time of the run.
    """

    calls: int = 0
    outcomes: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)
    by_method: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    deadlines: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, r: Result) -> None:
        self.calls += 1
        self.outcomes[r.outcome.value] += 1
        code = r.code.name if r.code is not None else "OK"
        self.codes[code] += 1
        self.by_method[r.call.key] += 1
        self.examples.setdefault((r.call.key[1], code), r.details[:160])
        line = f"{r.call.describe()}: {code} {r.details[:300]!r}"
        {Outcome.CRASH: self.crashes, Outcome.HANG: self.hangs,
         Outcome.DEADLINE: self.deadlines}.get(r.outcome, []).append(line)

    def summary(self) -> str:
        """A few lines: calls, outcomes, status codes, and each crash and hang."""
        lines = [f"calls: {self.calls} in {self.seconds:.1f} s",
                 "outcomes: " + ", ".join(f"{k.value} {self.outcomes.get(k.value, 0)}"
                                          for k in Outcome),
                 "status codes: " + ", ".join(f"{k} {n}" for k, n in self.codes.most_common())]
        lines += [f"CRASH {c}" for c in self.crashes] + [f"HANG {h}" for h in self.hangs]
        lines += [f"slow (deadline, server alive) {d}" for d in self.deadlines[:10]]
        return "\n".join(lines)


class Batches:
    """What both fuzzers share: seeded calls made in batches, every target checked after each.

    A subclass gives ``targets`` (each with a ``name``), ``make_call(i)`` (call ``i``,
    from the run's seed and ``i`` alone), ``invoke(call)`` (a classified
    :class:`Result`), ``_alive(target)`` (raises if the target's process died) and
    ``_unresponsive(target)`` (why a live target does not serve, or None).
    """

    targets: Sequence[Any]

    def make_call(self, i: int) -> Any:
        raise NotImplementedError

    def invoke(self, call: Any) -> Result:
        raise NotImplementedError

    def _alive(self, target: Any) -> None:
        raise NotImplementedError

    def _unresponsive(self, target: Any) -> str | None:
        raise NotImplementedError

    def run(self, calls: int, *, workers: int = 4, batch: int = 100,
            first: int = 0, progress: Callable[[Report], None] | None = None) -> Report:
        """Make calls ``first .. first + calls - 1``, ``workers`` at a time, in batches.

        After each batch of ``batch`` calls every target's process is checked and its
        liveness probed; a target that fails either is a crash or a hang of that
        batch. ``progress`` is called with the report so far after each batch.
        """
        return run_batches(lambda i: self.invoke(self.make_call(i)), self._after_batch,
                           calls, workers=workers, batch=batch, first=first,
                           progress=progress)

    def _after_batch(self, report: Report, start: int, stop: int) -> None:
        for t in self.targets:
            try:
                self._alive(t)
            except Exception as e:  # noqa: BLE001
                report.crashes.append(f"{t.name} died in calls {start}..{stop - 1}: {e}")
                continue
            why = self._unresponsive(t)
            if why is not None:
                report.hangs.append(f"{t.name} {why} in calls {start}..{stop - 1}")


class Fuzzer(Batches):
    """Fuzz the RPCs of ``targets`` with seeded, reproducible malformed calls.

    Args:
        targets: the servers (:func:`tracker_target`, :func:`node_target`).
        seed: the run's seed; call ``i`` depends only on ``(seed, i)``.
        deadline: each call's deadline, seconds.
        probe_deadline: each liveness probe's deadline, seconds.
        max_message_bytes: the servers' receive limit (``OVERSIZED`` goes one KiB and
            more over it), bytes.
        oversized_rate: the share of calls after the first round that are ``OVERSIZED``
            (each sends ``max_message_bytes`` over loopback, so they are kept few).
        tls: the certificate to show servers that take only mutual TLS (None: plaintext).
        seeds: valid requests by request type's full name, for ``NEAR_VALID``
            (default :func:`sample_seeds`; ``{}``: no ``NEAR_VALID`` calls).
    """

    def __init__(self, targets: Sequence[Target], *, seed: int = 0, deadline: float = 10.0,
                 probe_deadline: float = 5.0, max_message_bytes: int = net.MAX_MESSAGE_BYTES,
                 oversized_rate: float = 0.002, tls: TlsConfig | None = None,
                 seeds: Mapping[str, Sequence[bytes]] | None = None):
        self.targets, self.seed = list(targets), seed
        self.deadline, self.probe_deadline = deadline, probe_deadline
        self.max_message_bytes, self.oversized_rate = max_message_bytes, oversized_rate
        self.tls = tls
        self.seeds = sample_seeds() if seeds is None else dict(seeds)
        self._pairs = [(t, m, x) for t in self.targets for m in t.methods
                       for x in mutations_of(m, self.seeds)]
        self._channels = {t.address: self._channel(t.address) for t in self.targets}
        self._big: bytes | None = None
        self._big_lock = threading.Lock()
        self.submitted: list[str] = []
        """Job ids of fuzzed SubmitJob calls the tracker accepted (see :meth:`cleanup`)."""

    def _channel(self, address: str) -> grpc.Channel:
        # not net.channel: its send cap would stop an oversized message in this process,
        # and the point is that the server refuses it
        options = [("grpc.max_send_message_length", -1),
                   ("grpc.max_receive_message_length", -1), ("grpc.enable_http_proxy", 0)]
        if self.tls is not None:
            return grpc.secure_channel(address, self.tls.channel_credentials(), options=options)
        return grpc.insecure_channel(address, options=options)

    def close(self) -> None:
        """Close the channels."""
        for ch in self._channels.values():
            ch.close()

    def __enter__(self) -> "Fuzzer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- making calls ---------------------------------------------------------
    def _oversized(self) -> bytes:
        with self._big_lock:  # one buffer for every oversized call: it is large
            if self._big is None:
                self._big = bytes(self.max_message_bytes + 1024)
            return self._big

    def make_call(self, index: int) -> Call:
        """Call ``index`` of this run (a pure function of the seed and ``index``).

        The first ``len(targets' methods x mutations)`` calls try each
        (target, method, mutation) once; later ones pick at random, ``OVERSIZED``
        at :attr:`oversized_rate`.
        """
        rng = random.Random(self.seed * 1_000_003 + index)
        if index < len(self._pairs):
            target, method, mutation = self._pairs[index]
        else:
            target = rng.choice(self.targets)
            method = rng.choice(target.methods)
            if rng.random() < self.oversized_rate:
                mutation = Mutation.OVERSIZED
            else:
                mutation = rng.choice([m for m in mutations_of(method, self.seeds)
                                       if m is not Mutation.OVERSIZED])
        values = Values(rng)
        messages = self._messages(method, mutation, values)
        unary = (method.frames_in and method.name == "Send" and len(messages) == 1
                 and rng.random() < 0.5)
        return Call(index, target, method, mutation, tuple(messages), unary)

    def _messages(self, method: Method, mutation: Mutation, v: Values) -> list[bytes]:
        rng = v.rng
        many = method.client_streaming
        if mutation is Mutation.OVERSIZED:
            return [self._oversized()]
        if mutation is Mutation.RANDOM_BYTES:
            return [v.blob(256) for _ in range(rng.randint(1, 4) if many else 1)]
        if mutation is Mutation.FRAMES:
            return Frames(v).one()
        if mutation is Mutation.NEAR_VALID:
            cls = message_factory.GetMessageClass(method.request)
            seed = cls.FromString(rng.choice(self.seeds[method.request.full_name]))
            return [v.mutate(seed, rng.randint(1, 3)).SerializeToString()]
        if method.frames_in:  # a well-formed frame around a random header, or cut short
            frames = Frames(v)
            whole = [frame_head(frames.header(rng.random() < 0.5).SerializeToString(), v.blob())
                     for _ in range(rng.randint(1, 3))]
        else:
            whole = [v.message(method.request).SerializeToString()
                     for _ in range(rng.randint(1, 3) if many else 1)]
        if mutation is Mutation.TRUNCATED:
            last = whole[-1]
            whole[-1] = last[:rng.randint(0, max(0, len(last) - 1))]
        return whole

    def invoke(self, call: Call) -> Result:
        """Make ``call`` and classify how it ended (liveness probed after a deadline)."""
        ch = self._channels[call.target.address]
        m, t0 = call.method, time.monotonic()
        code, details = None, ""
        try:
            if call.unary_send or not (m.client_streaming or m.server_streaming):
                reply = ch.unary_unary(m.path)(call.messages[0], timeout=self.deadline)
                self._note_reply(call, reply)
            elif m.server_streaming:
                stream = (ch.stream_stream(m.path)(iter(call.messages), timeout=self.deadline)
                          if m.client_streaming else
                          ch.unary_stream(m.path)(call.messages[0], timeout=self.deadline))
                for n, _ in enumerate(stream, 1):
                    if n >= MAX_REPLIES:
                        stream.cancel()
                        break
            else:
                ch.stream_unary(m.path)(iter(call.messages), timeout=self.deadline)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        seconds = time.monotonic() - t0
        if code == grpc.StatusCode.CANCELLED and "Locally cancelled" in details:
            code, details = None, f"cancelled after {MAX_REPLIES} replies"
        outcome = Outcome.OK
        try:
            call.target.alive()
        except Exception as e:  # noqa: BLE001 — any way a process check fails is a crash
            outcome, details = Outcome.CRASH, f"the server's process died: {e}"
        else:
            if code == grpc.StatusCode.UNKNOWN:
                outcome = Outcome.CRASH
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                outcome = Outcome.DEADLINE if self.responsive(call.target) else Outcome.HANG
        return Result(call, outcome, code, details, seconds)

    def _note_reply(self, call: Call, reply: bytes) -> None:
        if call.method.name == "SubmitJob":
            self.submitted.append(tracker_pb2.SubmitJobReply.FromString(reply).job_id)

    def responsive(self, target: Target) -> bool:
        """Whether ``target`` answers its liveness probe within :data:`PROBE_TRIES` tries."""
        path, request = target.probe
        for _ in range(PROBE_TRIES):
            try:
                self._channels[target.address].unary_unary(path)(
                    request, timeout=self.probe_deadline)
                return True
            except grpc.RpcError:
                continue
        return False

    def _alive(self, target: Target) -> None:
        target.alive()

    def _unresponsive(self, target: Target) -> str | None:
        return None if self.responsive(target) else f"stopped answering {target.probe[0]}"

    def cleanup(self) -> list[str]:
        """Cancel the jobs fuzzed SubmitJob calls made (so they hold no nodes); returns
        the ids it could not cancel, with the reason."""
        tracker = next((t for t in self.targets if t.name == "tracker"), None)
        failed: list[str] = []
        if tracker is None:
            return failed
        cancel = self._channels[tracker.address].unary_unary(
            f"/{_TRACKER.full_name}/CancelJob")
        for job in self.submitted:
            try:
                cancel(tracker_pb2.CancelJobRequest(job_id=job, reason="fuzzed job")
                       .SerializeToString(), timeout=self.probe_deadline)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # already ended
                    failed.append(f"{job}: {e.code().name} {e.details()}")
        return failed


def run_batches(invoke: Callable[[int], Result],
                after_batch: Callable[[Report, int, int], None], calls: int, *,
                workers: int = 4, batch: int = 100, first: int = 0,
                progress: Callable[[Report], None] | None = None) -> Report:
    """Make calls ``first .. first + calls - 1`` (``invoke(i)``: call ``i``, classified),
    ``workers`` at a time, in batches of ``batch``; after each batch
    ``after_batch(report, start, stop)`` checks the servers (adding what it finds to the
    report's crashes and hangs), then ``progress(report)`` is called."""
    report, t0 = Report(), time.monotonic()
    with futures.ThreadPoolExecutor(workers, thread_name_prefix="fuzz") as pool:
        for start in range(first, first + calls, batch):
            stop = min(first + calls, start + batch)
            for r in pool.map(invoke, range(start, stop)):
                report.add(r)
            after_batch(report, start, stop)
            report.seconds = time.monotonic() - t0
            if progress is not None:
                progress(report)
    return report


def swarm_targets(swarm) -> list[Target]:
    """The tracker and every live node of a :class:`~fedpipe.testing.LocalSwarm`, each with
    a check that its process still runs."""
    def alive(proc, what: str) -> Callable[[], None]:
        def check() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode}; its log ends:\n"
                                   f"{swarm.log(proc)[-2000:]}")
        return check

    targets = [tracker_target(swarm.tracker, alive(swarm.tracker_proc, "the tracker"))]
    with swarm._admin() as client:
        for n in client.nodes():
            proc = swarm.nodes[swarm.node_index(n.name)]
            targets.append(node_target(n.name, n.address, alive(proc, n.name)))
    return targets


def iter_lines(report: Report) -> Iterator[str]:
    """The per-(kind, method, mutation) call counts, one line each."""
    for (kind, name, mutation), n in sorted(report.by_method.items()):
        yield f"{kind:8} {name:14} {mutation:14} {n}"
