"""Constants of the data plane: message kinds, snapshots kept, the protocol version."""
from __future__ import annotations

import enum

from ..proto import node_pb2


class Kind(enum.IntEnum):
    """What a tensor on the data plane is; values are the wire's ``fedpipe.v1.Kind``."""

    INPUT = node_pb2.KIND_INPUT
    TARGET = node_pb2.KIND_TARGET
    ACTIVATION = node_pb2.KIND_ACTIVATION
    GRADIENT = node_pb2.KIND_GRADIENT
    PROBE = node_pb2.KIND_PROBE
    REDUCE = node_pb2.KIND_REDUCE
    OUTER = node_pb2.KIND_OUTER
    NORM = node_pb2.KIND_NORM
    SNAPSHOT = node_pb2.KIND_SNAPSHOT


SNAPSHOTS_KEPT = 2
"""Checkpoint snapshots a node keeps per stage (its own, and as a buddy): the newest
complete checkpoint and the one being taken."""

PROTOCOL_VERSION = 3
"""fedpipe's wire protocol version: nodes and trackers of different versions refuse each other."""
