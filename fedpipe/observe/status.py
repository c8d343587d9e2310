"""``fedpipe status`` in the terminal, with ``rich``: the swarm, or one job.

Renderings take the JSON-shaped views of :mod:`fedpipe.observe.views` (the
same figures the dashboard shows); :func:`run_status` fetches them from a
source (``GrpcSource`` for a remote tracker) and prints them once, or keeps
them live with ``watch``.
"""
from __future__ import annotations

import time
from typing import Callable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .source import JobSource, SwarmSource
from .views import History, job_view, measured_step_seconds, plan_from_message, plan_layout, \
    swarm_view

STATE_STYLE = {"RUNNING": "green", "SUCCEEDED": "bold green", "FAILED": "bold red",
               "CANCELLED": "red", "RECOVERING": "yellow", "PENDING": "yellow",
               "PLANNING": "yellow", "DEPLOYING": "yellow", "alive": "green", "lost": "red"}
EVENTS_SHOWN = 15
"""State changes :func:`job_renderable` lists (the latest)."""


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def swarm_renderable(swarm: dict) -> RenderableType:
    """The swarm (a :func:`~fedpipe.observe.views.swarm_view`): nodes, alive or lost
    and why, capacity, and the measured links."""
    t = swarm["totals"]
    nodes = Table(title=f"{t['alive']} node(s) alive, {t['lost']} lost; "
                        f"{t['flops'] / 1e9:.0f} GFLOP/s, {_bytes(t['memory_bytes'])} in all",
                  box=box.SIMPLE_HEAD, title_justify="left")
    for col, just in (("node", "left"), ("name", "left"), ("address", "left"),
                      ("device", "left"), ("GFLOP/s", "right"), ("memory", "right"),
                      ("state", "left")):
        nodes.add_column(col, justify=just)
    for n in swarm["nodes"]:
        nodes.add_row(n["id"], n["name"], n["address"], n["device"], f"{n['flops'] / 1e9:.1f}",
                      _bytes(n["memory_bytes"]),
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
    return Group(*parts)


def job_renderable(job: dict) -> RenderableType:
    """One job (a :func:`~fedpipe.observe.views.job_view`): state and reason, progress,
    loss, samples/s, predicted against measured step time, the plan with each
    stage's timings, recoveries and the event log."""
    head = Table.grid(padding=(0, 2))
    head.add_row(Text(job["state"], style=STATE_STYLE.get(job["state"], "")),
                 f"step {job['step']}/{job['steps']}",
                 f"loss {_f(job['loss'], 4)}",
                 f"{_f(job['samples_per_second'], 1)} samples/s",
                 f"step predicted {_s(job['step_seconds']['predicted'])}, "
                 f"measured {_s(job['step_seconds']['measured'])}",
                 f"checkpoint {job['checkpoint_step'] or '-'}")
    parts: list[RenderableType] = [
        head, ProgressBar(total=max(job["steps"], 1), completed=job["step"], width=60),
        Text(job["reason"], style="dim")]
    plan = job.get("plan")
    if plan:
        t = Table(title="plan" + (f" ({plan['schedule']})" if plan["schedule"] else ""),
                  box=box.SIMPLE_HEAD, title_justify="left")
        for col, just in (("group", "right"), ("stage", "right"), ("node", "left"),
                          ("layers", "left"), ("sends act/grad", "left"),
                          ("predicted", "right"), ("compute", "right"), ("wait", "right"),
                          ("send", "right"), ("", "left")):
            t.add_column(col, justify=just)
        for group in plan["groups"]:
            for s in group:
                m = s["measured"] or {}
                pred = (None if s["predicted_compute"] is None
                        else s["predicted_compute"] + (s["predicted_send"] or 0.0))
                t.add_row(str(s["replica"]), str(s["stage"]), s["node_name"],
                          f"{s['layer_start']}-{s['layer_end'] - 1}",
                          f"{s['activation_codec']} / {s['gradient_codec']}", _s(pred),
                          _s(m.get("compute")), _s(m.get("wait")), _s(m.get("send")),
                          Text("bottleneck", style="bold red") if s["bottleneck"] else "")
        parts.append(t)
    if job["recoveries"]:
        t = Table(title="recoveries", box=box.SIMPLE_HEAD, title_justify="left")
        for col in ("time", "lost", "checkpoint", "recomputed", "detect", "replan", "restore"):
            t.add_column(col)
        for r in job["recoveries"]:
            t.add_row(_clock(r["time"]), r["lost"], str(r["checkpoint_step"]),
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
    """Job ``job_id``'s :func:`~fedpipe.observe.views.job_view` from ``source``
    (its plan without per-stage predictions: a remote tracker does not serve
    the model profile). Raises KeyError for an unknown job."""
    info = source.job(job_id)
    history = History()
    history.extend(source.events(job_id, 0))
    layout = None
    if info.plan.stages:
        layout = plan_layout(plan_from_message(info.plan),
                             names={a.node_id: a.node_name for a in info.plan.stages},
                             measured_step=measured_step_seconds(history.records))
    return job_view(info, history, layout)


def run_status(source: SwarmSource | JobSource, job_id: str | None = None, *,
               watch: bool = False, interval: float = 2.0,
               console: Console | None = None) -> None:
    """``fedpipe status [JOB] [--watch]``: print the swarm or job ``job_id`` once,
    or keep it live every ``interval`` seconds until Ctrl-C (or the job ends).

    Raises:
        KeyError: no such job.
        grpc.RpcError: the tracker is unreachable.
    """
    console = console or Console()

    def render() -> tuple[RenderableType, bool]:
        if job_id:
            job = job_dict(source, job_id)
            return job_renderable(job), job["terminal"]
        return swarm_renderable(swarm_view(source.nodes(include_lost=True), source.links())), \
            False

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
