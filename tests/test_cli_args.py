"""The command line's arguments and hints, in-process: ``fedpipe.cli.parser()`` refuses a
bad value at once, naming the flag (no subprocess, no swarm)."""
from __future__ import annotations

import json
import pathlib

import pytest

from fedpipe.cli import main, parser
from fedpipe.cli_args import settle_staleness

pytestmark = pytest.mark.timeout(30)

TRACKER_COMMANDS = [["status"], ["plot", "JOB", "-o", "x.png"],
                    ["plan", "--model", "m.json"], ["drain", "NODE"], ["cancel", "JOB"],
                    ["submit"], ["node"]]


@pytest.mark.parametrize("command", TRACKER_COMMANDS, ids=lambda c: c[0])
def test_every_command_refuses_a_tracker_address_without_a_port_before_any_call(command,
                                                                                 capsys):
    # was (fedpipe status --tracker 127.0.0.1): gRPC's raw UNAVAILABLE, from port 443
    with pytest.raises(SystemExit) as exit:
        parser().parse_args([*command, "--tracker", "127.0.0.1"])
    assert exit.value.code == 2
    assert "argument --tracker: '127.0.0.1': expected HOST:PORT" in capsys.readouterr().err
    args = parser().parse_args([*command, "--tracker", "a:7070,b:7071"])
    assert args.tracker == "a:7070,b:7071"


def test_a_bad_address_among_several_trackers_is_named(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["status", "--tracker", "a:7070,b"])
    assert "'b' in 'a:7070,b': expected HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["submit", "--tracker", "a:7070"], ["demo"],
                                     ["plan", "--cluster", "c.json", "--model", "m.json"]],
                         ids=lambda c: c[0])
def test_a_gradients_only_codec_for_compression_is_refused_with_a_hint_in_flags(command,
                                                                                  capsys):
    # was (at submit): "... e.g. compression={'activations': 'int8', 'gradients': ...}",
    # Python's syntax on a command line
    with pytest.raises(SystemExit):
        parser().parse_args([*command, "--compression", "topk:0.05"])
    err = capsys.readouterr().err
    assert ("argument --compression: 'topk:0.05' drops most of each tensor, so it cannot "
            "carry activations: use it for gradients only, e.g. --compression int8 "
            "--gradient-compression topk:0.05") in err
    assert "compression=" not in err
    args = parser().parse_args([*command, "--compression", "int8", "--gradient-compression",
                                "topk:0.05"])
    assert (args.compression, args.gradient_compression) == ("int8", "topk:0.05")


def test_an_unknown_codec_for_compression_lists_those_that_carry_activations(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["demo", "--compression", "int9"])
    assert ("argument --compression: bad codec spec 'int9': unknown codec 'int9'; valid: "
            "['auto', 'none', 'bf16', 'fp16', 'had2', 'had4', 'int8', 'lowrank', 'lowrank8', "
            "'raw']") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["demo", "--gradient-compression", "zstd"])
    assert ("argument --gradient-compression: bad codec spec 'zstd': zstd is a suffix to a "
            "codec, not a codec: e.g. 'raw+zstd' or 'int8+zstd'") in capsys.readouterr().err


def test_a_codec_level_out_of_range_is_refused_naming_the_flag_and_the_range(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["demo", "--gradient-compression", "int8+zstd:99"])
    assert ("argument --gradient-compression: bad codec spec 'int8+zstd:99': zstd level must "
            "be in [1, 22], got 99") in capsys.readouterr().err


def test_plan_takes_a_gradient_codec_of_its_own(capsys):
    root = pathlib.Path(__file__).resolve().parent.parent
    assert main(["plan", "--cluster", str(root / "benchmarks/clusters/S2.json"), "--model",
                 str(root / "benchmarks/models/uneven16.json"), "--stages", "2",
                 "--compression", "int8", "--gradient-compression", "topk:0.05",
                 "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["groups"][0]["stages"]
    assert {s["gradient_codec"] for s in stages[1:]} == {"topk:0.05"}
    assert {s["activation_codec"] for s in stages[:-1]} == {"int8"}


ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = ["plan", "--cluster", str(ROOT / "benchmarks/clusters/S2.json"), "--model",
        str(ROOT / "benchmarks/models/uneven16.json")]


def test_plan_pins_the_stage_boundaries_of_cuts_and_their_depth(capsys):
    assert main([*PLAN, "--cuts", "4,9", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["groups"][0]["stages"]
    assert [(s["layer_start"], s["layer_end"]) for s in stages] == [(0, 4), (4, 9), (9, 16)]


@pytest.mark.parametrize("cuts,stages,why", [
    ("9,4", [], "cuts must strictly increase (each stage holds at least one layer); 4 "
                "follows 9 in (9, 4)"),
    ("4,99", [], "cut 99 is out of range: the model has 16 layers (top-level children "
                 "0..15), so each cut must be in 1..15; got (4, 99)"),
    ("4,9", ["--stages", "2"], "2 stages need 1 cut(s), one after each stage but the last; "
                               "got 2: (4, 9)")])
def test_plan_refuses_cuts_that_break_placements_rule_naming_the_flag(cuts, stages, why,
                                                                       capsys):
    assert main([*PLAN, "--cuts", cuts, *stages]) == 2
    assert capsys.readouterr().err == f"fedpipe plan: --cuts {cuts}: {why}\n"
    with pytest.raises(SystemExit):
        parser().parse_args([*PLAN, "--cuts", "2;3"])
    assert "argument --cuts: expected child indices separated by commas, e.g. 2,3,4; got " \
           "'2;3'" in capsys.readouterr().err


def test_plans_schedule_is_submits_default_and_its_help_says_which(capsys):
    from fedpipe.spec import Training

    assert parser().parse_args(PLAN).schedule == Training().schedule == "gpipe"
    with pytest.raises(SystemExit):
        parser().parse_args(["plan", "--help"])
    assert "(default: gpipe, as submit()'s)" in " ".join(capsys.readouterr().out.split())


def test_plan_and_submit_on_the_command_line_take_submits_microbatches_and_schedule(capsys):
    # was: fedpipe plan and fedpipe submit 4 microbatches, submit() and the planner 1
    from fedpipe.planner import TrainConfig
    from fedpipe.spec import MICROBATCHES, JobSpec, Training

    plan, submit = parser().parse_args(PLAN), parser().parse_args(["submit", "--tracker", "a:1"])
    assert (plan.microbatches == submit.microbatches == Training().microbatches
            == JobSpec(steps=1).microbatches == TrainConfig(batch_size=1).microbatches
            == MICROBATCHES)
    assert plan.schedule == submit.schedule == Training().schedule
    demo = parser().parse_args(["demo"])
    assert (demo.microbatches, demo.schedule) == (4, "1f1b")  # the demo's own, said in --help
    assert main([*PLAN, "--stages", "2"]) == 0
    plural = "es" if MICROBATCHES != 1 else ""
    assert f"batch 64 in {MICROBATCHES} microbatch{plural}, schedule gpipe" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser().parse_args(["plan", "--help"])
    assert (f"microbatches per step (default: {MICROBATCHES}, as submit()'s)"
            in " ".join(capsys.readouterr().out.split()))


def test_submit_takes_cuts_as_plan_does_and_refuses_bad_ones_before_any_call(capsys):
    args = parser().parse_args(["submit", "--tracker", "127.0.0.1:1", "--cuts", "2,4"])
    assert (args.cuts, args.stages) == ((2, 4), None)
    # the digits MLP has 5 children; no tracker listens at port 1, so a call would fail
    assert main(["submit", "--tracker", "127.0.0.1:1", "--cuts", "2,9"]) == 2
    assert capsys.readouterr().err == (
        "fedpipe submit: --cuts 2,9: cut 9 is out of range: the model has 5 layers (top-level "
        "children 0..4), so each cut must be in 1..4; got (2, 9)\n")
    assert main(["submit", "--tracker", "127.0.0.1:1", "--cuts", "2,4", "--stages", "2"]) == 2
    assert "fedpipe submit: --cuts 2,4: 2 stages need 1 cut(s)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["submit", "--tracker", "a:1", "--cuts", "2;3"])
    assert "argument --cuts: expected child indices separated by commas" in \
        capsys.readouterr().err


@pytest.mark.parametrize("advertise,why", [
    ("127.0.0.1", "'127.0.0.1': expected HOST:PORT"),
    ("http://h:7070", "'http://h:7070': expected HOST:PORT, not a URL (no scheme, no path)"),
    ("h:99999", "'h:99999': expected HOST:PORT with a port in 1..65535, not '99999'")])
def test_the_trackers_advertise_is_refused_at_parse_by_the_rule_and_words_of_tracker(
        advertise, why, capsys):
    # was: taken as given, and named to callers by standbys as the leader's address
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(["tracker", "--advertise", advertise])
    assert exit.value.code == 2
    assert f"argument --advertise: {why}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["status", "--tracker", advertise])
    assert f"argument --tracker: {why}" in capsys.readouterr().err  # the same words
    assert parser().parse_args(["tracker", "--advertise", "[::1]:7070"]).advertise == \
        "[::1]:7070"


def test_a_plan_that_fits_no_memory_says_the_remedies_in_flags(tmp_path, capsys):
    # was: '... to fit, submit with recompute="auto" (or True), more microbatches, ...'
    # on the command line, which takes --microbatches
    from fedpipe.planner.memfit import MEMORY_REMEDIES, for_command_line, is_memory_refusal

    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"nodes": [{"id": "a", "tflops": 1, "memory_bytes": 20000}]}))
    assert main(["plan", "--cluster", str(tiny), "--model",
                 str(ROOT / "benchmarks/models/uneven16.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedpipe plan: PlanError: no split of ")
    assert err.endswith("; to fit, give --recompute auto (or on), a larger --microbatches, "
                        "--precision bf16-mixed, or add nodes\n")
    assert MEMORY_REMEDIES not in err
    assert is_memory_refusal(f"x{MEMORY_REMEDIES}")  # the client still tells one by its text
    assert for_command_line("no memory words") == "no memory words"


def test_plan_and_submit_take_recompute_and_precision_as_submit_does(tmp_path, capsys):
    # was: only submit()'s keywords; the command line's memory remedies named none of them
    small = tmp_path / "small.json"  # one node: the model fits in bf16 only
    small.write_text(json.dumps({"nodes": [{"id": "a", "tflops": 1,
                                            "memory_bytes": int(3.5 * 2**30)}]}))
    model = ["--model", str(ROOT / "benchmarks/models/uneven16.json")]
    assert main(["plan", "--cluster", str(small), *model]) == 1
    assert "--precision bf16-mixed" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(small), *model, "--precision", "bf16-mixed"]) == 0
    assert ", precision bf16-mixed, recompute off" in capsys.readouterr().out.splitlines()[0]
    assert main([*PLAN, "--stages", "2", "--recompute", "on", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert [s["recompute"] for s in planned["groups"][0]["stages"]] == [True, True]
    assert (planned["precision"], planned["recompute"]) == ("fp32", "on")
    args = parser().parse_args(["submit", "--tracker", "a:1", "--recompute", "auto",
                                "--precision", "bf16-mixed"])
    assert (args.recompute, args.precision) == ("auto", "bf16-mixed")
    with pytest.raises(SystemExit):
        parser().parse_args(["submit", "--tracker", "a:1", "--precision", "fp16"])
    assert "argument --precision: invalid choice: 'fp16' (choose from 'fp32', 'bf16-mixed')" \
        in capsys.readouterr().err


@pytest.mark.parametrize("relay,why", [
    ("127.0.0.1", "relay '127.0.0.1': expected HOST:PORT"),
    (",", "--relay ',' names no relay (HOST:PORT[,HOST:PORT])"),
    ("r1:7000,http://r2:7000", "relay 'http://r2:7000': expected HOST:PORT, not a URL")])
def test_a_nodes_relay_is_refused_at_parse_naming_the_entry_at_fault(relay, why, capsys):
    # was: checked only when the node started, after its other arguments were taken
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(["node", "--tracker", "t:7070", "--relay", relay])
    assert exit.value.code == 2
    assert f"argument --relay: {why}" in capsys.readouterr().err
    assert parser().parse_args(["node", "--tracker", "t:7070", "--relay",
                                "r1:7000, [::1]:7001"]).relay == ["r1:7000", "[::1]:7001"]


@pytest.mark.parametrize("url,hint", [("127.0.0.1:17080", "; did you mean http://127.0.0.1:17080?"),
                                      ("localhost:17080", "; did you mean http://localhost:17080?"),
                                      ("ftp://h:1", "")])
def test_a_dashboard_url_without_http_is_refused_at_parse_with_what_to_give(url, hint, capsys):
    # was: taken, then "fedpipe status: ValueError: unknown url type: '127.0.0.1:17080'"
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(["status", "--dashboard", url])
    assert exit.value.code == 2
    assert (f"argument --dashboard: {url!r}: expected the dashboard's URL, http://HOST:PORT "
            f"(the tracker's --http-port){hint}") in " ".join(capsys.readouterr().err.split())
    assert parser().parse_args(["status", "--dashboard", "http://h:7080"]).dashboard == \
        "http://h:7080"


@pytest.mark.parametrize("command", [["submit", "--tracker", "a:7070"], ["demo"],
                                     ["plan", "--cluster", "c.json", "--model", "m.json"]],
                         ids=lambda c: c[0])
def test_the_async_schedule_and_its_staleness_are_flags(command, capsys):
    args = parser().parse_args([*command, "--schedule", "async", "--max-staleness", "2"])
    assert (args.schedule, args.max_staleness) == ("async", 2)
    assert settle_staleness(args) == "" and args.max_staleness == 2
    args = parser().parse_args([*command, "--schedule", "async"])
    assert settle_staleness(args) == "" and args.max_staleness == 1  # submit()'s default
    with pytest.raises(SystemExit):
        parser().parse_args([*command, "--max-staleness", "-1"])
    assert "argument --max-staleness: expected an integer >= 0, got '-1'" in capsys.readouterr().err
    # given where nothing uses it: said, not ignored
    assert main([*command, "--schedule", "1f1b", "--max-staleness", "2"]) == 2
    assert ("--max-staleness applies to --schedule async only (this is --schedule 1f1b"
            in capsys.readouterr().err)
