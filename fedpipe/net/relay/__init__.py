"""Relays for nodes that cannot be reached (issue 25): ``fedpipe relay`` and ``--relay``. No torch.

- :mod:`.records`: the envelope records a home connection carries (``FRAMES.md``, "Relays").
- :mod:`.splice`: many streams over one home connection, with per-stream credit.
- :mod:`.server`: the relay: homes nodes, opens their ports, splices peers' connections.
- :mod:`.home`: the node's side: homes at its relays, re-homes when one is lost.
- :mod:`.tagged`: a dialer's side of one job's stream (a TAG: the relay bounds it per job).
"""
from . import records
from .home import Homing, dial, split_relays
from .records import Allocation, RelayError, RelayRefused, Tag
from .server import Relay
from .tagged import dial_job

__all__ = ["Allocation", "Homing", "Relay", "RelayError", "RelayRefused", "Tag", "dial",
           "dial_job", "records", "split_relays"]
