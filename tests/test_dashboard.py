"""The dashboard against a real tracker: a LocalSwarm tracker started with
``--http-port`` and ``--metrics-port`` trains the digits MLP over gRPC on two nodes
started with ``--metrics-port``; the tracker serves the API and the page, headless
chromium renders it, and the tracker's and the nodes' scrapes are read. The job is
held at a known step (its data stops coming), so the API, GetJob, the page, the
metrics and ``fedpipe status``/``plot`` all describe the same moment.

A missing chromium fails the browser test: tools/setup-test-deps.sh installs it.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.observe import browser
from fedpipe.observe import status
from fedpipe.proto import tracker_pb2
from fedpipe.testing import LocalSwarm, child_env, free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
HELD_AT = 4
STATIC = Path(fedpipe.__file__).parent / "tracker" / "static"


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class Ports(NamedTuple):
    """Where the swarm's HTTP endpoints answer."""

    url: str                   # the tracker's dashboard (and its /metrics)
    metrics: str               # the tracker's --metrics-port
    nodes: dict[str, str]      # node name -> its --metrics-port


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of ``url``/metrics, parsed."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpipe", *args], capture_output=True,
                          text=True, timeout=120, env={**child_env(), "COLUMNS": "160"})


@pytest.fixture(scope="module")
def running():
    """(swarm, job, ports): a 2-stage job RUNNING, held after step HELD_AT."""
    hold = threading.Event()
    x, y, _, _ = digits.load()

    def data():
        for i, batch in enumerate(digits.batches(x, y, 32)):  # endless
            if i == HELD_AT:
                hold.wait()
            yield batch

    http, metrics = free_port(), free_port()
    with LocalSwarm(n_nodes=0, tracker_args=["--http-port", str(http),
                                             "--metrics-port", str(metrics)]) as swarm:
        nodes = {}
        for i in range(2):  # one at a time, as LocalSwarm does, each with a metrics port
            nodes[f"node{i}"] = port = free_port()
            swarm.add_node("--metrics-port", str(port))
            swarm.wait_for_nodes(i + 1)
        swarm.wait_for_links()
        client = swarm.client()
        job = client.submit(digits.make_model(hidden=32), nn.functional.cross_entropy,
                            fedpipe.optimizer(torch.optim.AdamW, lr=3e-3), data(), steps=50,
                            microbatches=2, stages=2)
        deadline = time.monotonic() + 120
        while job.status().step < HELD_AT:
            assert job.status().state in ("PENDING", "PLANNING", "DEPLOYING", "RUNNING"), \
                job.status()
            assert time.monotonic() < deadline, f"job did not reach step {HELD_AT}"
            time.sleep(0.2)
        time.sleep(1.0)  # nothing more can come: the feeder waits on `hold`
        try:
            yield swarm, job, Ports(f"http://127.0.0.1:{http}", f"http://127.0.0.1:{metrics}",
                                    {name: f"http://127.0.0.1:{p}" for name, p in nodes.items()})
        finally:
            job.cancel("test over")
            hold.set()


def test_the_held_job_is_running_at_its_step(running):
    _, job, _ = running
    st = job.status()
    assert (st.state, st.step) == ("RUNNING", HELD_AT)


def test_api_nodes_match_the_trackers_list_nodes(running):
    swarm, _, ports = running
    reply = swarm.client().stub.ListNodes(tracker_pb2.ListNodesRequest(include_lost=True),
                                          timeout=10)
    api = get(ports.url + "/api/nodes")
    assert [(n["id"], n["name"], n["address"], n["alive"], n["flops"], n["memory_bytes"],
             n["device"]) for n in api["nodes"]] == \
        [(n.node_id, n.name, n.address, n.alive, n.resources.flops, n.resources.memory_bytes,
          n.resources.device) for n in reply.nodes]
    assert len(api["nodes"]) == 2 and api["totals"]["alive"] == 2
    assert api["totals"]["flops"] == pytest.approx(sum(n.resources.flops for n in reply.nodes))
    pairs = {(m.src_id, m.dst_id): m.bandwidth for m in reply.links}
    ids = api["matrix"]["ids"]
    for i, a in enumerate(ids):
        for j, b in enumerate(ids):
            assert api["matrix"]["bandwidth"][i][j] == pairs.get((a, b))
    assert len(pairs) == 2  # both directions measured


def test_api_job_matches_get_job_and_its_events(running):
    swarm, job, ports = running
    info = swarm.client().stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
    api = get(f"{ports.url}/api/jobs/{job.id}")
    assert (api["id"], api["state"], api["reason"], api["step"], api["steps"]) == \
        (info.job_id, "RUNNING", info.reason, info.step, info.steps)
    assert api["loss"] == info.loss
    assert api["step_seconds"]["predicted"] == info.plan.predicted_step_seconds
    assert api["step_seconds"]["measured"] > 0
    stages = [s for g in api["plan"]["groups"] for s in g]
    assert [(s["replica"], s["stage"], s["node_id"], s["node_name"], s["layer_start"],
             s["layer_end"], s["activation_codec"], s["gradient_codec"]) for s in stages] == \
        [(a.replica, a.stage, a.node_id, a.node_name, a.layer_start, a.layer_end,
          a.activation_codec, a.gradient_codec)
         for a in sorted(info.plan.stages, key=lambda a: (a.replica, a.stage))]
    # each stage's predicted split is the one its plan carries (as fedpipe status shows it)
    assert [(s["predicted_compute"], s["predicted_send"]) for s in stages] == \
        [(a.predicted_compute_seconds, a.predicted_send_seconds)
         for a in sorted(info.plan.stages, key=lambda a: (a.replica, a.stage))]
    assert len(stages) == 2 and all(s["predicted_compute"] > 0 for s in stages)
    assert sum(s["bottleneck"] for s in stages) == 1
    assert api["config"]["batch_size"] == 32 and api["config"]["microbatches"] == 2
    assert (api["config"]["precision"], api["config"]["recompute"]) == ("fp32", "off")
    # the history is the tracker's step events, one per step so far
    steps = [(h["step"], h["loss"], h["samples_per_second"]) for h in api["history"]]
    assert [s for s, _, _ in steps] == list(range(1, HELD_AT + 1))
    assert steps[-1][1] == info.loss and all(sps > 0 for _, _, sps in steps)
    assert [e["state"] for e in api["events"]] == ["PENDING", "PLANNING", "DEPLOYING", "RUNNING"]
    assert api["samples_per_second"] == steps[-1][2]
    listed = get(ports.url + "/api/jobs")["jobs"]
    assert [(j["id"], j["state"], j["step"], j["loss"]) for j in listed] == \
        [(job.id, "RUNNING", info.step, info.loss)]
    newer = get(f"{ports.url}/api/jobs/{job.id}?after_seq={api['history'][1]['seq']}")
    assert [h["step"] for h in newer["history"]] == list(range(3, HELD_AT + 1))


class _Ids(HTMLParser):
    """Text and attributes of the elements with an id, and counts of some tags."""

    def __init__(self):
        super().__init__()
        self.attrs: dict[str, dict] = {}
        self.text: dict[str, str] = {}
        self.stack: list[str | None] = []
        self.body: dict = {}
        self.tags: dict[str, int] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag == "body":
            self.body = a
        if "id" in a:
            self.attrs[a["id"]] = a
            self.text.setdefault(a["id"], "")
        if tag not in ("meta", "link", "br", "img", "input"):
            self.stack.append(a.get("id"))

    def handle_endtag(self, tag):
        if self.stack and tag not in ("meta", "link", "br", "img", "input"):
            self.stack.pop()

    def handle_data(self, data):
        for i in self.stack:
            if i:
                self.text[i] += data


def test_chromium_renders_the_running_job_with_the_apis_figures(running):
    _, job, ports = running
    api = get(f"{ports.url}/api/jobs/{job.id}")
    nodes = get(ports.url + "/api/nodes")
    dom = browser.dump_dom(f"{ports.url}/#job={job.id}", budget_ms=8000)
    page = _Ids()
    page.feed(dom)
    assert page.body.get("data-ready") == "1", (page.body, dom[-2000:])
    assert "data-error" not in page.body
    assert page.text["job-id"] == job.id
    assert page.attrs["job-state"]["data-value"] == api["state"] == "RUNNING"
    assert page.text["job-state"] == "RUNNING"
    assert page.attrs["job-step"]["data-value"] == str(api["step"]) == str(HELD_AT)
    assert page.text["job-step"] == f"{api['step']} / {api['steps']}"
    assert float(page.attrs["job-loss"]["data-value"]) == api["loss"]
    assert page.text["job-loss"] == f"{api['loss']:.4f}"
    assert float(page.attrs["job-sps"]["data-value"]) == api["samples_per_second"]
    assert page.text["job-reason"] == api["reason"]
    # the swarm table has a row per node, and the plan one box per stage
    assert len(re.findall(r'<tr data-node="', dom)) == len(nodes["nodes"]) == 2
    assert len(re.findall(r'data-stage="\d+-\d+"', dom)) == 2
    assert dom.count('class="box bottleneck"') == 1
    assert len(re.findall(r'<rect [^>]*fill="hsl', dom)) == 2  # two measured links
    assert re.search(r'<polyline class="curve" points="[^"]+"', dom)
    # each stage's predicted and measured peak memory, in the stage table
    for s in (s for g in api["plan"]["groups"] for s in g):
        for kind in ("predicted", "peak"):
            cell = re.search(rf'data-memory="{s["replica"]}-{s["stage"]}-{kind}">([^<]+)<', dom)
            assert cell and re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", cell.group(1)), (kind, cell)
        # and whether it recomputes, as the API says (StageAssignment.recompute)
        cell = re.search(rf'data-recompute="{s["replica"]}-{s["stage"]}">([^<]+)<', dom)
        assert cell and cell.group(1) == ("yes" if s["recompute"] else "no"), cell


def test_the_page_fetches_nothing_from_the_internet():
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC / name).read_text()
        urls = set(re.findall(r"https?://[^\s\"')]+", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)
        assert "@import" not in text and "cdn" not in text.lower()


def test_the_metrics_on_the_dashboard_port_agree_with_the_job(running):
    swarm, job, ports = running
    info = swarm.client().stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
    text = urllib.request.urlopen(ports.url + "/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("fedpipe_job_step", (("job", job.id),))] == info.step == HELD_AT
    assert samples[("fedpipe_job_loss", (("job", job.id),))] == info.loss
    assert samples[("fedpipe_job_step_seconds", (("job", job.id), ("kind", "predicted")))] == \
        info.plan.predicted_step_seconds
    alive = [v for (name, _), v in samples.items() if name == "fedpipe_node_alive"]
    assert alive == [1.0, 1.0]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(running):
    _, job, ports = running
    for path, code, pattern in (("/api/jobs/nosuchjob", 404, "no job 'nosuchjob'"),
                                ("/api/jobs/bad%20id!", 400, "a job id is"),
                                ("/api/jobs?limit=0", 400, "limit must be 1..1000"),
                                (f"/api/jobs/{job.id}?after_seq=x", 400, "after_seq must be"),
                                ("/static/../../etc/passwd", 404, "no such"),
                                ("/nowhere", 404, "no such path")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(ports.url + path, timeout=10)
        assert err.value.code == code, path
        assert pattern in json.loads(err.value.read())["error"], path
    assert get(f"{ports.url}/api/jobs/{job.id}")["step"] == HELD_AT


def test_every_stage_reports_its_step_split_and_the_api_shows_it(running):
    _, job, ports = running
    api = get(f"{ports.url}/api/jobs/{job.id}")
    stages = [s for g in api["plan"]["groups"] for s in g]
    for s in stages:  # the tracker keeps every stage's split, not only the last stage's
        m = s["measured"]
        assert m is not None, s
        assert m["compute"] > 0 and m["wait"] >= 0 and m["send"] >= 0, s
    assert api["plan"]["bottleneck_basis"] == "measured"
    busiest = max(stages, key=lambda s: s["measured"]["compute"] + s["measured"]["send"])
    assert busiest["bottleneck"]


def test_the_trackers_metrics_port_agrees_with_get_job_and_the_api(running):
    swarm, job, ports = running
    info = swarm.client().stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
    api = get(f"{ports.url}/api/jobs/{job.id}")
    samples = scrape(ports.metrics)
    assert sample(samples, "fedpipe_job_step", job=job.id) == info.step == HELD_AT
    assert sample(samples, "fedpipe_job_loss", job=job.id) == info.loss
    assert sample(samples, "fedpipe_job_step_seconds", job=job.id, kind="predicted") == \
        info.plan.predicted_step_seconds
    assert sample(samples, "fedpipe_job_step_seconds", job=job.id, kind="measured") == \
        api["step_seconds"]["measured"]
    for s in (s for g in api["plan"]["groups"] for s in g):
        for part in ("compute", "wait", "send"):
            assert sample(samples, "fedpipe_job_stage_step_seconds", job=job.id,
                          replica=s["replica"], stage=s["stage"], part=part) == \
                s["measured"][part]
    assert sorted(v for (name, _), v in samples.items() if name == "fedpipe_node_alive") == \
        [1.0, 1.0]


def test_each_stage_shows_its_measured_peak_memory_beside_the_prediction(running):
    """The planner's prediction reaches the node with its LoadStage, and each step's
    report carries it back with the node's measured peak: the API, the tracker's
    metrics and ``fedpipe status`` show both, the same figures."""
    swarm, job, ports = running
    api = get(f"{ports.url}/api/jobs/{job.id}")
    samples = scrape(ports.metrics)
    out = cli("status", "--tracker", swarm.tracker, job.id)
    assert out.returncode == 0, out.stderr
    assert "memory predicted / peak" in out.stdout
    for s in (s for g in api["plan"]["groups"] for s in g):
        mem = s["memory"]
        assert mem["predicted"] > 0 and mem["peak"] > 0, s
        for kind in ("predicted", "peak"):
            assert sample(samples, "fedpipe_job_stage_memory_bytes", job=job.id,
                          replica=s["replica"], stage=s["stage"], kind=kind) == mem[kind]
        row = next(line for line in out.stdout.splitlines()
                   if f" {s['node_name']} " in line and f"{s['layer_start']}-" in line)
        assert status._memory(mem) in row, row


def test_each_node_exports_its_stages_step_seconds_and_the_bytes_it_sent(running):
    _, job, ports = running
    plan = job.status().plan
    stages = sorted(plan.stages, key=lambda a: a.stage)
    assert len(stages) == 2
    for a in stages:
        samples = scrape(ports.nodes[a.node_name])
        for part in ("compute", "wait", "send"):
            labels = dict(job=job.id, replica=a.replica, stage=a.stage, part=part)
            assert sample(samples, "fedpipe_stage_step_seconds_count", **labels) == HELD_AT
            assert sample(samples, "fedpipe_stage_step_seconds_sum", **labels) >= 0
        assert sample(samples, "fedpipe_stage_step_seconds_sum", job=job.id, replica=a.replica,
                      stage=a.stage, part="compute") > 0
        # stage 0 sends one activation per microbatch forward, stage 1 one gradient back
        peer = stages[1 - a.stage]
        kind, codec = ("activation", a.activation_codec) if a.stage == 0 \
            else ("gradient", a.gradient_codec)
        link = dict(src=a.node_name, dst=peer.node_name)
        assert sample(samples, "fedpipe_link_sent_tensors_total", kind=kind, **link) == \
            HELD_AT * 2
        raw = sample(samples, "fedpipe_link_sent_bytes_total", encoding="raw", **link)
        encoded = sample(samples, "fedpipe_link_sent_bytes_total", encoding="encoded", **link)
        assert raw > 0 and encoded > 0
        if codec in ("", "raw"):
            assert encoded == raw
        assert "process_cpu_seconds_total" in {name for name, _ in samples}


def test_status_of_a_job_prints_its_plan_per_stage_timings_and_events(running):
    swarm, job, ports = running
    api = get(f"{ports.url}/api/jobs/{job.id}")
    out = cli("status", "--dashboard", ports.url, job.id)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"job {job.id}" in text and "RUNNING" in text and f"step {HELD_AT}/50" in text
    assert status._s(api["step_seconds"]["predicted"]) in text
    assert status._s(api["step_seconds"]["measured"]) in text
    for s in (s for g in api["plan"]["groups"] for s in g):
        row = next(line for line in text.splitlines()
                   if f" {s['node_name']} " in line and f"{s['layer_start']}-" in line)
        for part in ("compute", "wait", "send"):
            assert status._s(s["measured"][part]) in row, (part, row)
    assert "bottleneck" in text
    for e in api["events"]:
        assert e["reason"][:40] in text
    # over gRPC: the same job, its plan, step times and each stage's split (GetJob's
    # stage_times), with the stage's predicted compute
    out = cli("status", "--tracker", swarm.tracker, job.id)
    assert out.returncode == 0, out.stderr
    assert f"step {HELD_AT}/50" in out.stdout and "predicted compute" in out.stdout
    assert status._s(api["step_seconds"]["predicted"]) in out.stdout
    for s in (s for g in api["plan"]["groups"] for s in g):
        row = next(line for line in out.stdout.splitlines()
                   if f" {s['node_name']} " in line and f"{s['layer_start']}-" in line)
        for part in ("compute", "wait", "send"):
            assert status._s(s["measured"][part]) in row, (part, row)
        assert status._s(s["predicted_compute"]) in row, row  # the dashboard's figure
    out = cli("status", "--dashboard", ports.url, "nosuchjob")
    assert out.returncode == 1 and "nosuchjob" in out.stderr
    # the swarm's status lists the jobs, the dashboard's and the tracker's alike
    for where in (["--dashboard", ports.url], ["--tracker", swarm.tracker]):
        out = cli("status", *where)
        assert out.returncode == 0, out.stderr
        row = next(line for line in out.stdout.splitlines() if job.id in line)
        assert "RUNNING" in row and f"{HELD_AT}/50" in row, row


def test_fedpipe_plot_and_job_history_show_the_steps_the_api_shows(running, tmp_path):
    swarm, job, ports = running
    api = get(f"{ports.url}/api/jobs/{job.id}")
    records = job.history()
    assert [(r.step, r.loss, r.samples_per_second) for r in records] == \
        [(h["step"], h["loss"], h["samples_per_second"]) for h in api["history"]]
    png = tmp_path / "job.png"
    out = cli("plot", "--tracker", swarm.tracker, job.id, "-o", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    fig = job.plot(str(tmp_path / "job.svg"))
    assert (tmp_path / "job.svg").stat().st_size > 0
    loss, throughput = fig.axes
    assert (loss.get_title(), loss.get_xlabel(), throughput.get_ylabel()) == \
        ("loss", "step", "samples/s")
    assert list(loss.lines[0].get_ydata()) == [h["loss"] for h in api["history"]]
