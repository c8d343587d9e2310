"""The socket data plane: fedpipe's wire frames over one TCP (or TLS) connection per peer pair.

gRPC keeps the control plane; tensors travel here, from their own memory
(``sendmsg`` of a header and the tensor's bytes) into theirs (``recv_into`` a
tensor reserved from the checked header), with credit-based flow control and a
connection that resumes after a break without losing or repeating a tensor.
Contract: ``protos/fedpipe/v1/FRAMES.md``, "Connections".

* :mod:`.records`: the records a connection carries and the preface (no torch).
* :mod:`.credits`: the sender's window.
* :mod:`.connection`: one socket: writing records, reading tensors.
* :mod:`.link`: one peer's state across connections: sequence numbers, resume,
  duplicates, acknowledgements.
* :mod:`.server`: :class:`DataPlane`, a process's listener and links.
"""
from .credits import LinkFailed
from .link import Link, LinkEvents, Peer, PeerRefused, Receiver, Refused, Timeouts
from .records import Code, Preface
from .server import DataPlane

__all__ = ["Code", "DataPlane", "Link", "LinkEvents", "LinkFailed", "Peer", "PeerRefused",
           "Preface", "Receiver", "Refused", "Timeouts"]
