"""Tests of benchmarks/wan.py: its in-process steps-to-target part
(benchmarks/wan_converge.py) on a tiny budget, and its ``--quick`` run end to end (a swarm of
processes)."""
import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from fedpipe.examples.text import pydoc_text, text_batches

ROOT = pathlib.Path(__file__).resolve().parent.parent
for _name in ("wan_converge", "wan"):  # wan.py imports wan_converge: load that one first
    _spec = importlib.util.spec_from_file_location(_name, ROOT / "benchmarks" / f"{_name}.py")
    if _name not in sys.modules:
        sys.modules[_name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules[_name])
wan, wan_converge = sys.modules["wan"], sys.modules["wan_converge"]

TINY = wan_converge.Setup(d=32, seq=32, batch=16, budget=10, eval_every=5, seeds=1,
                          held_windows=16)


def test_steps_to_target_in_process_counts_the_codecs_bytes_exactly():
    conv = wan_converge.converge(TINY, [wan_converge.CONFIGS["raw"], wan_converge.CONFIGS["had4"]],
                                 log=lambda s: None)
    assert math.isfinite(conv.target)
    assert conv.steps("raw") <= TINY.budget
    # raw: d float32 values per token each way; had4: per 128-value block a float32 step
    # and 64 bytes of codes, over microbatches of 4 x 32 tokens x 32 values = 32 blocks
    assert conv.bytes_per_token("raw") == (4 * TINY.d, 4 * TINY.d)
    assert conv.bytes_per_token("had4") == (32 * 68 / 128, 32 * 68 / 128)
    assert conv.final("had4") == pytest.approx(conv.final("raw"), rel=0.05)


def test_a_replayed_run_with_a_lossy_codec_is_identical():
    train, held = pydoc_text()[0], next(text_batches(pydoc_text()[1], 16, 32, 1))
    setup = wan_converge.Setup(d=32, seq=32, batch=16, budget=6, eval_every=2, seeds=1)
    a = wan_converge.train(setup, wan_converge.CONFIGS["had2"], 0, train, held)
    b = wan_converge.train(setup, wan_converge.CONFIGS["had2"], 0, train, held)
    assert a.losses == b.losses and a.forward_bytes == b.forward_bytes


def test_steps_to_target_interpolates_between_evaluations():
    curve = wan_converge.Curve("x", 0, steps=[10, 20, 30], losses=[3.0, 2.0, 1.0])
    assert curve.steps_to(3.5) == 10
    assert curve.steps_to(1.5) == pytest.approx(25)
    assert curve.steps_to(0.5) == math.inf
    assert curve.at(25) == 2.0


def test_the_e2e_step_count_is_the_first_evaluated_step_at_or_under_the_target():
    # had2 seed 1's saved curve around its crossing: interpolated 620.3, evaluated 625
    curve = wan_converge.Curve("had2", 1, steps=[575, 600, 625, 650],
                               losses=[1.4667, 1.4741, 1.4438, 1.45])
    assert curve.steps_to(1.4495) == pytest.approx(620.3, abs=0.05)
    assert curve.evaluated_steps_to(1.4495) == 625
    assert curve.evaluated_steps_to(1.4438) == 625  # at the target counts
    assert curve.evaluated_steps_to(1.47) == 575  # the first, not the last, evaluated under it
    assert curve.evaluated_steps_to(1.4) == math.inf
    wan_e2e = _wan_e2e()
    conv = wan_converge.Convergence({"had2": [curve]}, 1.4495, 650)
    assert wan_e2e.job_of(conv, "had2") == (curve, 625)
    with pytest.raises(SystemExit, match="never reached"):
        wan_e2e.job_of(wan_converge.Convergence({"had2": [curve]}, 1.4, 650), "had2")
    with pytest.raises(SystemExit, match="no curves of 'raw'"):
        wan_e2e.job_of(conv, "raw")


def test_the_median_seed_is_the_curve_whose_steps_to_target_are_the_median():
    def curve(seed, last):
        return wan_converge.Curve("had2", seed, steps=[10, 20], losses=[3.0, last])

    # steps to a target of 2.0: seed 0 never, seed 1 at 15, seed 2 at 13.3, seed 3 at 16.7
    conv = wan_converge.Convergence({"had2": [curve(0, 2.5), curve(1, 1.0), curve(2, 0.0)]},
                                    2.0, 20)
    assert conv.median_seed("had2").seed == 1
    assert conv.median_seed("had2").steps_to(2.0) == conv.steps("had2") == 15
    # an even number of seeds: the lower of the middle two
    conv.curves["had2"].append(curve(3, 1.5))
    assert conv.median_seed("had2").seed == 1

def test_the_link_profile_shapes_every_pair():
    profile = wan.link_profile(4, 12, 5)
    pairs = {(link["from"], link["to"]) for link in profile["links"]}
    assert len(pairs) == 6 and all(link["mbps"] == 12 for link in profile["links"])


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_quick_run_prints_the_table_end_to_end():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wan.py"), "--quick"],
                         capture_output=True, text=True, timeout=840, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for name in wan_converge.DEFAULT:
        assert any(line.startswith(name + " ") for line in text.splitlines()), text
    assert "unshaped floor" in text and "ratio" in text and "load" in text


def test_curves_saved_by_parts_join_into_one_convergence(tmp_path):
    def curve(name, seed, last):
        return wan_converge.Curve(name, seed, steps=[5, 10], losses=[3.0, last],
                                  forward_bytes=1.0, backward_bytes=2.0)

    setup = wan_converge.Setup(budget=10, eval_every=5, seeds=2)
    wan_converge.save_curves(str(tmp_path / "a.json"), setup, {"had2": [curve("had2", 1, 2.5)]})
    wan_converge.save_curves(str(tmp_path / "b.json"), setup,
                             {"raw": [curve("raw", 0, 2.0), curve("raw", 1, 2.2)],
                              "had2": [curve("had2", 0, 2.4)]})
    curves = wan_converge.load_curves([str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                                      setup)
    assert list(curves) == ["raw", "had2"]  # raw first: it sets the target
    assert [c.seed for c in curves["had2"]] == [0, 1]
    conv = wan_converge.convergence(setup, curves)
    assert conv.target == pytest.approx(2.1) and conv.final("had2") == pytest.approx(2.45)
    with pytest.raises(SystemExit, match="budget 10"):
        wan_converge.load_curves([str(tmp_path / "a.json")],
                                 wan_converge.Setup(budget=20, eval_every=5))
    with pytest.raises(SystemExit, match="no raw"):
        wan_converge.convergence(setup, {"had2": curves["had2"]})


def test_step_times_saved_load_back(tmp_path):
    path = str(tmp_path / "t.json")
    wan.save_times(path, {"raw": 1.25, "had2": 0.25}, 0.5)
    assert wan.load_times(path) == ({"raw": 1.25, "had2": 0.25}, 0.5)


def _wan_e2e():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import wan_e2e
    return wan_e2e


def test_e2e_scores_the_weights_at_the_plans_boundaries_as_the_trainer_does():
    wan_e2e = _wan_e2e()
    assert wan_e2e.cuts_of([(0, 2), (2, 3), (3, 4), (4, 6)]) == TINY.cuts
    held = wan_converge.held_out(TINY)
    model = TINY.model(0)
    for p in model.parameters():  # weights other than a fresh model's
        p.data.add_(0.01 * torch.randn_like(p))
    state, losses = model.state_dict(), {}
    for name in ("raw", "had4"):
        links = [wan_converge.Link(i, wan_converge.CONFIGS[name])
                 for i in range(len(TINY.cuts))]
        want = wan_converge.evaluate(model, links, TINY.cuts, held)
        got = wan_e2e.deployed_loss(TINY, wan_converge.CONFIGS[name], state, TINY.cuts, held,
                                    wan_e2e.last_batch(TINY, 3, seed=0))
        assert got == want
        losses[name] = got
    # lowrank (rank 16 of d = 32): the nodes' bases are not fetched; made afresh from the
    # last batch, they lose what lies outside them
    lowrank = wan_e2e.deployed_loss(TINY, wan_converge.CONFIGS["lowrank8"], state, TINY.cuts,
                                    held, wan_e2e.last_batch(TINY, 3, seed=0))
    assert math.isfinite(lowrank) and lowrank != losses["raw"]



@pytest.mark.processes
@pytest.mark.timeout(300)
def test_e2e_raw_job_lands_on_the_in_process_curve():
    """``--e2e`` on a small budget over fast links: the swarm's raw job, run to its first
    evaluated step at or under the target, scores, as deployed, what the in-process trainer
    scored at that step (the target is raw's own held-out loss there)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wan.py"), "--quick",
                          "--budget", "30", "--mbps", "50", "--configs", "raw,had4",
                          "--no-swarm", "--e2e", "--best", "had4"],
                         capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {line.split()[1]: line for line in out.stdout.splitlines() if line.startswith("e2e ")}
    assert list(runs) == ["raw", "had4"], out.stdout
    loss, target = map(float, re.search(r"held-out loss ([\d.]+) vs target ([\d.]+)",
                                        runs["raw"]).groups())
    assert loss == pytest.approx(target, rel=1e-3), runs["raw"]
    assert all("wall/T" in line and "load" in line for line in runs.values())
