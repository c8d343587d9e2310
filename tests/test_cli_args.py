"""The command line's arguments and hints, in-process: ``fedpipe.cli.parser()`` refuses a
bad value at once, naming the flag (no subprocess, no swarm)."""
from __future__ import annotations

import pytest

from fedpipe.cli import parser

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
