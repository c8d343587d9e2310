"""A stage's in-flight and staleness figures: the runners count them, the node sets its
gauges from each step's result, and a scrape of the node's metrics parses to them."""
from __future__ import annotations

import types
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from fedpipe.node.lifecycle import StageSlot
from fedpipe.node.reports import StageReporter
from fedpipe.observe.metrics import NodeMetrics, start_metrics
from fedpipe.runtime.async_stage import AsyncStageRunner
from fedpipe.runtime.stage import SyncStageRunner
from fedpipe.spec import Kind, StageKey

pytestmark = pytest.mark.timeout(60)


class Neighbours:
    """A first stage's peers, answered at once: gradients of ones for every activation."""

    def recv(self, kind, step, tag, timeout=None):
        return (torch.randn(2, 3) if kind == Kind.INPUT else torch.ones(2, 3)), 8

    def send(self, kind, step, microbatch, tensor, batch_size):
        pass

    def send_to(self, peer, kind, step, tag, tensor, batch_size=1, codec="raw"):
        raise AssertionError("no replica groups here")


def first_stage(runner_cls, n_stages, microbatches, **kw):
    module = nn.Sequential(nn.Linear(3, 3))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    args = (module, opt, None) + (kw.pop("schedule"),) if runner_cls is SyncStageRunner \
        else (module, opt, None)
    return runner_cls(*args, 0, n_stages, microbatches, Neighbours(), **kw)


@pytest.mark.parametrize("schedule,want", [("gpipe", 4), ("1f1b", 3)])
def test_the_most_microbatches_in_flight_follow_the_schedule(schedule, want):
    """GPipe stashes every microbatch; 1F1B's first stage of 3 at most 3 (its warm-up + 1)."""
    results = list(first_stage(SyncStageRunner, 3, 4, schedule=schedule).run(2))
    assert [r.in_flight for r in results] == [want, want]
    assert [r.staleness for r in results] == [0, 0]


def test_async_steps_report_how_many_versions_their_gradients_lagged():
    results = list(first_stage(AsyncStageRunner, 3, 2, max_staleness=1).run(4))
    assert results[0].staleness == 0  # nothing was applied before the first update
    assert max(r.staleness for r in results) == 1  # bounded by max_staleness
    assert all(r.in_flight >= 1 for r in results)
    exact = list(first_stage(AsyncStageRunner, 3, 2, max_staleness=0).run(4))
    assert [r.staleness for r in exact] == [0, 0, 0, 0]


def test_a_node_sets_its_gauges_from_each_step_and_a_scrape_parses_to_them():
    metrics = NodeMetrics("node0")
    reports = []
    reporter = StageReporter(lambda: "n0", reports.append, metrics)
    stage = types.SimpleNamespace(job_id="j1", slot=StageSlot("j1", 0, 1), key=StageKey(0, 1),
                                  epoch=0)
    for result in first_stage(SyncStageRunner, 3, 4, schedule="gpipe").run(2):
        reporter.step(stage, result)
    assert len(reports) == 2
    with start_metrics(metrics.registry, 0) as served:
        text = urllib.request.urlopen(served.url + "/metrics", timeout=10).read().decode()
    got = {(s.name, s.labels.get("job"), s.labels.get("stage")): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got[("fedpipe_stage_microbatches_in_flight", "j1", "1")] == 4
    assert got[("fedpipe_stage_staleness_steps", "j1", "1")] == 0
    assert got[("fedpipe_stage_step_seconds_count", "j1", "1")] == 2
