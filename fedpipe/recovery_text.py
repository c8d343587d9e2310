"""A job's recovery record (``fedpipe.v1.Recovery``) in words.

One home for the sentences the tracker writes into a job's reason and the client
and the dashboard show, so the three say the same. No torch, no I/O: the
tracker's core, the client and :mod:`fedpipe.observe` all import it.
"""
from __future__ import annotations

from .proto import tracker_pb2


def recovery_what(rec: tracker_pb2.Recovery) -> str:
    """What a recovery did to the nodes, in words: ``"lost node1; moved node1 -> node3"``,
    ``"drained node1; moved node1 -> node2"``, ``"moved node1 -> node2"`` (a rebalance
    loses nothing), or ``"lost the client"``."""
    lost = {"drain": "drained"}.get(rec.cause, "lost")
    parts = [f"{lost} {rec.lost}"] if rec.lost else []
    if rec.moved_from or rec.moved_to:
        parts.append(f"moved {rec.moved_from or '-'} -> {rec.moved_to or '-'}")
    return "; ".join(parts)


def recovery_headline(rec: tracker_pb2.Recovery) -> str:
    """A recovery in a sentence, as a job's reason and ``JobStatus`` start it:
    ``"recovered from the loss of node1"``, ``"handed over from draining node1"``,
    ``"migrated from node1 to node2"``."""
    return {"loss": f"recovered from the loss of {rec.lost}",
            "drain": f"handed over from draining {rec.lost}",
            "rebalance": f"migrated from {rec.moved_from or '-'} to {rec.moved_to or '-'}"
            }.get(rec.cause, f"recovered from {rec.cause}")


__all__ = ["recovery_headline", "recovery_what"]
