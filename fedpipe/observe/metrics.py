"""Every Prometheus metric fedpipe exports, defined once (``prometheus-client``).

Names and units follow the Prometheus conventions: base units (seconds,
bytes, bytes per second), ``_total`` for counters, ``_info`` for gauges that
are always 1 and carry their facts as labels. :data:`METRICS` is the one table
of them; ``docs/metrics.md`` documents each (a test checks both agree).

Two processes export them, each on its own ``--metrics-port`` (0: off):

- a **node** (:class:`NodeMetrics`) times its stages and counts the bytes it
  sends: ``fedpipe_stage_*`` and ``fedpipe_link_sent_*``;
- the **tracker** (:class:`SwarmCollector`) reads its state at each scrape:
  ``fedpipe_node_*``, ``fedpipe_link_bandwidth/latency/codec``,
  ``fedpipe_job_*`` (with each stage's step split as the stages reported it,
  when the source keeps it), ``fedpipe_jobs``.

Both registries also carry the standard ``process_*`` metrics (CPU seconds,
resident memory) of their process.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from ..proto import tracker_pb2
from ..spec import ACTIVE, Kind, PlanView, state_name
from .serving import LOCALHOST, Served, serve
from .source import Histories, Source, stage_times_of
from .views import measured_step_seconds


@dataclass(frozen=True)
class MetricDef:
    """One exported metric.

    Attributes:
        name: the exposed name (counters with their ``_total``).
        kind: "counter", "gauge" or "histogram".
        labels: its label names, in order.
        help: one line: what it measures and in which unit.
        exporter: "node" or "tracker": the process that exports it.
    """

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    exporter: str

    @property
    def base(self) -> str:
        """The name prometheus_client wants (without a counter's ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


STAGE = ("job", "replica", "stage")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, float("inf"))
"""Histogram buckets of a stage's step parts, seconds: 1 ms (a tiny model on a fast
machine) to a minute (a large model over the internet)."""

PARTS = ("compute", "wait", "send")
"""How a stage's step splits: forward, backward and optimizer; waiting for tensors
from peers; handing tensors to the senders."""

METRICS: tuple[MetricDef, ...] = (
    # -- node: stages ----------------------------------------------------------------
    MetricDef("fedpipe_stage_step_seconds", "histogram", (*STAGE, "part"),
              "Seconds of one step a stage spent on each part: compute, wait or send.", "node"),
    MetricDef("fedpipe_stage_microbatches_in_flight", "gauge", STAGE,
              "Microbatches a stage has run forward but not yet backward: the most at once "
              "during its last step.", "node"),
    MetricDef("fedpipe_stage_staleness_steps", "gauge", STAGE,
              "Async schedules: weight versions the stage ran ahead of its gradients: the most "
              "during its last step (0 under gpipe and 1f1b).", "node"),
    # -- node: links it sends on -------------------------------------------------------
    MetricDef("fedpipe_link_sent_bytes_total", "counter", ("src", "dst", "encoding"),
              "Tensor bytes sent from node src to node dst: raw (before the codec) or "
              "encoded (on the wire).", "node"),
    MetricDef("fedpipe_link_sent_tensors_total", "counter", ("src", "dst", "kind"),
              "Tensors sent from node src to node dst, by kind (activation, gradient, ...).",
              "node"),
    MetricDef("fedpipe_link_transport_tensors_total", "counter", ("src", "dst", "transport"),
              "Tensors sent from node src to node dst, by the data plane that carried them: "
              "socket (the node's data port) or grpc.", "node"),
    # -- tracker: nodes ----------------------------------------------------------------
    MetricDef("fedpipe_node_alive", "gauge", ("node", "name"),
              "1 while the node holds its lease, 0 once it is lost.", "tracker"),
    MetricDef("fedpipe_node_flops", "gauge", ("node", "name", "device"),
              "The node's measured float32 matmul speed, FLOP per second.", "tracker"),
    MetricDef("fedpipe_node_memory_bytes", "gauge", ("node", "name"),
              "Memory the node offers to stages, bytes.", "tracker"),
    MetricDef("fedpipe_node_last_heartbeat_timestamp_seconds", "gauge", ("node", "name"),
              "When the node's last heartbeat came, seconds since the epoch.", "tracker"),
    # -- tracker: links ----------------------------------------------------------------
    MetricDef("fedpipe_link_bandwidth_bytes_per_second", "gauge", ("src", "dst"),
              "Measured bandwidth of the link from node src to node dst, bytes per second.",
              "tracker"),
    MetricDef("fedpipe_link_latency_seconds", "gauge", ("src", "dst"),
              "Measured one-way latency of the link from node src to node dst, seconds.",
              "tracker"),
    MetricDef("fedpipe_link_codec_info", "gauge", ("job", "src", "dst", "tensor", "codec"),
              "1 for the codec an active job's plan uses on a link for activations or "
              "gradients.", "tracker"),
    # -- tracker: jobs -----------------------------------------------------------------
    MetricDef("fedpipe_jobs", "gauge", ("state",),
              "Jobs the tracker knows, by state.", "tracker"),
    MetricDef("fedpipe_job_state", "gauge", ("job", "name", "state"),
              "1 for an active job's current state.", "tracker"),
    MetricDef("fedpipe_job_step", "gauge", ("job",),
              "The last completed step of an active job.", "tracker"),
    MetricDef("fedpipe_job_steps", "gauge", ("job",),
              "The steps an active job trains for.", "tracker"),
    MetricDef("fedpipe_job_loss", "gauge", ("job",),
              "The loss of an active job's last completed step.", "tracker"),
    MetricDef("fedpipe_job_samples_per_second", "gauge", ("job",),
              "Samples per second of an active job's last recorded step.", "tracker"),
    MetricDef("fedpipe_job_recoveries_total", "counter", ("job",),
              "Recoveries of an active job from lost nodes.", "tracker"),
    MetricDef("fedpipe_job_step_seconds", "gauge", ("job", "kind"),
              "An active job's step time, seconds: predicted by its plan, or measured "
              "(median gap between recent consecutive steps).", "tracker"),
    MetricDef("fedpipe_job_stage_step_seconds", "gauge", (*STAGE, "part"),
              "Seconds of a step an active job's stage spends on each part (compute, wait, "
              "send): the median of its last reported steps.", "tracker"),
    MetricDef("fedpipe_job_stage_memory_bytes", "gauge", (*STAGE, "kind"),
              "An active job's stage's memory, bytes: predicted by the planner, or the "
              "measured peak (GPU: max allocated; CPU: the node's peak RSS over its RSS "
              "before the stage loaded).", "tracker"),
)

_BY_NAME = {m.name: m for m in METRICS}


def metric(name: str) -> MetricDef:
    """The definition of metric ``name``. KeyError if fedpipe exports no such metric."""
    return _BY_NAME[name]


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    return reg


def _make(d: MetricDef, registry: CollectorRegistry):
    if d.kind == "counter":
        return Counter(d.base, d.help, d.labels, registry=registry)
    if d.kind == "gauge":
        return Gauge(d.base, d.help, d.labels, registry=registry)
    return Histogram(d.base, d.help, d.labels, registry=registry, buckets=STEP_BUCKETS)


class NodeMetrics:
    """A node's metrics: its stages' step times and the tensors it sends.

    The node calls :meth:`stage_step` once per completed step of each stage,
    :meth:`sent` once per tensor handed to a peer, and :meth:`forget_job` when
    it drops a job's stages (so a finished job's series stop being exported).
    Thread-safe.

    Args:
        node: the node's name, the ``src`` of its links.
        registry: where the metrics live (default: a new one of their own, with
            the process collectors).
    """

    def __init__(self, node: str, registry: CollectorRegistry | None = None):
        self.node = node
        self.registry = registry if registry is not None else _registry()
        m = {d.name: _make(d, self.registry) for d in METRICS if d.exporter == "node"}
        self._step = m["fedpipe_stage_step_seconds"]
        self._in_flight = m["fedpipe_stage_microbatches_in_flight"]
        self._staleness = m["fedpipe_stage_staleness_steps"]
        self._bytes = m["fedpipe_link_sent_bytes_total"]
        self._tensors = m["fedpipe_link_sent_tensors_total"]
        self._transport = m["fedpipe_link_transport_tensors_total"]
        self._lock = threading.Lock()
        self._stages: dict[str, set[tuple[str, str]]] = {}
        # the link counters' children by (dst, kind, transport): a labels() lookup costs
        # several us, four a tensor sent (link series are never removed)
        self._links: dict[tuple[str, int, str], tuple[Any, Any, Any, Any]] = {}

    def _key(self, job: str, replica: int, stage: int) -> tuple[str, str, str]:
        with self._lock:
            self._stages.setdefault(job, set()).add((str(replica), str(stage)))
        return job, str(replica), str(stage)

    def stage_step(self, job: str, replica: int, stage: int, *, compute: float, wait: float,
                   send: float) -> None:
        """A stage completed a step: its seconds of compute, waiting and sending.

        Raises:
            ValueError: a negative or non-finite time.
        """
        key = self._key(job, replica, stage)
        for part, seconds in zip(PARTS, (compute, wait, send)):
            if not 0.0 <= seconds < float("inf"):
                raise ValueError(f"stage {part} time must be finite and >= 0 s, got {seconds}")
            self._step.labels(*key, part).observe(seconds)

    def in_flight(self, job: str, replica: int, stage: int, microbatches: int) -> None:
        """Microbatches the stage has run forward but not yet backward (the most at once
        in its last step: :attr:`~fedpipe.runtime.stage.StepResult.in_flight`)."""
        self._in_flight.labels(*self._key(job, replica, stage)).set(microbatches)

    def staleness(self, job: str, replica: int, stage: int, versions: int) -> None:
        """Async schedules: weight versions the stage ran ahead of its gradients (the
        most in its last step: :attr:`~fedpipe.runtime.stage.StepResult.staleness`)."""
        self._staleness.labels(*self._key(job, replica, stage)).set(versions)

    def sent(self, dst: str, kind: Kind | int, raw_bytes: int, encoded_bytes: int,
             transport: str = "grpc") -> None:
        """A tensor went to node ``dst``: ``raw_bytes`` before its codec (the
        tensor's ``payload_bytes`` of a raw encoding), ``encoded_bytes`` on the wire,
        over ``transport`` (``socket`` or ``grpc``).

        Raises:
            ValueError: a negative size, or a kind that is not a :class:`~fedpipe.spec.Kind`.
        """
        if raw_bytes < 0 or encoded_bytes < 0:
            raise ValueError(f"sizes must be >= 0 bytes, got raw {raw_bytes}, "
                             f"encoded {encoded_bytes}")
        key = (dst, int(kind), transport)
        children = self._links.get(key)
        if children is None:  # Kind() raises ValueError for a kind that is none
            children = self._links[key] = (
                self._bytes.labels(self.node, dst, "raw"),
                self._bytes.labels(self.node, dst, "encoded"),
                self._tensors.labels(self.node, dst, Kind(kind).name.lower()),
                self._transport.labels(self.node, dst, transport))
        raw, encoded, tensors, via = children
        raw.inc(raw_bytes)
        encoded.inc(encoded_bytes)
        tensors.inc()
        via.inc()

    def forget_job(self, job: str) -> None:
        """Stop exporting the stage series of ``job`` (its stages were dropped)."""
        with self._lock:
            stages = self._stages.pop(job, set())
        for replica, stage in stages:
            for part in PARTS:
                _remove(self._step, job, replica, stage, part)
            _remove(self._in_flight, job, replica, stage)
            _remove(self._staleness, job, replica, stage)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never set for this stage
        pass


class SwarmCollector(Collector):
    """The tracker's metrics, read from its state at each scrape.

    Nodes and links are the source's; jobs are the active ones (PLANNING to
    RECOVERING), plus a count of all jobs by state: a finished job's series
    end with it, as Prometheus expects of a target's state.

    Args:
        source: the tracker's store (or any :class:`~fedpipe.observe.source.Source`).
        histories: where the jobs' step histories are cached (shared with the
            dashboard so each event is read once); default: a cache of its own.
    """

    def __init__(self, source: Source, histories: Histories | None = None):
        self.source = source
        self.histories = histories if histories is not None else Histories(source)

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time; nothing to check at registration

    def _family(self, name: str):
        d = _BY_NAME[name]
        cls = CounterMetricFamily if d.kind == "counter" else GaugeMetricFamily
        return cls(d.base, d.help, labels=d.labels)

    def collect(self) -> Iterator[Metric]:
        f = {d.name: self._family(d.name) for d in METRICS if d.exporter == "tracker"}
        names = self._nodes(f)
        for m in self.source.links():
            pair = [names.get(m.src_id, m.src_id), names.get(m.dst_id, m.dst_id)]
            f["fedpipe_link_bandwidth_bytes_per_second"].add_metric(pair, m.bandwidth)
            f["fedpipe_link_latency_seconds"].add_metric(pair, m.latency)
        counts = dict.fromkeys(tracker_pb2.JobState.values(), 0)
        counts.pop(tracker_pb2.JOB_STATE_UNSPECIFIED)
        for state in counts:
            counts[state] = len(self.source.jobs_in(state))
        for state, count in counts.items():
            f["fedpipe_jobs"].add_metric([state_name(state)], count)
        for job_id in self.source.jobs_in(*ACTIVE):
            try:
                info = self.source.job(job_id)
            except KeyError:  # gone between the two reads
                continue
            self._job(f, job_id, info)
        yield from f.values()

    def _nodes(self, f: dict[str, Any]) -> dict[str, str]:
        """Add every node's series to ``f``; returns node names by id."""
        nodes = self.source.nodes(include_lost=True)
        for n in nodes:
            f["fedpipe_node_alive"].add_metric([n.node_id, n.name], 1.0 if n.alive else 0.0)
            f["fedpipe_node_flops"].add_metric([n.node_id, n.name, n.resources.device],
                                               n.resources.flops)
            f["fedpipe_node_memory_bytes"].add_metric([n.node_id, n.name],
                                                      n.resources.memory_bytes)
            f["fedpipe_node_last_heartbeat_timestamp_seconds"].add_metric(
                [n.node_id, n.name], n.last_heartbeat)
        return {n.node_id: n.name for n in nodes}

    def _job(self, f: dict[str, Any], job_id: str, info: tracker_pb2.JobInfo) -> None:
        """Add an active job's series to ``f``: progress, step times, stages, codecs."""
        history = self.histories.get(job_id)
        f["fedpipe_job_state"].add_metric([job_id, info.name, state_name(info.state)], 1.0)
        f["fedpipe_job_step"].add_metric([job_id], info.step)
        f["fedpipe_job_steps"].add_metric([job_id], info.steps)
        if info.step:
            f["fedpipe_job_loss"].add_metric([job_id], info.loss)
        if history.last is not None:
            f["fedpipe_job_samples_per_second"].add_metric(
                [job_id], history.last.samples_per_second)
        f["fedpipe_job_recoveries_total"].add_metric([job_id], len(info.recoveries))
        if info.plan.predicted_step_seconds:
            f["fedpipe_job_step_seconds"].add_metric([job_id, "predicted"],
                                                     info.plan.predicted_step_seconds)
        measured = measured_step_seconds(history.records)
        if measured is not None:
            f["fedpipe_job_step_seconds"].add_metric([job_id, "measured"], measured)
        for t in stage_times_of(self.source, job_id):
            for part, seconds in zip(PARTS, (t.compute, t.wait, t.send)):
                f["fedpipe_job_stage_step_seconds"].add_metric(
                    [job_id, str(t.replica), str(t.stage), part], seconds)
            for kind, nbytes in (("predicted", t.predicted_memory), ("peak", t.peak_memory)):
                if nbytes:
                    f["fedpipe_job_stage_memory_bytes"].add_metric(
                        [job_id, str(t.replica), str(t.stage), kind], nbytes)
        for chain in PlanView(info.plan).chains():
            for a, b in zip(chain, chain[1:]):
                f["fedpipe_link_codec_info"].add_metric(
                    [job_id, a.node_name, b.node_name, "activation", a.activation_codec], 1)
                f["fedpipe_link_codec_info"].add_metric(
                    [job_id, b.node_name, a.node_name, "gradient", b.gradient_codec], 1)


def tracker_registry(source: Source, histories: Histories | None = None) -> CollectorRegistry:
    """A registry with the tracker's metrics over ``source`` and the process collectors."""
    reg = _registry()
    reg.register(SwarmCollector(source, histories))
    return reg


def start_metrics(registry: CollectorRegistry, port: int, host: str = LOCALHOST) -> Served:
    """Serve ``registry`` in the Prometheus text format at ``http://HOST:PORT/metrics``.

    ``port`` 0 binds any free port (the CLI's ``--metrics-port 0`` means off:
    it does not call this). Close the returned :class:`Served` to stop.

    Raises:
        OSError: the address cannot be bound.
    """
    return serve(MetricsHandler.factory(registry), host, port, "metrics")
