"""The socket data plane: fedpipe's wire frames over one TCP (or TLS) connection per peer pair.

gRPC keeps the control plane; tensors travel here, from their own memory
(``sendmsg`` of a header and the tensor's bytes) into theirs (``recv_into`` a
tensor reserved from the checked header), with credit-based flow control and a
connection that resumes after a break without losing or repeating a tensor.
Contract: ``protos/fedpipe/v1/FRAMES.md``, "Connections".

* :mod:`.records`: the records a connection carries and the preface (no torch).
* :mod:`.credits`: the sender's window.
* :mod:`.connection`: one socket: writing records, reading tensors.
* :mod:`.staging`: a device tensor's bytes copied to pinned host memory in chunks, each
  written as soon as it is in (the copy overlaps the send).
* :mod:`.ends`: the peer, the receiver and events a link reports to, refusals.
* :mod:`.link`: one peer's state across connections: sequence numbers, credit, resume,
  the control records this side writes.
* :mod:`.reading`: a link's reading side: the peer's records, tensors delivered in
  order, duplicates refused, the acknowledgements owed; one reader per connection.
* :mod:`.server`: :class:`DataPlane`, a process's listener and links.
* :mod:`.caps`: the listener's connection caps, in all and per caller, and who a
  relayed connection comes from.
* :mod:`.fetch`: FetchState and FetchSnapshot over a link (``FETCH`` answered by
  tensors and a ``FETCHED``): the asking side's pending fetches, the serving side's
  :class:`~.fetch.Server`.

How a node uses it (:mod:`fedpipe.node.dataplane`, :class:`fedpipe.node.peers.SocketSender`,
``fedpipe node --data-port``; a peer without a data port is served over gRPC):

* the node builds one ``DataPlane(name, receiver, host=, port=--data-port, tls=,
  events=)`` next to its gRPC server; ``receiver`` adapts the node's ``Send``:
  ``admit(peer, header)`` runs the checks of ``NodeService._admit`` with
  ``peer.identity`` in place of ``identity_of(context)``, ``deliver(peer, header,
  tensor)`` is ``StageRegistry.deliver``; domain errors become ``Refused(Code.X,
  message)`` with the code the node's error table gives them on gRPC. ``deliver``
  returns the wake-up of the stage thread waiting for the tensor rather than wake it:
  the reader runs it before it waits for the socket (or has read
  on for :data:`~.connection.LATER_SECONDS`), so a stream's tensors wake their stage once.
  ``events.lost``/``failed`` feed ``StageRegistry.suspect``.
* a peer link holds a :class:`Link` (``plane.link(peer.node_name, data_address, job,
  relayed=bool(peer.relay))``: one per peer, but one per peer and job through a relay:
  :mod:`.server`)
  instead of a channel: ``PeerSender.submit(envelope, tensor, codec)`` becomes
  ``codecs.encode_payload`` (with the sender's error feedback for gradients) and
  ``link.send_encoded(msg, payload, envelope=envelope)`` on the stage's own thread;
  ``flush()`` is ``link.flush()``; ``check()`` is ``link.check()``, its
  ``PeerRefused``/``LinkFailed`` mapped to ``StageError(peer=...)``. ``rpc.send``
  of one tensor (``SendOne``: probes, a client's feed) is ``link.send`` then
  ``link.flush``.
* a raw CPU tensor is sent from its own memory and kept until acknowledged, so a
  stage must not change it in place before ``flush`` (copy it where it would). A CUDA
  node's raw device tensor is staged through pinned host memory
  (:mod:`.staging`: ``SocketSender(copier=CudaCopier())``), and its stages' raw tensors
  are received into pinned memory (``Admitted.pinned``), moved to the device with
  ``non_blocking=True``.

What else travels over it, where both ends have a data port:

* link measurement (:func:`fedpipe.node.linkprobe.measure_socket_link`), always;
* a client's feed (:mod:`fedpipe.client.links`), unless ``Client(sockets=False)``:
  the client's plane is dial-only (``listen=False``), role ``client``, named
  ``NAME#SUFFIX`` (:func:`client_name`), and a node keys its link by that whole
  name, so two clients of one certificate have a link each;
* checkpoint snapshots to a buddy (:func:`fedpipe.runtime.snapshot_link.send_snapshot`,
  put together by the receiving node's snapshot desk), when the link to it is up (a
  broken one, waiting to resume, sends it over gRPC): the snapshot waits for its own
  tensors' acknowledgements only (``flush(through=...)``), and a refusal of it is
  raised to its shipper, never to a stage on the same link (:func:`owner_of`).

* a stage's snapshot to the node restoring it (``FetchSnapshot``;
  :class:`fedpipe.node.restore.Restorer`, served by
  :meth:`fedpipe.node.dataplane.NodeReceiver.serve` with gRPC's checks): the
  asking node's ``link.fetch(Method.FETCH_SNAPSHOT, request, admit, deliver)``,
  from a source with a data port (a relayed one through its relay's data port).

* a client's ``FetchState`` (``state_dict``) and ``FetchSnapshot`` (saves), and its
  snapshots put on the nodes when it restores a saved checkpoint (``PutSnapshot``'s
  tensors, :func:`fedpipe.client.links.put_snapshot`, checked as a gRPC
  ``PutSnapshot`` is), unless ``Client(sockets=False)``.

* a client's stream of a stage's initial weights (``PutWeights``' tensors between two
  markers, :func:`fedpipe.runtime.weights_link.send_weights`, checked as a gRPC
  ``PutWeights`` is and loaded into the stage's
  :class:`~fedpipe.node.initial.Pending`), unless ``Client(sockets=False)``.

Still on gRPC: a fetch from or a put on a node without a data port (and every call of a
client without a socket plane).
"""
from .credits import LinkFailed
from .ends import LinkEvents, Peer, PeerRefused, Receiver, Refused, owner_of
from .link import Link, Timeouts
from .records import Code, Preface
from .server import DataPlane, client_name

__all__ = ["Code", "DataPlane", "Link", "LinkEvents", "LinkFailed", "Peer", "PeerRefused",
           "Preface", "Receiver", "Refused", "Timeouts", "client_name", "owner_of"]
