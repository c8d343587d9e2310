"""Plots: files written and non-empty, with the expected axes and the figures fed in;
plan layouts find the bottleneck the cost model says; the terminal status renders them."""
from __future__ import annotations

import re
import struct
import time

import pytest
from rich.console import Console

from fedpipe import planner
from fedpipe.observe import plots, status
from fedpipe.observe.views import (History, StageTime, StepRecord, job_view, latest_per_step,
                                   measured_step_seconds, plan_from_message, plan_layout,
                                   predicted_stage_seconds, step_records)
from fedpipe.spec import StageKey
from observe_data import fill_store

pytestmark = pytest.mark.timeout(60)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def store(tmp_path):
    s, job, ids = fill_store(str(tmp_path / "tracker.db"),
                             steps=[(k, 3.0 / k, 90.0 + 10 * k) for k in range(1, 9)])
    yield s, job, ids
    s.close()


def test_history_plot_has_loss_and_throughput_axes_with_the_recorded_figures(store, tmp_path):
    s, job, _ = store
    records = step_records(s.events(job, 0))
    assert [r.step for r in records] == list(range(1, 9))
    out = tmp_path / "curves.png"
    fig = plots.plot_history(records, out, title="digits", marks=[(records[4].time, "lost n1")])
    loss_ax, tput_ax = fig.axes
    assert (loss_ax.get_title(), loss_ax.get_xlabel(), loss_ax.get_ylabel()) == \
        ("loss", "step", "loss")
    assert (tput_ax.get_title(), tput_ax.get_xlabel(), tput_ax.get_ylabel()) == \
        ("throughput", "seconds since the first step", "samples/s")
    x, y = loss_ax.lines[0].get_data()
    assert list(x) == list(range(1, 9)) and list(y) == pytest.approx([3.0 / k for k in x])
    x, y = tput_ax.lines[0].get_data()
    assert list(y) == [90.0 + 10 * k for k in range(1, 9)]
    assert x[0] == 0 and list(x) == sorted(x)
    assert any(t.get_text() == "lost n1" for t in tput_ax.texts)
    assert fig._suptitle.get_text() == "digits"
    width, height = png_size(out)
    assert (width, height) == (1100, 440)  # 10 x 4 inches at 110 dpi
    assert out.stat().st_size > 10_000


def test_a_replayed_step_replaces_its_first_run_on_the_loss_curve():
    recs = [StepRecord(1, 10.0, 2.0, 100, 0), StepRecord(2, 11.0, 1.5, 100, 0),
            StepRecord(3, 12.0, 1.2, 100, 0), StepRecord(2, 20.0, 1.4, 90, 1),
            StepRecord(3, 21.0, 1.1, 90, 1)]
    assert [(r.step, r.loss) for r in latest_per_step(recs)] == [(1, 2.0), (2, 1.4), (3, 1.1)]
    fig = plots.history_figure(recs)
    assert list(fig.axes[0].lines[0].get_ydata()) == [2.0, 1.4, 1.1]
    assert len(fig.axes[1].lines[0].get_xdata()) == 5  # throughput keeps every step as run
    # the gap across the recovery (epoch 0 -> 1) is not a step time
    assert measured_step_seconds(recs) == pytest.approx(1.0)


def test_plot_job_reads_a_real_store_and_titles_the_job(store, tmp_path):
    s, job, _ = store
    out = tmp_path / "sub" / "job.png"
    fig = plots.plot_job(s, job, out)
    assert out.stat().st_size > 10_000
    assert fig._suptitle.get_text() == f"job {job} (mlp): RUNNING, step 8/10"
    with pytest.raises(KeyError):
        plots.plot_job(s, "nosuchjob", tmp_path / "x.png")


def test_plotting_nothing_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no step recorded yet"):
        plots.plot_history([], tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def cluster_and_profile():
    cluster = planner.ClusterView(
        [planner.NodeSpec("a", 100e9, 8 << 30, "fast"),
         planner.NodeSpec("b", 10e9, 8 << 30, "slow"),
         planner.NodeSpec("c", 50e9, 8 << 30, "mid")],
        {(x, y): planner.Link(2e6, 0.01) for x in "abc" for y in "abc" if x != y})
    profile = planner.ModelProfile([planner.LayerProfile(f"{i}:Linear", 4e8, 4096, 1 << 20)
                                    for i in range(6)], input_bytes=4096)
    config = planner.TrainConfig(batch_size=32, microbatches=4, schedule="1f1b", stages=3)
    return cluster, profile, config


def test_plan_drawing_marks_the_stage_the_cost_model_finds_busiest(tmp_path):
    cluster, profile, config = cluster_and_profile()
    plan = planner.make_plan(cluster, profile, config)
    layout = plan_layout(plan, cluster=cluster, profile=profile, config=config)
    busy = predicted_stage_seconds(plan, cluster, profile, config)
    want = max(busy, key=lambda k: sum(busy[k]))
    assert layout.bottleneck == want and layout.bottleneck_basis == "predicted"
    assert [b.node_name for b in layout.groups[0]] == \
        [cluster.node(s.node_id).name for s in plan.groups[0].stages]
    out = tmp_path / "plan.png"
    fig = plots.draw_plan(layout, out)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert "bottleneck (predicted)" in texts
    assert sum(t.startswith("stage ") for t in texts) == len(layout.stages) == 3
    for a, b in zip(plan.groups[0].stages, plan.groups[0].stages[1:]):
        assert a.activation_codec in texts and b.gradient_codec in texts
    assert f"predicted step {plan.predicted_step_seconds * 1e3:.1f} ms" in ax.get_title() \
        or f"predicted step {plan.predicted_step_seconds:.2f} s" in ax.get_title()
    assert len(ax.patches) == 3
    hot = [p for p in ax.patches if p.get_linewidth() > 2]
    assert len(hot) == 1
    assert png_size(out)[0] > 400 and out.stat().st_size > 5_000


def test_measured_stage_times_decide_the_bottleneck_once_every_stage_reported():
    cluster, profile, config = cluster_and_profile()
    plan = planner.make_plan(cluster, profile, config)
    times = [StageTime(0, 0, 0.01, 0.2, 0.001), StageTime(0, 1, 0.05, 0.01, 0.02),
             StageTime(0, 2, 0.03, 0.1, 0.001)]
    layout = plan_layout(plan, cluster=cluster, profile=profile, config=config,
                         stage_times=times)
    assert (layout.bottleneck, layout.bottleneck_basis) == (StageKey(0, 1), "measured")
    partial = plan_layout(plan, cluster=cluster, profile=profile, config=config,
                          stage_times=times[:2])
    assert partial.bottleneck_basis == "predicted"
    bare = plan_layout(plan)
    assert (bare.bottleneck, bare.bottleneck_basis) == (None, "")
    with pytest.raises(ValueError, match="no stages"):
        plots.plan_figure(plan_layout(planner.Plan([], 0.0)))


def test_a_job_plan_message_round_trips_to_the_planners_plan(store):
    s, job, ids = store
    msg = s.job(job).plan
    plan = plan_from_message(msg)
    assert [(st.node_id, st.layer_start, st.layer_end, st.activation_codec, st.gradient_codec)
            for st in plan.groups[0].stages] == \
        [(a.node_id, a.layer_start, a.layer_end, a.activation_codec, a.gradient_codec)
         for a in msg.stages]
    assert plan.groups[0].microbatches == 2 and plan.groups[0].samples == 32
    assert plan.predicted_step_seconds == msg.predicted_step_seconds


def test_status_renders_the_swarm_and_a_job_with_its_figures(store):
    s, job, _ = store
    console = Console(width=160, record=True, color_system=None)
    status.run_status(s, console=console)
    text = console.export_text()
    for name in ("fast", "mid", "slow"):
        assert name in text
    assert "3 node(s) alive, 0 lost; 195 GFLOP/s" in text
    console = Console(width=160, record=True, color_system=None)
    status.run_status(s, job, console=console)
    text = console.export_text()
    info = s.job(job)
    assert "RUNNING" in text and f"step {info.step}/{info.steps}" in text
    assert f"loss {info.loss:.4f}" in text and "int8+zstd / fp16" in text
    assert "step predicted 40.0 ms" in text
    with pytest.raises(KeyError):
        status.run_status(s, "nosuchjob", console=console)


def test_history_memory_is_bounded_and_keeps_the_latest_steps_exactly(store):
    s, job, _ = store
    h = History(max_records=6)
    h.extend(s.events(job, 0))
    assert len(h.records) <= 6 and h.records[-1].step == 8
    assert [r.step for r in h.records][-4:] == [5, 6, 7, 8]
    seq = h.last_seq
    h.extend(s.events(job, 0))  # old events again: ignored
    assert h.last_seq == seq and h.records[-1].step == 8
    view = job_view(s.job(job), h, None)
    assert view["history"][-1]["loss"] == pytest.approx(3.0 / 8)


def test_a_lost_node_shows_why_in_the_swarm_view_and_status(store):
    from fedpipe.observe.views import swarm_view

    s, _, ids = store
    s.mark_lost(ids[1])
    view = swarm_view(s.nodes(include_lost=True), s.links(), now=time.time() + 30)
    lost = [n for n in view["nodes"] if not n["alive"]]
    assert [n["name"] for n in lost] == ["mid"]
    assert re.fullmatch(r"lost: no heartbeat for 3\d s \(last \d\d:\d\d:\d\d\)", lost[0]["why"])
    assert view["totals"] == {"alive": 2, "left": 0, "lost": 1, "flops": 135e9,
                              "memory_bytes": (8 << 30) + (2 << 30)}
    console = Console(width=160, record=True, color_system=None)
    status.run_status(s, console=console)
    assert "lost: no heartbeat for" in console.export_text()


def test_nodes_that_left_on_purpose_are_counted_apart_from_lost_ones():
    # was, after `fedpipe drain n1`: "2 node(s) alive, 1 lost", n1 saying it left
    from fedpipe.observe.views import swarm_view
    from fedpipe.proto import node_pb2, tracker_pb2
    from fedpipe.spec import NODE_DRAINED, NODE_LEFT

    def node(name, alive=True, lost_reason=""):
        return tracker_pb2.NodeInfo(node_id=name, name=name, alive=alive,
                                    lost_reason=lost_reason, last_heartbeat=time.time(),
                                    resources=node_pb2.Resources(flops=1e9))

    nodes = [node("n0"), node("n1", False, NODE_DRAINED), node("n2"),
             node("n3", False, NODE_LEFT), node("n4", False, "missed its lease")]
    view = swarm_view(nodes, [])
    assert {k: view["totals"][k] for k in ("alive", "left", "lost")} == \
        {"alive": 2, "left": 2, "lost": 1}
    assert [n["state"] for n in view["nodes"]] == ["alive", "left", "alive", "left", "lost"]
    console = Console(width=160, record=True, color_system=None)
    console.print(status.swarm_renderable(view))
    text = console.export_text()
    assert "2 node(s) alive, 2 left, 1 lost;" in text
    assert "left the swarm after its drain" in text and "lost: missed its lease" in text


def test_throughput_timeline_draws_the_bins_events_and_baseline_with_a_legend(tmp_path):
    series = [(0.0, 100.0), (10.0, 120.0), (20.0, 40.0), (40.0, 110.0)]  # 30 s: no bin
    events = [(12.5, "join"), (21.0, "kill -9"), (33.0, "drain"), (45.0, "join"),
              (47.0, "drain failed")]
    out = tmp_path / "churn.png"
    fig = plots.plot_throughput_timeline(series, out, events, bin_seconds=10.0,
                                         reference=115.0, reference_label="undisturbed")
    (ax,) = fig.axes
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == \
        ("throughput", "seconds since submit", "samples/s")
    curve, ref, *marks = ax.lines
    x, y = curve.get_data()
    assert list(x) == [0.0, 10.0, 20.0, 40.0, 50.0]  # the last bin closed at its end
    assert list(y) == [100.0, 120.0, 40.0, 110.0, 110.0]
    assert curve.get_drawstyle() == "steps-post"
    assert list(ref.get_ydata()) == [115.0, 115.0]
    assert [m.get_xdata()[0] for m in marks] == [t for t, _ in events]
    colors = {kind: m.get_color() for m, (_, kind) in zip(marks, events)}
    assert len(set(colors.values())) == 4  # each kind its own colour
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["useful samples/s (10 s bins)", "undisturbed (115 samples/s)",
                      "join", "kill -9", "drain", "drain failed"]  # one entry per kind
    assert ax.get_ylim()[0] == 0
    assert png_size(out) == (1100, 440) and out.stat().st_size > 10_000


def test_a_throughput_timeline_without_bins_or_out_of_order_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no throughput bins"):
        plots.plot_throughput_timeline([], tmp_path / "empty.png", bin_seconds=10.0)
    with pytest.raises(ValueError, match="ascending"):
        plots.throughput_timeline_figure([(10.0, 1.0), (0.0, 2.0)], bin_seconds=10.0)
    with pytest.raises(ValueError, match="bin_seconds"):
        plots.throughput_timeline_figure([(0.0, 1.0)], bin_seconds=0)
    assert not (tmp_path / "empty.png").exists()
