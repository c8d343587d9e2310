"""Fakes for the tracker's in-process tests: a clock, nodes that answer calls, a swarm."""
from __future__ import annotations

from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.security.interceptor import _ATTR
from fedpipe.spec import PROTOCOL_VERSION, JobSpec, StageKey
from fedpipe.tracker.nodes import NodeCallError
from fedpipe.tracker.scheduler import Tracker
from fedpipe.tracker.store import MemoryStore, Store



class Context:
    """A servicer context of a server without TLS (no caller identity), for calling a
    :class:`~fedpipe.tracker.service.TrackerService` method in-process."""

    def __init__(self):
        setattr(self, _ATTR, None)

    def abort(self, code, details):
        raise AssertionError(f"aborted {code.name}: {details}")


VERSIONS = tracker_pb2.Versions(fedpipe="0.1.0", protocol=PROTOCOL_VERSION, python="3.11",
                                torch="2.3.0", cloudpickle="3.0.0")


class FakeClock:
    """Seconds since the epoch that move only when told to."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeNodes:
    """:class:`fedpipe.tracker.nodes.NodeCalls` that records every call.

    ``fail_load[StageKey]`` makes that stage's LoadStage fail with the message;
    a node whose address is in ``dead`` fails every call; a LoadStage that
    resumes at a step in ``lost_snapshots`` fails as a node with no snapshot would.
    """

    def __init__(self, clock: FakeClock, store: Store | None = None):
        self.clock, self.store = clock, store  # the store names the measuring node
        self.loads: list[node_pb2.LoadStageRequest] = []
        self.stops: list[tuple[str, node_pb2.StopJobRequest]] = []
        self.measured: list[str] = []
        self.fail_load: dict[StageKey, str] = {}
        self.dead: set[str] = set()
        self.lost_snapshots: set[int] = set()
        self.pings: list[str] = []
        self.holds: list[tuple[str, node_pb2.HoldAtRequest]] = []
        self.done: dict[str, int] = {}  # address -> steps its stages have done (for HoldAt)
        # (address, request, LoadStage calls made before it)
        self.assigns: list[tuple[str, node_pb2.AssignJobRequest, int]] = []

    def _alive(self, address):
        if address in self.dead:
            raise NodeCallError(f"failed to connect to {address}: Connection refused")

    def load_stage(self, address, request):
        self._alive(address)
        self.loads.append(request)
        error = self.fail_load.get(StageKey(request.replica, request.stage))
        if error:
            raise NodeCallError(error)
        if request.resume_step in self.lost_snapshots:
            raise NodeCallError(f"cannot load stage {request.stage}: no snapshot of step "
                                f"{request.resume_step}")

    def ping(self, address, timeout):
        self.pings.append(address)
        self._alive(address)

    def stop_job(self, address, request):
        self.stops.append((address, request))

    def hold_at(self, address, request):
        """As a node would: refused when a stage here is already past the cut."""
        self._alive(address)
        self.holds.append((address, request))
        done = self.done.get(address, 0)
        return node_pb2.HoldAtReply(accepted=request.step == 0 or done < request.step, done=done)

    def assign_job(self, address, request):
        self._alive(address)
        self.assigns.append((address, request, len(self.loads)))

    def measure_links(self, address, request):
        self.measured.append(address)
        assert self.store is not None, "FakeNodes(clock, store) to measure links"
        src = next(n for n in self.store.nodes() if n.address == address)
        return node_pb2.MeasureLinksReply(links=[
            node_pb2.LinkMeasurement(src_id=src.node_id, dst_id=p.node_id, bandwidth=1e9,
                                     latency=1e-3, measured_at=self.clock())
            for p in request.peers])


def versions_with(**changes) -> tracker_pb2.Versions:
    """:data:`VERSIONS` with ``changes``."""
    v = tracker_pb2.Versions()
    v.CopyFrom(VERSIONS)
    for k, value in changes.items():
        setattr(v, k, value)
    return v


def registration(name: str, port: int, boot: str = "boot", versions=VERSIONS,
                 memory: int = 2**33) -> tracker_pb2.RegisterNodeRequest:
    return tracker_pb2.RegisterNodeRequest(
        name=name, address=f"127.0.0.1:{port}", boot_id=boot, versions=versions,
        resources=node_pb2.Resources(flops=1e12, memory_bytes=memory, device="cpu", cores=1))


def submission(steps: int = 3, stages: int = 2, replicas: int = 1, n_layers: int = 4,
               pending_timeout: float = 0.0, **spec) -> tracker_pb2.SubmitJobRequest:
    config = JobSpec(steps=steps, microbatches=4, batch_size=8, optimizer=b"opt", loss_fn=b"loss",
                     stages=stages, replicas=replicas, **spec).to_proto()
    profile = tracker_pb2.ModelProfile(
        layers=[tracker_pb2.LayerProfile(name=f"l{i}", flops=1e6, activation_bytes=1000,
                                         parameter_bytes=1000) for i in range(n_layers)],
        input_bytes=100)
    layers = [b"layer%d" % i for i in range(n_layers)]
    return tracker_pb2.SubmitJobRequest(name="job", layers=layers, config=config,
                                        profile=profile, pending_timeout=pending_timeout)


def make_tracker(store: Store | None = None, clock: FakeClock | None = None, *,
                 lease: float = 10.0, link_wait: float = 30.0
                 ) -> tuple[Tracker, FakeNodes, FakeClock]:
    """A tracker with no threads over fake nodes and a fake clock (drive it with ``tick``)."""
    clock = clock or FakeClock()
    store = store or MemoryStore()
    nodes = FakeNodes(clock, store)
    tracker = Tracker(store, nodes, lease=lease, link_wait=link_wait, clock=clock,
                      background=False)
    return tracker, nodes, clock


def join(tracker: Tracker, n: int, first_port: int = 7000) -> list[str]:
    """Register ``n`` nodes named node0.. and measure their links; return their ids."""
    ids = [tracker.register(registration(f"node{i}", first_port + i)) for i in range(n)]
    tracker.measure_links()
    return ids
