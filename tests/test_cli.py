"""`fedpipe plan` from JSON files and from a live tracker; `fedpipe status`."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from fedpipe.client.profile import profile_json
from fedpipe.examples import digits
from fedpipe.testing import child_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.processes]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def fedpipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpipe", *args], capture_output=True,
                          text=True, timeout=100, env=child_env())


def test_plan_from_cluster_and_model_files():
    out = fedpipe("plan", "--cluster", str(ROOT / "benchmarks/clusters/S2.json"),
                  "--model", str(ROOT / "benchmarks/models/uneven16.json"), "--batch", "32",
                  "--microbatches", "8", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["predicted_step_seconds"] > 0
    layers = sorted((s["layer_start"], s["layer_end"]) for s in plan["groups"][0]["stages"])
    assert layers[0][0] == 0 and layers[-1][1] == 16


def test_plan_previews_the_async_schedule_with_its_staleness():
    out = fedpipe("plan", "--cluster", str(ROOT / "benchmarks/clusters/S2.json"),
                  "--model", str(ROOT / "benchmarks/models/uneven16.json"), "--batch", "32",
                  "--microbatches", "8", "--schedule", "async", "--max-staleness", "2")
    assert out.returncode == 0, out.stderr
    assert "schedule async (max_staleness 2)" in out.stdout.splitlines()[0]


def test_plan_draw_writes_a_picture_of_the_plan(tmp_path):
    png = tmp_path / "plan.png"
    out = fedpipe("plan", "--cluster", str(ROOT / "benchmarks/clusters/S2.json"),
                  "--model", str(ROOT / "benchmarks/models/uneven16.json"), "--batch", "32",
                  "--microbatches", "8", "--draw", str(png))
    assert out.returncode == 0, out.stderr
    assert f"wrote {png}" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plan_reports_a_bad_file_clearly(tmp_path):
    bad = tmp_path / "cluster.json"
    bad.write_text('{"nodes": [{"id": "a"}]}')
    out = fedpipe("plan", "--cluster", str(bad), "--model",
                  str(ROOT / "benchmarks/models/uneven16.json"))
    assert out.returncode == 1
    assert "fedpipe plan:" in out.stderr and "Traceback" not in out.stderr


def test_plan_and_status_for_a_live_swarm(swarm, tmp_path):
    x, _, _, _ = digits.load()
    profile = tmp_path / "digits.json"
    profile.write_text(json.dumps(profile_json(digits.make_model(), x[:64])))
    out = fedpipe("plan", "--tracker", swarm.tracker, "--model", str(profile), "--stages", "2")
    assert out.returncode == 0, out.stderr
    assert "predicted step" in out.stdout and "node" in out.stdout
    status = fedpipe("status", "--tracker", swarm.tracker)
    assert status.returncode == 0, status.stderr
    assert "3 node(s) alive, 0 lost" in status.stdout
    assert len(re.findall(r" alive *$", status.stdout, re.M)) == 3  # one row per node
    assert "latency" in status.stdout  # and one row per directed link
    assert len(re.findall(r"^ *node\d +node\d +[\d.]+ +[\d.]+ [µm]?s ", status.stdout,
                          re.M)) == 6
    # --json: the same view, shaped as the dashboard's /api/nodes (was protobuf's JSON:
    # camelCase, and a field at its default left out)
    status = fedpipe("status", "--tracker", swarm.tracker, "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["totals"]["alive"] == 3 and len(view["links"]) == 6
    assert {n["name"] for n in view["nodes"]} == {"node0", "node1", "node2"}
    assert all(m["src_name"] != m["dst_name"] and m["bandwidth"] > 0 for m in view["links"])


def test_an_unknown_job_and_a_nodes_port_are_named_in_one_line_by_a_real_swarm(swarm,
                                                                                tmp_path):
    # the in-process stand-ins of test_cli_errors, against a real tracker and node
    for command in (["plot", "deadbeef0000", "-o", str(tmp_path / "x.png")],
                    ["status", "deadbeef0000"]):
        out = fedpipe(*command, "--tracker", swarm.tracker)
        assert (out.returncode, out.stderr) == (
            1, f"fedpipe {command[0]}: no job 'deadbeef0000' on tracker {swarm.tracker}\n")
    node = swarm.client().nodes()[0].address
    out = fedpipe("status", "--tracker", node)
    assert (out.returncode, out.stderr) == (
        1, f"fedpipe status: UNIMPLEMENTED: {node} is not a fedpipe tracker (it does not "
           f"serve the tracker's calls; is it a node's port?)\n")


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback():
    # `fedpipe plan --json | head -0`: the reader has left before anything is written
    cmd = [sys.executable, "-m", "fedpipe", "plan", "--cluster",
           str(ROOT / "benchmarks/clusters/S2.json"), "--model",
           str(ROOT / "benchmarks/models/uneven16.json"), "--json"]
    writer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env())
    assert writer.stdout is not None and writer.stderr is not None
    writer.stdout.close()
    err = writer.stderr.read().decode()
    assert writer.wait(timeout=100) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_node_refuses_a_memory_limit_below_one_byte(value):
    # 0 was taken as "no limit" by the LoadStage check (the opposite of a cap); -5 failed
    # later with protobuf's "Value out of range: -5", naming no option
    out = fedpipe("node", "--host", "127.0.0.1", "--port", "0", f"--memory-limit={value}",
                  "--tracker", "127.0.0.1:1")
    assert out.returncode == 2, out.stderr
    assert "--memory-limit" in out.stderr and "at least 1 byte" in out.stderr


def test_submit_pins_the_digits_stages_at_cuts_and_takes_recompute_and_precision(swarm):
    out = fedpipe("submit", "--tracker", swarm.tracker, "--steps", "3", "--cuts", "2,4",
                  "--recompute", "on", "--precision", "bf16-mixed")
    assert out.returncode == 0, out.stderr
    stages = re.findall(r"^  group 0 stage (\d) on \S+ \(\S+\): (.*?)  \[(.*)\]$", out.stdout,
                        re.M)
    assert [s[:2] for s in stages] == [("0", "0:Linear, 1:ReLU"), ("1", "2:Linear, 3:ReLU"),
                                       ("2", "4:Linear")]
    assert all(s[2].endswith("; recomputes its forward") for s in stages), stages
    assert "held-out accuracy: " in out.stdout


def test_submit_refused_for_memory_says_the_remedies_in_flags():
    from fedpipe.testing import LocalSwarm

    with LocalSwarm(n_nodes=2, node_args=["--memory-limit", "20000"]) as small:
        out = fedpipe("submit", "--tracker", small.tracker, "--steps", "3")
    assert out.returncode == 1
    assert out.stderr.startswith("fedpipe submit: NotEnoughMemory: job digits-mlp was refused "
                                 "at submit: ")
    assert "; to fit, give --recompute auto (or on), a larger --microbatches" in out.stderr
    assert "Traceback" not in out.stderr
