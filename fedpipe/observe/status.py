"""``fedpipe status`` in the terminal, with ``rich``: the swarm, or one job.

Renderings take the JSON-shaped views of :mod:`fedpipe.observe.views` (the
same figures the dashboard shows); :func:`run_status` fetches them and prints
them once, or keeps them live with ``watch``. They come from either

- a tracker's gRPC API (a :class:`~fedpipe.observe.source.GrpcSource`, wrapped
  in :class:`SourceViews`): state, plan, steps and events, and each stage's
  measured split against its predicted compute (``JobInfo.stage_times``); or
- a tracker's dashboard (:class:`HttpSource`, ``fedpipe status --dashboard
  URL``): the same views as the page, each stage's predicted and measured
  timings included.
"""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Protocol

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ..units import binary_bytes

from ..net import timeouts
from .source import JobListSource, JobNotFound, JobSource, SwarmSource
from .views import History, job_layout, job_summary, job_view, swarm_view

STATE_STYLE = {"RUNNING": "green", "SUCCEEDED": "bold green", "FAILED": "bold red",
               "CANCELLED": "red", "RECOVERING": "yellow", "PENDING": "yellow", "WAITING": "yellow",
               "PLANNING": "yellow", "DEPLOYING": "yellow", "alive": "green", "lost": "red",
               "draining": "yellow", "left": "dim"}
EVENTS_SHOWN = 15
PIPED_WIDTH = 160
"""Characters a line of ``fedpipe status`` may take when its output is not a terminal (a
file, a pipe) and ``COLUMNS`` is not set: Rich's 80 there squeezed a job's plan table
into headers like ``gro… sta…`` and cut the nodes' addresses."""
"""State changes :func:`job_renderable` lists (the latest)."""


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _error(predicted: float | None, measured: float | None) -> str:
    """Measured against predicted, as a signed percentage ("" without both)."""
    if not predicted or measured is None:
        return ""
    return f" ({(measured / predicted - 1) * 100:+.0f}%)"


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _mib(n: float | None) -> str:
    """Bytes in MiB, or "-" for None."""
    return "-" if n is None else f"{n / 2**20:.1f}"


def _memory(mem: dict) -> str:
    """A stage's predicted and measured peak memory, "PRED / PEAK MiB (+ERR%)"."""
    return f"{_mib(mem['predicted'])} / {_mib(mem['peak'])} MiB" \
        + _error(mem["predicted"], mem["peak"])


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def swarm_renderable(swarm: dict) -> RenderableType:
    """The swarm (a :func:`~fedpipe.observe.views.swarm_view`): nodes, alive, left or
    lost and why, capacity, and the measured links."""
    t = swarm["totals"]
    left = f", {t['left']} left" if t["left"] else ""
    nodes = Table(title=f"{t['alive']} node(s) alive{left}, {t['lost']} lost; "
                        f"{t['flops'] / 1e9:.0f} GFLOP/s, {binary_bytes(t['memory_bytes'])} in all",
                  box=box.SIMPLE_HEAD, title_justify="left")
    for col, just in (("node", "left"), ("name", "left"), ("address", "left"),
                      ("device", "left"), ("GFLOP/s", "right"), ("memory", "right"),
                      ("reach", "left"), ("state", "left")):
        nodes.add_column(col, justify=just)
    for n in swarm["nodes"]:
        nodes.add_row(n["id"], n["name"], n["address"], n["device"], f"{n['flops'] / 1e9:.1f}",
                      binary_bytes(n["memory_bytes"]), n["reach"],
                      Text(n["why"] or n["state"], style=STATE_STYLE[n["state"]]))
    parts: list[RenderableType] = [nodes]
    if swarm["links"]:
        links = Table(title="links", box=box.SIMPLE_HEAD, title_justify="left")
        for col, just in (("from", "left"), ("to", "left"), ("Mbit/s", "right"),
                          ("latency", "right"), ("measured", "right")):
            links.add_column(col, justify=just)
        for m in swarm["links"]:
            links.add_row(m["src_name"], m["dst_name"], f"{m['bandwidth'] * 8 / 1e6:.1f}",
                          _s(m["latency"]), _clock(m["measured_at"]))
        parts.append(links)
    if "jobs" in swarm:  # the jobs its caller may see (a client its own), newest first
        parts.append(_jobs_renderable(swarm["jobs"]))
    return Group(*parts)


def _jobs_renderable(jobs: list[dict]) -> RenderableType:
    """Jobs (each a :func:`~fedpipe.observe.views.job_summary`) as a table: where a job id
    for ``fedpipe status JOB`` is found."""
    if not jobs:
        return Text("no jobs", style="dim")
    t = Table(title="jobs, newest first", box=box.SIMPLE_HEAD, title_justify="left")
    for col, just in (("job", "left"), ("name", "left"), ("state", "left"),
                      ("step", "right"), ("loss", "right"), ("created", "right")):
        t.add_column(col, justify=just)
    for j in jobs:
        t.add_row(j["id"], j["name"], Text(j["state"], style=STATE_STYLE.get(j["state"], "")),
                  f"{j['step']}/{j['steps']}", _f(j["loss"], 4), _clock(j["created"]))
    return t


def _plan_renderables(plan: dict) -> list[RenderableType]:
    """A job's plan (:func:`~fedpipe.observe.views.layout_view`) as a table: per stage
    its node, how peers reach it (when any is outbound-only, as the swarm's nodes say it),
    layers and codecs, whether it recomputes (when any does), its predicted and measured
    timings and its predicted and measured peak memory, once reported."""
    t = Table(title="plan" + (f" ({plan['schedule']})" if plan["schedule"] else ""),
              box=box.SIMPLE_HEAD, title_justify="left")
    stages = [st for group in plan["groups"] for st in group]
    timed = any(st["measured"] or st["predicted_compute"] is not None for st in stages)
    relayed = any(st.get("relay") for st in stages)
    cols = [("group", "right"), ("stage", "right"), ("node", "left")]
    cols += [("reach", "left")] if relayed else []
    cols += [("layers", "left"), ("sends act/grad", "left")]
    recomputes = any(st.get("recompute") for st in stages)
    if recomputes:
        cols += [("recompute", "left")]
    if timed:
        cols += [("predicted compute", "right"), ("compute", "right"), ("wait", "right"),
                 ("send", "right")]
    sized = any(st["memory"]["peak"] or st["memory"]["predicted"] for st in stages)
    if sized:
        cols += [("memory predicted / peak", "right")]
    for col, just in cols + [("", "left")]:
        t.add_column(col, justify=just)
    for st in stages:
        m = st["measured"] or {}
        pred = st["predicted_compute"]
        times = ["yes" if st.get("recompute") else "no"] if recomputes else []
        if timed:
            times += [_s(pred), _s(m.get("compute")) + _error(pred, m.get("compute")),
                      _s(m.get("wait")), _s(m.get("send"))]
        if sized:
            times.append(_memory(st["memory"]))
        reach = [Text(st["reach"], style="yellow" if st["relay"] else "")] if relayed else []
        t.add_row(str(st["replica"]), str(st["stage"]), st["node_name"], *reach,
                  f"{st['layer_start']}-{st['layer_end'] - 1}",
                  f"{st['activation_codec']} / {st['gradient_codec']}", *times,
                  Text("bottleneck", style="bold red") if st["bottleneck"] else "")
    if timed:
        return [t]
    return [t, Text("per-stage timings: once the stages report their steps", style="dim")]


def job_renderable(job: dict) -> RenderableType:
    """One job (a :func:`~fedpipe.observe.views.job_view`): state and reason, progress,
    loss, samples/s, predicted against measured step time, the plan with each
    stage's timings, recoveries and the event log."""
    head = Table.grid(padding=(0, 2))
    head.add_row(Text(job["state"], style=STATE_STYLE.get(job["state"], "")),
                 f"step {job['step']}/{job['steps']}",
                 f"loss {_f(job['loss'], 4)}",
                 f"{_f(job['samples_per_second'], 1)} samples/s",
                 f"step predicted {_s(job['step_seconds']['predicted'])}"
                 f"{' (calibrated)' if job['step_seconds'].get('calibrated') else ''}, "
                 f"measured {_s(job['step_seconds']['measured'])}"
                 + _error(job['step_seconds']['predicted'], job['step_seconds']['measured']),
                 f"checkpoint {job['checkpoint_step'] or '-'}")
    parts: list[RenderableType] = [
        head, ProgressBar(total=max(job["steps"], 1), completed=job["step"], width=60),
        Text(job["reason"], style="dim")]
    plan = job.get("plan")
    if plan:
        parts += _plan_renderables(plan)
    if job["recoveries"]:
        t = Table(title="recoveries", box=box.SIMPLE_HEAD, title_justify="left")
        for col in ("time", "cause", "nodes", "checkpoint", "recomputed", "detect", "replan",
                    "restore"):
            t.add_column(col)
        for r in job["recoveries"]:
            t.add_row(_clock(r["time"]), r["cause"], r["what"], str(r["checkpoint_step"]),
                      str(r["steps_recomputed"]), _s(r["detect_seconds"]),
                      _s(r["replan_seconds"]), _s(r["restore_seconds"]))
        parts.append(t)
    if job["events"]:
        t = Table(title="events", box=box.SIMPLE_HEAD, title_justify="left")
        for col in ("time", "state", "reason"):
            t.add_column(col)
        for e in job["events"][-EVENTS_SHOWN:]:
            t.add_row(_clock(e["time"]), Text(e["state"], style=STATE_STYLE.get(e["state"], "")),
                      e["reason"])
        parts.append(t)
    return Panel(Group(*parts), title=f"job {job['id']} ({job['name']})", title_align="left")


def job_dict(source: JobSource, job_id: str) -> dict:
    """Job ``job_id``'s :func:`~fedpipe.observe.views.job_view` from ``source``, laid out
    as the dashboard lays it out (:func:`~fedpipe.observe.views.job_layout`). Raises
    KeyError for an unknown job (:class:`~fedpipe.observe.source.JobNotFound` from a
    :class:`~fedpipe.observe.source.GrpcSource`)."""
    info = source.job(job_id)
    history = History()
    history.extend(source.events(job_id, 0))
    return job_view(info, history, job_layout(info, history))


class Views(Protocol):
    """Where ``fedpipe status`` gets its JSON-shaped views."""

    def swarm_dict(self) -> dict:
        """The swarm (:func:`~fedpipe.observe.views.swarm_view`)."""

    def job_dict(self, job_id: str) -> dict:
        """One job (:func:`~fedpipe.observe.views.job_view`). KeyError if unknown
        (:class:`~fedpipe.observe.source.JobNotFound` from fedpipe's own)."""


class SourceViews:
    """:class:`Views` computed here from a source (a :class:`~fedpipe.observe.source.GrpcSource`
    for a remote tracker)."""

    def __init__(self, source: SwarmSource | JobSource):
        self.source = source

    def swarm_dict(self) -> dict:
        out = swarm_view(self.source.nodes(include_lost=True), self.source.links())
        jobs = self.source.jobs() if isinstance(self.source, JobListSource) else None
        if jobs is not None:  # None: this caller may not list them
            out["jobs"] = [job_summary(j, None) for j in jobs]
        return out

    def job_dict(self, job_id: str) -> dict:
        return job_dict(self.source, job_id)


class DashboardError(OSError):
    """A tracker's dashboard could not be reached, or answered otherwise than a dashboard
    does; the message names its URL and what went wrong, in one line: ``cannot reach the
    dashboard at http://127.0.0.1:7080: connection refused``."""


ERROR_BYTES = 4096
"""The most bytes of an HTTP error's body read for the dashboard's reason."""


class HttpSource:
    """:class:`Views` as a tracker's dashboard serves them (``GET /api/nodes``,
    ``GET /api/jobs/ID``): each stage's predicted and measured timings included.

    Args:
        url: the dashboard, ``http://HOST:PORT``.
        timeout: seconds per request.

    Errors: :class:`~fedpipe.observe.source.JobNotFound` (a KeyError) for an unknown job;
    :class:`DashboardError` (an ``OSError``) when the dashboard cannot be reached or
    answers an error.
    """

    def __init__(self, url: str, timeout: float = timeouts.CONTROL_RPC):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _get(self, path: str, job_id: str | None = None) -> dict:
        """``GET path``'s JSON; a 404 that says ``no job ...`` is :class:`JobNotFound`
        for ``job_id``, anything else amiss a :class:`DashboardError`."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            said = _error_of(e)
            if e.code == 404 and job_id is not None and said.startswith("no job "):
                raise JobNotFound(job_id, f"the dashboard at {self.url}") from None
            raise DashboardError(f"the dashboard at {self.url} answered GET {path} with "
                                 f"HTTP {e.code}: {said or e.reason}") from None
        except OSError as e:  # refused, timed out, reset (URLError, TimeoutError, ...)
            raise DashboardError(f"cannot reach the dashboard at {self.url}: "
                                 f"{_why(e)}") from None
        except http.client.HTTPException:  # an answer that is not HTTP/1 (gRPC's HTTP/2)
            raise DashboardError(f"{self.url} does not speak HTTP/1.1 (is it the tracker's "
                                 f"--port? give the tracker's --http-port)") from None
        try:
            return json.loads(body)
        except ValueError:
            raise DashboardError(f"{self.url} answered GET {path} with something other "
                                 f"than JSON: is it a fedpipe tracker's dashboard (its "
                                 f"--http-port)?") from None

    def swarm_dict(self) -> dict:
        return {**self._get("/api/nodes"), "jobs": self._get("/api/jobs")["jobs"]}

    def job_dict(self, job_id: str) -> dict:
        return self._get("/api/jobs/" + urllib.parse.quote(job_id, safe=""), job_id)


def _error_of(e: urllib.error.HTTPError) -> str:
    """The dashboard's reason in an HTTP error's body (``{"error": ...}``), or ""."""
    try:
        said = json.loads(e.read(ERROR_BYTES)).get("error", "")
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        return ""
    return said if isinstance(said, str) else ""


def _why(e: BaseException) -> str:
    """Why a request failed, in a few words: ``connection refused``, ``timed out``."""
    cause = e.reason if isinstance(e, urllib.error.URLError) else e
    text = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
    return text[:1].lower() + text[1:]


def status_console() -> Console:
    """The console ``fedpipe status`` prints on: the terminal's width, or
    :data:`PIPED_WIDTH` when stdout is not a terminal and ``COLUMNS`` does not say."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=PIPED_WIDTH)
    return console


def run_status(source: Views | SwarmSource | JobSource, job_id: str | None = None, *,
               watch: bool = False, interval: float = 2.0,
               console: Console | None = None) -> None:
    """``fedpipe status [JOB] [--watch]``: print the swarm or job ``job_id`` once,
    or keep it live every ``interval`` seconds until Ctrl-C (or the job ends).

    Args:
        source: :class:`Views` (an :class:`HttpSource`), or a source the views
            are computed from here (a :class:`~fedpipe.observe.source.GrpcSource`).

    Raises:
        KeyError: no such job (:class:`~fedpipe.observe.source.JobNotFound` from
            fedpipe's sources, naming the job and where it was asked).
        grpc.RpcError: the tracker is unreachable or refused the call.
        DashboardError: (an OSError) the dashboard is unreachable or answered an error.
    """
    console = console or status_console()
    views = source if hasattr(source, "job_dict") else SourceViews(source)

    def render() -> tuple[RenderableType, bool]:
        if job_id:
            job = views.job_dict(job_id)
            return job_renderable(job), job["terminal"]
        return swarm_renderable(views.swarm_dict()), False

    if not watch:
        console.print(render()[0])
        return
    watch_live(render, interval, console)


def watch_live(render: Callable[[], tuple[RenderableType, bool]], interval: float,
               console: Console) -> None:
    """Redraw ``render()``'s renderable every ``interval`` seconds until it says it
    is done, or Ctrl-C."""
    with Live(render()[0], console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                view, done = render()
                live.update(view)
                if done:
                    return
        except KeyboardInterrupt:
            return
