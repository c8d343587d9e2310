"""Prometheus metrics: a scrape parses and its figures are the ones fed in (in-process).

The tracker's metrics are read from a real tracker Store (SQLite) filled here;
the node's from the calls a node makes per step and per sent tensor.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedpipe.observe import metrics
from fedpipe.observe.metrics import METRICS, NodeMetrics, start_metrics, tracker_registry
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import Kind
from observe_data import NODES, fill_store

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of a /metrics page, parsed by prometheus_client."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, metric_name, /, **labels):
    return samples[(metric_name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def names_of(samples) -> set[str]:
    return {name for name, _ in samples}


@pytest.fixture
def store(tmp_path):
    s, job, ids = fill_store(str(tmp_path / "tracker.db"))
    yield s, job, ids
    s.close()


def test_tracker_scrape_parses_and_agrees_with_the_store(store):
    s, job, ids = store
    with start_metrics(tracker_registry(s), 0) as served:
        samples = scrape(served.url)
    info = s.job(job)
    for (name, flops, mem), nid in zip(NODES, ids):
        assert value(samples, "fedpipe_node_alive", node=nid, name=name) == 1.0
        assert value(samples, "fedpipe_node_flops", node=nid, name=name, device="cpu") == flops
        assert value(samples, "fedpipe_node_memory_bytes", node=nid, name=name) == mem
    names = {nid: n[0] for nid, n in zip(ids, NODES)}
    links = s.links()
    assert len(links) == 6
    for m in links:
        pair = {"src": names[m.src_id], "dst": names[m.dst_id]}
        assert value(samples, "fedpipe_link_bandwidth_bytes_per_second", **pair) == m.bandwidth
        assert value(samples, "fedpipe_link_latency_seconds", **pair) == m.latency
    assert value(samples, "fedpipe_job_step", job=job) == info.step == 3
    assert value(samples, "fedpipe_job_steps", job=job) == 10
    assert value(samples, "fedpipe_job_loss", job=job) == info.loss == 0.75
    assert value(samples, "fedpipe_job_samples_per_second", job=job) == 180.0
    assert value(samples, "fedpipe_job_recoveries_total", job=job) == 0
    assert value(samples, "fedpipe_job_state", job=job, name="mlp", state="RUNNING") == 1
    assert value(samples, "fedpipe_jobs", state="RUNNING") == 1
    assert value(samples, "fedpipe_jobs", state="FAILED") == 0
    assert value(samples, "fedpipe_job_step_seconds", job=job, kind="predicted") == 0.04
    times = [e.time for e in s.events(job, 0) if e.step]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert value(samples, "fedpipe_job_step_seconds", job=job, kind="measured") == \
        pytest.approx((gaps[0] + gaps[1]) / 2)
    assert value(samples, "fedpipe_link_codec_info", job=job, src="fast", dst="mid",
                 tensor="activation", codec="int8+zstd") == 1
    assert value(samples, "fedpipe_link_codec_info", job=job, src="mid", dst="fast",
                 tensor="gradient", codec="fp16") == 1
    assert "process_cpu_seconds_total" in names_of(samples)


def test_tracker_scrape_follows_a_lost_node_and_a_finished_job(store):
    s, job, ids = store
    registry = tracker_registry(s)
    with start_metrics(registry, 0) as served:
        before = scrape(served.url)
        s.record_step(job, 4, 0.5, 200.0, time.time())
        s.mark_lost(ids[2])
        mid = scrape(served.url)
        s.set_state(job, tracker_pb2.JOB_STATE_SUCCEEDED, "all 10 steps done", time.time())
        after = scrape(served.url)
    assert value(before, "fedpipe_job_step", job=job) == 3
    assert value(mid, "fedpipe_job_step", job=job) == 4
    assert value(mid, "fedpipe_job_samples_per_second", job=job) == 200.0
    assert value(mid, "fedpipe_node_alive", node=ids[2], name="slow") == 0.0
    # a finished job's series end; the count by state says where it went
    assert not any(name.startswith("fedpipe_job_") and dict(labels).get("job") == job
                   for name, labels in after)
    assert value(after, "fedpipe_jobs", state="SUCCEEDED") == 1
    assert value(after, "fedpipe_jobs", state="RUNNING") == 0


def test_node_scrape_parses_and_agrees_with_what_the_node_reported():
    m = NodeMetrics("node0")
    steps = [(0.030, 0.010, 0.002), (0.028, 0.012, 0.001), (0.031, 0.009, 0.003)]
    for compute, wait, send in steps:
        m.stage_step("j1", 0, 1, compute=compute, wait=wait, send=send)
    m.stage_step("j2", 1, 0, compute=1.5, wait=0.0, send=0.25)
    m.in_flight("j1", 0, 1, 3)
    m.staleness("j1", 0, 1, 1)
    m.sent("node1", Kind.ACTIVATION, 4096, 1100)
    m.sent("node1", Kind.ACTIVATION, 4096, 1200)
    m.sent("node2", node_pb2.KIND_GRADIENT, 8192, 8192)
    with start_metrics(m.registry, 0) as served:
        samples = scrape(served.url)
        stage = {"job": "j1", "replica": 0, "stage": 1}
        for i, part in enumerate(metrics.PARTS):
            assert value(samples, "fedpipe_stage_step_seconds_count", **stage, part=part) == 3
            assert value(samples, "fedpipe_stage_step_seconds_sum", **stage, part=part) == \
                pytest.approx(sum(s[i] for s in steps))
        # 0.030 and 0.031 fall in the (0.025, 0.05] bucket, 0.028 too
        assert value(samples, "fedpipe_stage_step_seconds_bucket", **stage, part="compute",
                     le="0.025") == 0
        assert value(samples, "fedpipe_stage_step_seconds_bucket", **stage, part="compute",
                     le="0.05") == 3
        assert value(samples, "fedpipe_stage_step_seconds_sum", job="j2", replica=1, stage=0,
                     part="send") == 0.25
        assert value(samples, "fedpipe_stage_microbatches_in_flight", **stage) == 3
        assert value(samples, "fedpipe_stage_staleness_steps", **stage) == 1
        assert value(samples, "fedpipe_link_sent_bytes_total", src="node0", dst="node1",
                     encoding="raw") == 8192
        assert value(samples, "fedpipe_link_sent_bytes_total", src="node0", dst="node1",
                     encoding="encoded") == 2300
        assert value(samples, "fedpipe_link_sent_bytes_total", src="node0", dst="node2",
                     encoding="encoded") == 8192
        assert value(samples, "fedpipe_link_sent_tensors_total", src="node0", dst="node1",
                     kind="activation") == 2
        assert value(samples, "fedpipe_link_sent_tensors_total", src="node0", dst="node2",
                     kind="gradient") == 1
        m.forget_job("j1")
        after = scrape(served.url)
    assert not any(dict(labels).get("job") == "j1" for _, labels in after)
    assert value(after, "fedpipe_stage_step_seconds_count", job="j2", replica=1, stage=0,
                 part="compute") == 1
    # link counters are the node's, not the job's: they stay
    assert value(after, "fedpipe_link_sent_bytes_total", src="node0", dst="node1",
                 encoding="raw") == 8192


def test_node_metrics_refuse_bad_figures_with_the_figure():
    m = NodeMetrics("n")
    with pytest.raises(ValueError, match=r"compute time .* got -0.5"):
        m.stage_step("j", 0, 0, compute=-0.5, wait=0, send=0)
    with pytest.raises(ValueError, match=r"wait time .* got nan"):
        m.stage_step("j", 0, 0, compute=0.1, wait=math.nan, send=0)
    with pytest.raises(ValueError, match="raw -1"):
        m.sent("peer", Kind.ACTIVATION, -1, 0)
    with pytest.raises(ValueError):
        m.sent("peer", 999, 1, 1)


def test_two_node_metrics_in_one_process_do_not_collide():
    a, b = NodeMetrics("a"), NodeMetrics("b")
    a.sent("b", Kind.ACTIVATION, 10, 10)
    assert b.registry.get_sample_value("fedpipe_link_sent_bytes_total",
                                       {"src": "a", "dst": "b", "encoding": "raw"}) is None
    assert a.registry.get_sample_value("fedpipe_link_sent_bytes_total",
                                       {"src": "a", "dst": "b", "encoding": "raw"}) == 10


def test_every_metric_is_documented_and_every_documented_metric_exists():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(fedpipe_[a-z_]+)", doc))
    defined = {m.name for m in METRICS}
    assert defined - documented == set(), "defined but not in docs/metrics.md"
    assert documented - defined == set(), "in docs/metrics.md but not defined"
    for m in METRICS:
        assert m.name.startswith("fedpipe_") and (m.kind != "counter") != m.name.endswith("_total")
        assert m.exporter in ("node", "tracker")


def test_a_metrics_port_in_use_is_an_os_error_naming_it():
    with start_metrics(NodeMetrics("x").registry, 0) as served:
        with pytest.raises(OSError):
            start_metrics(NodeMetrics("y").registry, served.port)


@pytest.mark.processes
def test_the_tracker_side_of_observe_does_not_import_torch():
    code = ("import sys; import fedpipe.tracker.http, fedpipe.observe.metrics, "
            "fedpipe.observe.views, fedpipe.observe.source; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_tracker_keeps_every_stages_median_split_of_the_current_epoch():
    from fedpipe.spec import PlanView, StageKey
    from tracker_fakes import join, make_tracker, submission

    R = tracker_pb2.StageReport
    tracker, _, clock = make_tracker(lease=10.0)
    join(tracker, 3)
    job = tracker.jobs.submit(submission(steps=20, stages=2))
    tracker.tick()
    view = PlanView(tracker.jobs.get(job).plan)

    def report(stage, step, compute, wait, send, epoch=0):
        tracker.progress.report(R(job_id=job, replica=0, stage=stage, status=R.STATUS_STEP,
                              node_id=view[StageKey(0, stage)].node_id, step=step, loss=1.0,
                              samples=8, seconds=compute + wait + send, compute_seconds=compute,
                              wait_seconds=wait, send_seconds=send, epoch=epoch))

    assert tracker.stage_times.of(job) == []
    computes = [0.5, 0.1, 0.3, 0.2, 0.4, 0.9, 0.6]  # the last 5: median 0.4
    for step, c in enumerate(computes, 1):
        report(0, step, c, 0.01 * step, 0.002)
        report(1, step, 2 * c, 0.0, 0.001)
    report(1, 8, float("nan"), 0.0, 0.0)  # a broken clock is not kept
    times = tracker.stage_times.of(job)
    assert [(t.replica, t.stage) for t in times] == [(0, 0), (0, 1)]
    assert (times[0].compute, times[0].wait, times[0].send) == \
        pytest.approx((0.4, 0.05, 0.002))
    assert (times[1].compute, times[1].wait, times[1].send) == pytest.approx((0.8, 0.0, 0.001))
    assert tracker.jobs.get(job).step == 8  # the last stage's reports make the steps
    # a recovery starts a new epoch: the old stages' times are not shown for it
    lost = view[StageKey(0, 1)].node_id
    tracker.registry.declare_lost(lost, "was killed")
    assert tracker.jobs.get(job).epoch == 1 and tracker.stage_times.of(job) == []
    assert tracker.stage_times.of("nosuchjob") == []
