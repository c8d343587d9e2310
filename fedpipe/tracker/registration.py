"""What a node's registration must carry before the registry takes it: well-formed,
bounded fields (:func:`validate_node`), and versions that work with this tracker and the
live swarm (:func:`check_versions`: the same protocol, and the same Python, torch and
cloudpickle as the live nodes, since pickled layers and tensors travel between them).
"""
from __future__ import annotations

import math
from typing import Sequence

from ..net import address
from ..proto import node_pb2, tracker_pb2
from ..spec import PROTOCOL_VERSION
from ..planner.protoio import codec_speeds
from .errors import FailedPrecondition, InvalidArgument
from .store import NodeRecord

MAX_NAME = 256
"""Longest node name or address accepted, characters."""
MAX_CODEC_SPEEDS = 32
"""Most codec costs a node may advertise (``Resources.codec_speeds``)."""
PICKLE_VERSIONS = ("python", "torch", "cloudpickle")
"""The :class:`Versions` fields every live node must agree on (pickles depend on them)."""


def validate_node(request: tracker_pb2.RegisterNodeRequest) -> None:
    """Check a registration's address, resources, name and address lengths.

    Raises:
        InvalidArgument: the first problem found.
    """
    _check_host_port("address", request.address)
    r = request.resources
    if not (math.isfinite(r.flops) and r.flops > 0) or r.memory_bytes <= 0:
        raise InvalidArgument("node resources must have finite flops > 0 and memory_bytes > 0")
    if r.host_cores < 0 or r.cores < 0 or len(r.host_id) > MAX_NAME:
        raise InvalidArgument(f"node resources must have cores and host_cores >= 0 and a "
                              f"host_id of at most {MAX_NAME} characters; got cores {r.cores}, "
                              f"host_cores {r.host_cores}, a host_id of {len(r.host_id)}")
    check_codec_speeds(r.codec_speeds)
    if len(request.name) > MAX_NAME or len(request.address) > MAX_NAME \
            or len(request.data_address) > MAX_NAME or len(request.relay) > MAX_NAME:
        raise InvalidArgument(f"node name and addresses must be at most {MAX_NAME} characters")
    for what, value in (("data address", request.data_address), ("relay", request.relay)):
        if value:
            _check_host_port(what, value)


def _check_host_port(what: str, value: str) -> None:
    """Raise InvalidArgument unless ``value`` (a node's ``what``) is HOST:PORT
    (:func:`fedpipe.net.address.problem`)."""
    why = address.problem(value)
    if why is not None:
        raise InvalidArgument(f"node {what} {value!r}: {why}")


def check_codec_speeds(speeds: Sequence[node_pb2.CodecSpeed]) -> None:
    """Check a node's measured codec costs (``Resources.codec_speeds``): at most
    :data:`MAX_CODEC_SPEEDS`, each as :meth:`~fedpipe.wire.codecmodel.CodecSpeed.check`
    wants it.

    Raises:
        InvalidArgument: the first problem found.
    """
    if len(speeds) > MAX_CODEC_SPEEDS:
        raise InvalidArgument(f"node resources may carry at most {MAX_CODEC_SPEEDS} codec "
                              f"speeds, got {len(speeds)}")
    try:
        for speed in codec_speeds(speeds):
            speed.check()
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def check_versions(name: str, theirs: tracker_pb2.Versions, live: list[NodeRecord]) -> None:
    """Refuse a node whose versions cannot work with this tracker and the ``live`` nodes.

    Args:
        name: the registering node's name, for the message.
        theirs: the versions it registered with.
        live: the other live nodes, oldest first; the first that speaks this
            tracker's protocol is the reference (all live nodes agree, since
            each was checked against it when it registered).

    Raises:
        FailedPrecondition: a different protocol version, or a Python, torch or
            cloudpickle version that differs from the reference node's; the
            message names both versions.
    """
    if theirs.protocol != PROTOCOL_VERSION:
        raise FailedPrecondition(
            f"node {name!r} speaks fedpipe protocol {theirs.protocol} (fedpipe "
            f"{theirs.fedpipe or 'unknown'}) but this tracker speaks protocol {PROTOCOL_VERSION}; "
            f"run the same fedpipe release on the tracker and every node")
    ref = next((r for r in live if r.versions.protocol == PROTOCOL_VERSION), None)
    if ref is None:
        return
    for field in PICKLE_VERSIONS:
        mine, swarm = getattr(theirs, field), getattr(ref.versions, field)
        if mine != swarm:
            raise FailedPrecondition(
                f"node {name!r} runs {field} {mine or 'unknown'} but the swarm's nodes (e.g. "
                f"{ref.info.name!r}) run {field} {swarm}; pickled layers and tensors travel "
                f"between nodes, so every node needs the same Python, torch and cloudpickle")
