"""The data-plane RPCs of ``fedpipe.v1.Node`` with identity serializers: wire frames as raw bytes.

``Send``, ``PutSnapshot`` and ``PutWeights`` take a stream of wire frames
(:mod:`fedpipe.wire.format`), ``SendOne`` one frame, ``FetchState`` and
``FetchSnapshot`` return a stream of them.
node.proto declares them with ``fedpipe.v1.Frame`` (the header's type), but
their messages are frames, not serialized ``Frame``\\ s: the client and the
server here pass bytes through untouched, so no protobuf runtime copies a
payload. Every other Node method keeps its protobuf serializers.

* :class:`NodeStub`: the generated stub with the five data-plane methods
  replaced; use it wherever a node is called.
* :func:`add_node_servicer`: what ``node_pb2_grpc.add_NodeServicer_to_server``
  does, with the data-plane handlers passing bytes.
* :func:`send`: one call for a list of frames: ``SendOne`` when it is one
  frame, else ``Send`` (the Python client spares the thread it starts for
  every streaming call, the server the request iterator of a streaming one).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

import grpc
from google.protobuf import message_factory

from ..proto import node_pb2, node_pb2_grpc

_NODE = node_pb2.DESCRIPTOR.services_by_name["Node"]
SERVICE = _NODE.full_name
FRAME_STREAMS_IN = frozenset({"Send", "PutSnapshot", "PutWeights"})
"""Node methods whose request streams are wire frames."""
FRAMES_IN = FRAME_STREAMS_IN | {"SendOne"}
"""Node methods whose requests are wire frames (``SendOne``: its one request)."""
FRAMES_OUT = frozenset({"FetchState", "FetchSnapshot"})
"""Node methods whose replies are wire frames."""
FRAME_METHODS = frozenset(f"/{SERVICE}/{m}" for m in FRAMES_IN | FRAMES_OUT)
"""Full names of the methods that carry wire frames (bytes, no protobuf serializer).
Not the set a server caps: that is :data:`fedpipe.net.STREAMING_METHODS`."""
SEND = f"/{SERVICE}/Send"
SEND_ONE = f"/{SERVICE}/SendOne"


class NodeStub(node_pb2_grpc.NodeStub):
    """``fedpipe.v1.Node``'s stub, its data-plane methods passing wire frames as bytes.

    ``Send(frames)``, ``PutSnapshot(frames)`` and ``PutWeights(frames)`` take an iterator
    of frames
    (bytes) and return a ``SendReply``; ``FetchState(request)`` and
    ``FetchSnapshot(request)`` return an iterator of frames, for
    :func:`fedpipe.wire.frames.read_tensors`. ``send_one(frame)`` is
    ``SendOne``: ``Send`` as a unary call, for a tensor that fits one frame.
    """

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)  # type: ignore[no-untyped-call]  # generated, untyped
        reply = node_pb2.SendReply.FromString
        self.Send = channel.stream_unary(SEND, response_deserializer=reply)
        self.send_one = channel.unary_unary(SEND_ONE, response_deserializer=reply)
        self.PutSnapshot = channel.stream_unary(f"/{SERVICE}/PutSnapshot",
                                                response_deserializer=reply)
        self.PutWeights = channel.stream_unary(f"/{SERVICE}/PutWeights",
                                               response_deserializer=reply)
        self.FetchState = channel.unary_stream(
            f"/{SERVICE}/FetchState",
            request_serializer=node_pb2.FetchStateRequest.SerializeToString)
        self.FetchSnapshot = channel.unary_stream(
            f"/{SERVICE}/FetchSnapshot",
            request_serializer=node_pb2.FetchSnapshotRequest.SerializeToString)


def send(stub: NodeStub, frames: Iterable[bytes], **kw: Any) -> node_pb2.SendReply:
    """One ``Send`` call carrying ``frames``; ``kw`` (``timeout``, ...) goes to the call.

    A single frame goes as a unary call of ``SendOne``; more are streamed as
    ``frames`` makes them (the first two are made before the call starts).
    """
    it = iter(frames)
    first = list(itertools.islice(it, 2))
    reply: node_pb2.SendReply  # grpc's calls are untyped
    if len(first) == 1:
        reply = stub.send_one(first[0], **kw)
    else:
        reply = stub.Send(itertools.chain(first, it), **kw)
    return reply


def add_node_servicer(servicer: node_pb2_grpc.NodeServicer, server: grpc.Server) -> None:
    """Serve ``servicer`` as ``fedpipe.v1.Node`` on ``server``.

    The data-plane methods get and give wire frames as bytes; every other
    method is handled as the generated code would, with its request and reply
    types from node.proto.
    """
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for m in _NODE.methods:
        behaviour: Callable[..., Any] = getattr(servicer, m.name)
        request = message_factory.GetMessageClass(m.input_type)
        reply = message_factory.GetMessageClass(m.output_type)
        de = None if m.name in FRAMES_IN else request.FromString
        ser = None if m.name in FRAMES_OUT else reply.SerializeToString
        shape = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}[
            (m.client_streaming, m.server_streaming)]
        handlers[m.name] = shape(behaviour, request_deserializer=de, response_serializer=ser)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

