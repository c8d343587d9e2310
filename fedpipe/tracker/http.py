"""The tracker's dashboard: a small JSON API and the page built from it.

Served by the standard library's ``ThreadingHTTPServer`` on its own threads,
read-only, from the tracker's state (any :class:`~fedpipe.observe.source.Source`).
It has no authentication, so it binds 127.0.0.1 unless told otherwise.

API (every body is JSON; numbers in base units: seconds, bytes, bytes/s, FLOP/s;
times in seconds since the epoch; a number that is not finite is ``null``):

``GET /api/nodes``
    The swarm: ``nodes`` (id, name, address, device, flops, memory_bytes,
    alive, state, why ...), ``links`` (src, dst, bandwidth, latency,
    measured_at), ``matrix`` (``names``, ``bandwidth[i][j]``, ``latency[i][j]``
    from node i to node j, ``null`` where unmeasured) and ``totals`` (alive,
    lost, the live nodes' flops and memory_bytes).
``GET /api/jobs[?limit=N]``
    ``jobs``: the N (default 100, at most 1000) most recent jobs, newest first:
    id, name, state, reason, step, steps, progress, loss, samples_per_second,
    epoch, checkpoint_step, recoveries.
``GET /api/jobs/ID[?after_seq=S]``
    One job: its summary fields plus ``plan`` (replica groups of stages with
    node, device, layers, codecs, predicted compute and send seconds,
    measured split, and the ``bottleneck``), ``step_seconds`` (predicted,
    measured), ``history`` (step, time, loss, samples_per_second, epoch, seq,
    stages), ``events`` (state changes with reasons), ``checkpoints``,
    ``recoveries``, ``config`` and ``last_seq``. With ``after_seq``, only the
    history, events and checkpoints after that sequence number.
``GET /metrics``
    The tracker's Prometheus metrics, when a registry is given.
``GET /``
    The dashboard page (``static/``: plain JavaScript and SVG, nothing fetched
    from the internet).

Errors are JSON ``{"error": "..."}`` with 400 (a bad parameter), 404 (no such
job or path) or 500 (a fault reading the state; the server keeps serving).
"""
from __future__ import annotations

import itertools
import json
import logging
import re
import time
from http.server import BaseHTTPRequestHandler
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from ..observe.serving import LOCALHOST, Served, serve
from ..observe.source import Histories, Source, stage_times_of
from ..observe.views import PlanLayout, StageTime, job_layout, job_summary, job_view, swarm_view
from ..proto import node_pb2, tracker_pb2
from .clients import Feeders
from .jobs import MAX_LIST_JOBS, newest_jobs
from .registry import Registry
from .stagetimes import StageTimes
from .store import Store

log = logging.getLogger("fedpipe.tracker.http")

STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
"""The dashboard's files (in ``fedpipe/tracker/static``) and their content types."""

_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class TrackerSource:
    """The running tracker's state as a :class:`~fedpipe.observe.source.Source`: its
    store, plus the stage times it keeps in memory
    (:class:`~fedpipe.observe.source.StageTimeSource`).

    Args:
        store: the tracker's store.
        stage_times: the stage times the tracker keeps in memory
            (:class:`~fedpipe.tracker.stagetimes.StageTimes`).
        feeders: the tracker's :class:`~fedpipe.tracker.clients.Feeders`, which count
            down a WAITING job's time left as it is shown (None: reasons as stored).
        registry: the tracker's :class:`~fedpipe.tracker.registry.Registry`, which
            says why each lost node went (``NodeInfo.lost_reason``; None: not said).
    """

    def __init__(self, store: Store, stage_times: StageTimes, feeders: Feeders | None = None,
                 registry: Registry | None = None):
        self.store, self.times, self.feeders, self.registry = store, stage_times, feeders, registry

    def nodes(self, include_lost: bool = False) -> list[tracker_pb2.NodeInfo]:
        nodes = self.store.nodes(include_lost)
        return self.registry.from_memory(nodes) if self.registry is not None else nodes

    def links(self) -> list[node_pb2.LinkMeasurement]:
        return self.store.links()

    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        job = self.store.job(job_id)
        return self.feeders.shown(job) if self.feeders is not None else job

    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        return self.store.events(job_id, after_seq)

    def jobs_in(self, *states: int) -> list[str]:
        return self.store.jobs_in(*states)

    def spec(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        return self.store.spec(job_id)

    def stage_times(self, job_id: str) -> list[StageTime]:
        return self.times.of(job_id)


class BadRequest(ValueError):
    """A request the API refuses (400), with the reason."""


class Dashboard:
    """The API's answers, from a source; shared by the server's threads.

    Args:
        source: the tracker's state.
        histories: the jobs' step histories (share one with the metrics collector
            so each event is read once); default: a cache of its own.
    """

    def __init__(self, source: Source, histories: Histories | None = None):
        self.source = source
        self.histories = histories if histories is not None else Histories(source)

    def nodes(self) -> dict:
        """``GET /api/nodes``."""
        return swarm_view(self.source.nodes(include_lost=True), self.source.links())

    def jobs(self, limit: int = 100) -> dict:
        """``GET /api/jobs``: the ``limit`` most recent jobs, newest first."""
        if not 1 <= limit <= MAX_LIST_JOBS:
            raise BadRequest(f"limit must be 1..{MAX_LIST_JOBS}, got {limit}")
        return {"time": time.time(),
                "jobs": [job_summary(info, self.histories.get(info.job_id).last)
                         for info in itertools.islice(newest_jobs(self.source), limit)]}

    def job(self, job_id: str, after_seq: int = 0) -> dict:
        """``GET /api/jobs/ID``. Raises KeyError for an unknown job."""
        info = self.source.job(job_id)
        history = self.histories.get(job_id)
        try:
            config = self.source.spec(job_id).config
        except KeyError:
            config = None
        out = job_view(info, history, self.layout(info, history), config)
        if after_seq:
            for key in ("history", "events", "checkpoints"):
                out[key] = [x for x in out[key] if x["seq"] > after_seq]
        return out

    def layout(self, info: tracker_pb2.JobInfo, history) -> PlanLayout | None:
        """The job's plan laid out as ``fedpipe status`` lays it out
        (:func:`~fedpipe.observe.views.job_layout`), with the nodes' devices and the
        stage times the tracker keeps; None before it is planned."""
        devices = {n.node_id: n.resources.device for n in self.source.nodes(include_lost=True)}
        return job_layout(info, history, stage_times_of(self.source, info.job_id) or None,
                          devices)


def _int(query: dict, name: str, default: int) -> int:
    values = query.get(name)
    if not values:
        return default
    try:
        return int(values[-1])
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {values[-1]!r}") from None


class _Handler(BaseHTTPRequestHandler):
    """Serves :attr:`dashboard` (and :attr:`registry` at /metrics); :func:`handler` makes
    a subclass with both set."""

    server_version = "fedpipe-dashboard"
    dashboard: Dashboard
    registry: CollectorRegistry | None = None

    def log_message(self, fmt, *args):  # to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj, allow_nan=False).encode(), "application/json")

    def do_GET(self):  # noqa: N802 — the stdlib's name
        url = urlsplit(self.path)
        try:
            self._route(url.path.rstrip("/") or "/", parse_qs(url.query))
        except BadRequest as e:
            self._json(400, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away
        except Exception as e:  # noqa: BLE001 — answer, and keep serving others
            log.exception("dashboard request %s failed", url.path)
            try:
                self._json(500, {"error": f"{type(e).__name__}: {e}"})
            except OSError:
                pass

    def _route(self, path: str, query: dict) -> None:
        if path == "/":
            return self._static("index.html")
        if path.startswith("/static/"):
            return self._static(path.removeprefix("/static/"))
        if path == "/api/nodes":
            return self._json(200, self.dashboard.nodes())
        if path == "/api/jobs":
            return self._json(200, self.dashboard.jobs(_int(query, "limit", 100)))
        if path.startswith("/api/jobs/"):
            return self._job(path.removeprefix("/api/jobs/"), query)
        if path == "/metrics" and self.registry is not None:
            return self._send(200, generate_latest(self.registry),
                              "text/plain; version=0.0.4; charset=utf-8")
        self._json(404, {"error": f"no such path: {urlsplit(self.path).path[:200]}"})

    def _job(self, job_id: str, query: dict) -> None:
        if not _JOB_ID.fullmatch(job_id):
            raise BadRequest(f"a job id is 1-64 letters, digits, _ or -; got {job_id[:80]!r}")
        try:
            body = self.dashboard.job(job_id, _int(query, "after_seq", 0))
        except KeyError:
            return self._json(404, {"error": f"no job {job_id!r}"})
        self._json(200, body)

    def _static(self, name: str) -> None:
        if name not in STATIC:
            return self._json(404, {"error": f"no such file: {name[:200]}"})
        body = resources.files(__package__).joinpath("static", name).read_bytes()
        self._send(200, body, STATIC[name])


def handler(dashboard: Dashboard, registry: CollectorRegistry | None) -> type:
    """A request handler class serving ``dashboard`` (and ``registry`` at /metrics)."""
    return type("Handler", (_Handler,), {"dashboard": dashboard, "registry": registry})


def start_http(source: Source, host: str = LOCALHOST, port: int = 0, *,
               registry: CollectorRegistry | None = None,
               histories: Histories | None = None) -> Served:
    """Serve the dashboard and its JSON API over ``source`` at ``http://HOST:PORT/``.

    Args:
        source: the tracker's state (its store).
        host: address to bind; 127.0.0.1 by default, since there is no
            authentication.
        port: port to bind (0: any free one; read it from the result's ``port``).
        registry: also serve these metrics at ``/metrics`` (e.g.
            :func:`fedpipe.observe.metrics.tracker_registry`).
        histories: a :class:`~fedpipe.observe.source.Histories` shared with the
            metrics collector.

    Returns:
        The running server; ``close()`` it to stop.

    Raises:
        OSError: the address cannot be bound.
    """
    return serve(handler(Dashboard(source, histories), registry), host, port, "dashboard")
