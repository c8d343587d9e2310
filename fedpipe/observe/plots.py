"""Pictures with matplotlib: a job's loss and throughput curves, and a plan.

Figures are built on :class:`matplotlib.figure.Figure` directly (no pyplot
state, no display needed), returned for inspection and saved when given a path
(the format follows the suffix: .png, .svg, .pdf).

Used by ``Job.plot(path)``, ``fedpipe plot JOB -o FILE.png`` (:func:`plot_job`)
and ``fedpipe plan ... --draw FILE.png`` (:func:`draw_plan`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from ..recovery_text import recovery_what
from ..spec import state_name
from .source import JobSource
from .views import PlanLayout, StepRecord, latest_per_step, step_records
from ..units import layer_range

LOSS_TITLE = "loss"
THROUGHPUT_TITLE = "throughput"


def _save(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def history_figure(records: Sequence[StepRecord], *, title: str = "",
                   marks: Sequence[tuple[float, str]] = ()) -> Figure:
    """Loss against step (the last record of a replayed step wins) and samples/s
    against seconds since the first step, side by side.

    Args:
        records: a job's step records (:func:`~fedpipe.observe.views.step_records`).
        title: the figure's title.
        marks: ``(time, label)`` events to draw as vertical lines on the
            throughput curve (recoveries, a node lost), times in seconds since
            the epoch.

    Raises:
        ValueError: no records.
    """
    if not records:
        raise ValueError("no step recorded yet: nothing to plot")
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_loss, ax_tput = fig.subplots(1, 2)
    steps = latest_per_step(records)
    ax_loss.plot([r.step for r in steps], [r.loss for r in steps], color="tab:blue")
    ax_loss.set(title=LOSS_TITLE, xlabel="step", ylabel="loss")
    t0 = records[0].time
    ax_tput.plot([r.time - t0 for r in records], [r.samples_per_second for r in records],
                 color="tab:green")
    ax_tput.set(title=THROUGHPUT_TITLE, xlabel="seconds since the first step",
                ylabel="samples/s")
    for t, label in marks:
        ax_tput.axvline(t - t0, color="tab:red", linestyle="--", linewidth=1)
        ax_tput.annotate(label, (t - t0, 1), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=8, color="tab:red")
    for ax in (ax_loss, ax_tput):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def plot_history(records: Sequence[StepRecord], path: str | Path, **kw) -> Figure:
    """:func:`history_figure`, saved to ``path``."""
    return _save(history_figure(records, **kw), path)


def plot_job(source: JobSource, job_id: str, path: str | Path) -> Figure:
    """``fedpipe plot JOB -o FILE``: job ``job_id``'s curves, its recoveries marked.

    Raises:
        KeyError: no such job (:class:`~fedpipe.observe.source.JobNotFound` from a
            :class:`~fedpipe.observe.source.GrpcSource`).
        ValueError: it has no step recorded yet.
    """
    info = source.job(job_id)
    records = step_records(source.events(job_id, 0))
    marks = [(r.time, recovery_what(r)) for r in info.recoveries]
    return plot_history(records, path, marks=marks,
                        title=f"job {job_id} ({info.name}): {state_name(info.state)}, "
                              f"step {info.step}/{info.steps}")


BOX_W, BOX_H, GAP_X, GAP_Y = 3.0, 1.5, 1.6, 0.7
"""A stage box's size and the gaps between boxes, in the plan drawing's data units."""


def _seconds(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def plan_figure(layout: PlanLayout, title: str = "") -> Figure:
    """A plan drawn: one row per replica group, one box per stage (node, device,
    layers, predicted or measured seconds per step), each link's codecs on the
    arrows between (activations above, gradients below), the bottleneck stage
    in red.

    Raises:
        ValueError: a plan without stages.
    """
    if not layout.stages:
        raise ValueError("the plan has no stages to draw")
    cols = max(len(g) for g in layout.groups)
    rows = len(layout.groups)
    width = cols * BOX_W + (cols - 1) * GAP_X  # data units, without the group labels
    height = rows * BOX_H + (rows - 1) * GAP_Y + 0.6
    fig = Figure(figsize=(0.9 * (width + 1.7), 0.9 * height + 0.7), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(-1.4, width + 0.3)
    ax.set_ylim(-0.3, height)
    ax.set_aspect("equal")
    ax.set_axis_off()
    for r, group in enumerate(layout.groups):
        y = height - 0.3 - (r + 1) * BOX_H - r * GAP_Y
        ax.text(-1.3, y + BOX_H / 2, f"group {r}", va="center", fontsize=9)
        for i, b in enumerate(group):
            x = i * (BOX_W + GAP_X)
            hot = layout.bottleneck == b.key
            ax.add_patch(FancyBboxPatch((x, y), BOX_W, BOX_H, boxstyle="round,pad=0.04",
                                        facecolor="#fff0f0" if hot else "#f0f6ff",
                                        edgecolor="tab:red" if hot else "tab:blue",
                                        linewidth=2.2 if hot else 1.0))
            busy = (f"measured {_seconds(b.measured.total)}" if b.measured is not None
                    else f"predicted {_seconds(b.predicted)}" if b.predicted is not None else "")
            lines = [f"stage {i}: {b.node_name}", layer_range(b.layer_start, b.layer_end),
                     b.device, busy]
            ax.text(x + 0.12, y + BOX_H - 0.15, "\n".join(s for s in lines if s), va="top",
                    fontsize=8, linespacing=1.4)
            if hot:
                ax.text(x + BOX_W, y + BOX_H + 0.08, f"bottleneck ({layout.bottleneck_basis})",
                        ha="right", va="bottom", fontsize=8, color="tab:red", weight="bold")
            if i + 1 < len(group):
                nxt = group[i + 1]
                x0, x1, ym = x + BOX_W + 0.08, x + BOX_W + GAP_X - 0.08, y + BOX_H / 2
                ax.annotate("", (x1, ym + 0.18), (x0, ym + 0.18),
                            arrowprops={"arrowstyle": "->", "color": "0.4"})
                ax.annotate("", (x0, ym - 0.18), (x1, ym - 0.18),
                            arrowprops={"arrowstyle": "->", "color": "0.4"})
                ax.text((x0 + x1) / 2, ym + 0.26, b.activation_codec, ha="center",
                        va="bottom", fontsize=8, color="0.3")
                ax.text((x0 + x1) / 2, ym - 0.26, nxt.gradient_codec, ha="center", va="top",
                        fontsize=8, color="0.3")
    step = f"predicted step {_seconds(layout.predicted_step_seconds)}"
    if layout.measured_step_seconds is not None:
        step += f", measured {_seconds(layout.measured_step_seconds)}"
    head = title or f"plan: {rows} replica group(s)"
    sched = f", {layout.schedule}" if layout.schedule else ""
    ax.set_title(f"{head}{sched}; {step}", fontsize=10)
    return fig


def draw_plan(layout: PlanLayout, path: str | Path, title: str = "") -> Figure:
    """:func:`plan_figure`, saved to ``path`` (``fedpipe plan ... --draw FILE``)."""
    return _save(plan_figure(layout, title), path)


TIMELINE_XLABEL = "seconds since submit"
EVENT_STYLES = {"join": ("tab:green", "-"), "drain": ("tab:orange", "--"),
                "kill -9": ("tab:red", ":")}
"""Colour and line style of each membership event on a throughput timeline; any
other kind (e.g. ``"drain failed"``) is drawn grey, dash-dotted."""


def throughput_timeline_figure(series: Sequence[tuple[float, float]],
                               events: Sequence[tuple[float, str]] = (), *,
                               bin_seconds: float, reference: float | None = None,
                               reference_label: str = "undisturbed run",
                               title: str = "") -> Figure:
    """Throughput over time in bins, membership events as vertical lines (one
    legend entry per kind), and a baseline's throughput as a horizontal line.

    Drawn for ``benchmarks/elastic.py churn --plot FILE``: each bin's useful
    samples/s is held flat across the bin (a step curve), since it is an
    average over the bin, not a sample at its start.

    Args:
        series: ``(bin start, samples/s)``, bin starts in seconds since submit,
            ascending; bins without a measurement may be missing.
        events: ``(seconds since submit, kind)``; kinds in :data:`EVENT_STYLES`
            get their colour, others grey.
        bin_seconds: each bin's width, seconds (> 0).
        reference: the baseline's samples/s, or None for no line.
        reference_label: the baseline's legend text (its value is appended).
        title: the axes' title (default :data:`THROUGHPUT_TITLE`).

    Raises:
        ValueError: no bins, a bin width <= 0, or bin starts out of order.
    """
    if not series:
        raise ValueError("no throughput bins: nothing to plot")
    if bin_seconds <= 0:
        raise ValueError(f"bin_seconds must be > 0, got {bin_seconds}")
    starts = [t for t, _ in series]
    if starts != sorted(starts):
        raise ValueError("throughput bins must be in ascending order of start time")
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    # one extra point closes the last bin, so it is drawn as wide as the others
    xs = starts + [starts[-1] + bin_seconds]
    ys = [v for _, v in series] + [series[-1][1]]
    ax.plot(xs, ys, drawstyle="steps-post", color="tab:blue",
            label=f"useful samples/s ({bin_seconds:g} s bins)")
    if reference is not None:
        ax.axhline(reference, color="0.3", linestyle="-.", linewidth=1,
                   label=f"{reference_label} ({reference:.0f} samples/s)")
    seen: set[str] = set()
    for t, kind in events:
        color, style = EVENT_STYLES.get(kind, ("0.5", "-."))
        ax.axvline(t, color=color, linestyle=style, linewidth=1.5,
                   label=None if kind in seen else kind)
        seen.add(kind)
    ax.set(title=title or THROUGHPUT_TITLE, xlabel=TIMELINE_XLABEL, ylabel="samples/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    # outside the axes: a legend inside would hide some bin or event
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def plot_throughput_timeline(series: Sequence[tuple[float, float]], path: str | Path,
                             events: Sequence[tuple[float, str]] = (), **kw) -> Figure:
    """:func:`throughput_timeline_figure`, saved to ``path``."""
    return _save(throughput_timeline_figure(series, events, **kw), path)
