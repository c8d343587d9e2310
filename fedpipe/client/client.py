"""The client's session with a tracker: its channels, and the submission of jobs.

:meth:`Client.submit` takes the common arguments of a job (model, loss, optimizer,
data, steps) and its training knobs grouped as users think of them, in frozen typed
groups from :mod:`fedpipe.spec` (:class:`~fedpipe.spec.Training`,
:class:`~fedpipe.spec.Compression`, :class:`~fedpipe.spec.Replicas`,
:class:`~fedpipe.spec.Placement`, :class:`~fedpipe.spec.Lifetime`). The flat keywords
of before (``microbatches=``, ``schedule=``, ...; :data:`~fedpipe.spec.FLAT_KNOBS`) are
still accepted; one knob given both ways is a TypeError.
"""
from __future__ import annotations

import itertools
import logging
import os
import reprlib
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

import grpc
import torch
from torch import nn

from .. import net
from ..net import timeouts, trackers
from ..net.dataplane import DataPlane
from ..planner.memfit import is_memory_refusal
from ..proto import tracker_pb2, tracker_pb2_grpc
from ..runtime import libraries
from ..runtime.materialize import TIES_ATTRIBUTE, InitFn, TiedGroup
from ..runtime.optim import LRSchedulerSpec, OptimizerSpec
from ..runtime.weights import KeyMap
from ..security import TlsConfig
from ..security.explain import explained
from ..security.signing import sign_job
from ..security.tls import resolve as resolve_tls
from ..spec import Compression, JobSpec, Knobs, Lifetime, Placement, Replicas, Training
from ..wire import rpc
from . import checkpoints, links
from .feed import Batch, cycle
from .errors import NotEnoughMemory
from .job import Job
from .packaging import check_sequential, dumps
from .reach import TrackerReach
from .watch import NoLeader
from .weights import package

log = logging.getLogger("fedpipe.client")
S = tracker_pb2


class Client:
    """Talks to a tracker at ``HOST:PORT``, and to the nodes of its jobs.

    The client owns its channels: one to the tracker and one per node address
    it has talked to (made on first use, then reused), all closed by
    :meth:`close`. Use it as a context manager::

        with fedpipe.Client("tracker:7070") as client:
            job = client.submit(...)
            job.wait()

    Closing a client whose job is still being fed ends the feed and detaches
    from the job: the job stops at its last complete checkpoint and waits, in
    state WAITING, up to its ``client_timeout`` for a client to resume it
    (``Client(addr).job(ID).resume(data)``); :meth:`Job.cancel` cancels it.

    A call refused for TLS reasons fails with a one-line reason instead of
    gRPC's bare "UNAVAILABLE: Socket closed": no certificate, another CA's, an
    expired one, or the wrong role for the method
    (:mod:`fedpipe.security.explain`); the status code stays gRPC's.

    The feed (each step's inputs and targets), ``state_dict``'s fetches, a save's
    snapshots and a restore's (``resume_from``) go over the socket data plane to a
    node that offers a data port (:mod:`.links`; one connection per node, with the
    client's certificate under TLS), over gRPC to one that does not, or to every node
    with ``sockets=False``.

    Args:
        tracker: the tracker's ``HOST:PORT``.
        sockets: use the socket data plane where a node offers it (the default; False:
            gRPC only).
        tls: mutual TLS: a :class:`fedpipe.security.TlsConfig` (a certificate
            with role client, or admin for the operator), or a TLS directory
            holding one certificate with its key. None: ``$FEDPIPE_TLS_DIR`` if
            set, else plaintext.

    Raises:
        ValueError: ``tracker`` is not ``HOST:PORT`` (:func:`fedpipe.net.trackers.addresses`).
        fedpipe.security.CertError: an unusable TLS directory or certificate.
    """

    def __init__(self, tracker: str, tls: TlsConfig | str | os.PathLike | None = None, *,
                 sockets: bool = True):
        trackers.addresses(tracker)  # a bad address now, not as UNAVAILABLE at the first call
        self.address, self.sockets = tracker, sockets
        self.tls = resolve_tls(tls)
        self.channel = explained(net.channel(tracker, tls=self.tls), tracker, self.tls)
        self.stub = tracker_pb2_grpc.TrackerStub(self.channel)
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[grpc.Channel, rpc.NodeStub]] = {}
        self._feeding: set[Job] = set()
        self._plane: DataPlane | None = None
        self._closed = False
        self.reach = TrackerReach()
        """Says once that the tracker is unreachable and once that it is back, for all of
        this client's jobs (:mod:`.reach`)."""

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def node(self, address: str) -> rpc.NodeStub:
        """The stub of the node at ``address``, on this client's one channel to it.

        Raises:
            ValueError: the client is closed.
        """
        with self._lock:
            if self._closed:
                raise ValueError(f"client of tracker {self.address} is closed")
            if address not in self._nodes:
                ch = explained(net.channel(address, tls=self.tls), address, self.tls)
                self._nodes[address] = (ch, rpc.NodeStub(ch))
            return self._nodes[address][1]

    def data_plane(self) -> DataPlane | None:
        """This client's socket data plane (made on first use; None without ``sockets``).

        Raises:
            ValueError: the client is closed.
        """
        with self._lock:
            if self._closed:
                raise ValueError(f"client of tracker {self.address} is closed")
            if self._plane is None and self.sockets:
                self._plane = links.client_plane(self.tls)
            return self._plane

    def close(self) -> None:
        """Stop feeding this client's jobs (they wait for a client, see above) and close
        every channel.

        Idempotent. Calls made after it raise ValueError.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            feeding, nodes = list(self._feeding), list(self._nodes.values())
            plane = self._plane
        for job in feeding:
            job._halt_feed()
        for ch, _ in nodes:  # ends the feed's Sends in flight
            ch.close()
        if plane is not None:  # and its sends over sockets
            plane.close()
        for job in feeding:
            job._join_feed(timeouts.THREAD_JOIN)
        self.channel.close()

    def nodes(self) -> list[tracker_pb2.NodeInfo]:
        """The live nodes, in registration order."""
        return list(self.stub.ListNodes(S.ListNodesRequest(), timeout=timeouts.CONTROL_RPC).nodes)

    def drain(self, node: str) -> tracker_pb2.DrainNodeReply:
        """Drain ``node`` (its name or id): its stages move to other nodes at the next step
        boundary with their current state (no step is lost), it takes no new work, and it
        exits once nothing needs it (see ``fedpipe drain``). Under TLS only an admin may.

        While no tracker leads (a failover, a restart) the call is sent again (a drain
        asked twice is one drain), for up to :data:`~fedpipe.net.timeouts.LEADER_WAIT` s.

        Raises:
            grpc.RpcError: NOT_FOUND for an unknown node, PERMISSION_DENIED for a caller
                that is not an admin.
            NoLeader: no tracker led within ``LEADER_WAIT`` s.
        """
        deadline = time.monotonic() + timeouts.LEADER_WAIT
        try:
            reply = net.retry(lambda: self.stub.DrainNode(S.DrainNodeRequest(node=node),
                                                          timeout=timeouts.CONTROL_RPC),
                              f"asking the tracker to drain {node}",
                              max_delay=timeouts.RECONNECT_BACKOFF_MAX,
                              stop=lambda: time.monotonic() > deadline,
                              on_retry=self.reach.lost)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            raise NoLeader(f"no tracker led within LEADER_WAIT={timeouts.LEADER_WAIT:.0f} s "
                           f"to drain node {node} ({e.code().name}: {e.details()}); set "
                           f"FEDPIPE_LEADER_WAIT to wait longer") from None
        self.reach.reached()
        return reply

    def submit(self, model: nn.Sequential,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               optimizer: OptimizerSpec, data: Iterable[Batch], *, steps: int,
               name: str = "",
               training: Training | None = None,
               compression: Compression | str | dict[str, str] | None = None,
               replicas: Replicas | int | None = None,
               placement: Placement | None = None,
               lifetime: Lifetime | None = None,
               resume_from: str | os.PathLike | None = None,
               checkpoint_dir: str | os.PathLike | None = None,
               weights: str | os.PathLike | None = None, seed: int = 0,
               init_fn: InitFn | None = None, weight_names: KeyMap | None = None,
               ties: Sequence[TiedGroup] | None = None, **knobs: Any) -> Job:
        """Submit a training job and start feeding it.

        Args:
            model: an ``nn.Sequential``; each child is a unit a stage can hold and
                must map one tensor to one tensor. Built with its weights, or under
                ``torch.device("meta")`` (no weights held here: each node makes its
                own layers from ``seed``, or reads them from ``weights``). Either
                way the tracker gets code only (:mod:`fedpipe.client.weights`).
            loss_fn: ``loss_fn(output, target)``, averaging over the batch.
            optimizer: from :func:`fedpipe.optimizer`; built per stage.
            data: (input, target) batches, inputs of shape (B, ...); re-iterated
                if it runs out before ``steps`` batches.
            steps: optimizer steps, one batch each.
            name: the job's name (default: the model's class name).
            training: :class:`fedpipe.spec.Training`: microbatches, schedule,
                max_staleness, lr_scheduler, clip_grad_norm, checkpoint_every,
                recompute (False, True or "auto"), precision ("fp32" or "bf16-mixed").
            compression: :class:`fedpipe.spec.Compression`, or "auto" (the planner
                picks each link's codec from its bandwidth), "none", a codec spec
                such as "int8+zstd", or a dict ``{"activations": ..., "gradients":
                ...}`` (top-k is for gradients only). Default "auto".
            replicas: :class:`fedpipe.spec.Replicas` (groups, sync, min_groups), or
                the number of replica groups (0: the planner chooses).
            placement: :class:`fedpipe.spec.Placement`: stages, rebalance.
            lifetime: :class:`fedpipe.spec.Lifetime`: pending_timeout, client_timeout.
            resume_from: a checkpoint folder written by :meth:`Job.save` (or a
                ``checkpoint_dir``: its newest): the job starts after that
                checkpoint's step with its weights, optimizer, LR schedule and
                DiLoCo state. ``data`` is still given from its start; the steps
                done are skipped. ``stages`` and ``replicas`` default to the
                checkpoint's; a plan that splits the layers otherwise restores
                each stage from the saved stages that held its layers
                (:mod:`fedpipe.runtime.layerstate`), exactly.
            checkpoint_dir: keep the newest :data:`~.checkpoints.KEEP` complete
                checkpoints in this folder (pulled from the nodes as each completes;
                one skipped or not kept is named in a warning), so the job can be
                resumed (``resume_from=checkpoint_dir``) even if every node and
                the tracker are lost.
            weights: a safetensors file or a Hugging Face sharded directory the
                weights start from (names checked against ``model`` here; each node
                reads its layers' tensors if it can read the path, else this client
                streams them to it).
            seed: a meta model's seed: layer ``i`` is initialized from ``(seed, i)``,
                as ``fedpipe.materialize(model, seed, init_fn)`` does in one process.
                Every job's dropout masks are seeded from it too: layer ``i`` on
                microbatch ``m`` of step ``s`` draws from ``(seed, s, group, m, i)``
                (:mod:`fedpipe.runtime.rng`), wherever it runs.
            init_fn: ``init_fn(layer, index, generator)`` run after each meta layer's
                ``reset_parameters()`` (e.g. :func:`fedpipe.hf.init_fn`).
            weight_names: ``names(layer_index, key)``: the file names of a layer's
                tensors in ``weights`` (default ``"3.weight"``, an nn.Sequential's).
            ties: tied parameters across layers (an LM's input embedding and head),
                each a group of ``(layer, parameter name)`` copies that start equal and
                whose gradients are summed before every optimizer step, as
                :attr:`fedpipe.hf.HFLayers.tied_parameters` gives them. Synchronous
                schedules only. None (the default): the ties ``fedpipe.hf.sequential``
                recorded on its layers, if ``model`` is those, else none; ``()`` unties
                them (each copy trains apart).
            knobs: the flat keywords, one per knob of the groups above
                (:data:`fedpipe.spec.FLAT_KNOBS`): ``microbatches``, ``schedule``,
                ``max_staleness``, ``lr_scheduler``, ``clip_grad_norm``,
                ``checkpoint_every``, ``recompute``, ``precision``, ``replica_sync``,
                ``min_replicas``,
                ``stages``, ``rebalance``, ``pending_timeout`` (None: no limit),
                ``client_timeout``; each documented at its group.

        Raises:
            LayerInputError: a layer of ``model`` cannot take the batch's inputs or the
                output of the layer before it (its index, name and type, the shape it
                got and what it expects; a ValueError).
            fedpipe.runtime.materialize.MaterializeError: a meta layer has a tensor
                nothing initializes (named; a ValueError).
            fedpipe.runtime.weights.WeightsError: ``weights`` lacks a layer's tensor or
                holds another shape (named; a ValueError).
            TypeError: not an nn.Sequential, a layer not tensor-to-tensor, a ``loss_fn``
                that is not callable (a name such as "cross_entropy"), a bad optimizer or
                lr_scheduler, an unknown keyword, or a knob given both in its group and
                as a flat keyword.
            fedpipe.spec.JobSpecError: a bad setting (a ValueError; ``field`` names it).
            ValueError: empty data, a batch too small for the microbatches, an
                lr_scheduler whose arguments do not fit it or the optimizer, or
                ``stages`` or ``replicas`` other than ``resume_from``'s checkpoint's.
            fedpipe.client.checkpoints.CheckpointError: ``resume_from`` holds no
                readable checkpoint, or one at or past ``steps``.
            NotEnoughMemory: the job fits no plan over the swarm's memory (the tracker's
                refusal: what it needs and what the nodes have, and the remedies).
            grpc.RpcError: the tracker refused the job otherwise (e.g. RESOURCE_EXHAUSTED:
                too many jobs of this owner) or is unreachable.
        """
        n_layers = len(check_sequential(model))
        if knobs.get("pending_timeout", 0.0) is None:
            knobs["pending_timeout"] = 0.0  # None: no limit, as before the groups
        given = Knobs.gather({"training": training, "compression": compression,
                              "replicas": replicas, "placement": placement,
                              "lifetime": lifetime}, knobs)
        _check_loss(loss_fn)
        lr_scheduler = _check_optimizers(optimizer, given.training.lr_scheduler)
        restore = None
        if resume_from is not None:
            restore = checkpoints.read(resume_from)
            given = _resumed(given, restore, resume_from, steps)
        microbatches = given.training.microbatches
        job_spec = given.job_spec(
            steps=steps, optimizer=dumps(optimizer), loss_fn=dumps(loss_fn),
            optimizer_kind=optimizer.kind,
            lr_scheduler=dumps(lr_scheduler) if lr_scheduler else b"").validate(n_layers)
        batches = cycle(data)
        try:
            first = next(batches)
        except StopIteration:
            raise ValueError("data yielded no batch") from None
        x0, _ = first
        if x0.shape[0] < microbatches:
            raise ValueError(f"batch of {x0.shape[0]} samples cannot be split into "
                             f"{microbatches} microbatches")
        if ties is None:
            ties = getattr(model, TIES_ATTRIBUTE, ())
        code = package(model, x0, seed=seed, init_fn=init_fn, weights=weights,
                       names=weight_names, ties=ties)
        job_spec = job_spec.with_(batch_size=x0.shape[0], weights=code.weights,
                                  libraries=libraries.used_by(model))
        job_spec.validate(n_layers)
        job_id = self._submit_job(name or type(model).__name__, code.layers, job_spec,
                                  code.profile, given.lifetime.pending_timeout)
        job = Job(self, job_id, model, microbatches, spec=job_spec,
                  checkpoint_dir=checkpoint_dir, weights=code.tensors, names=weight_names)
        try:
            job._start_feed(itertools.chain([first], batches), restore=restore)
        except (grpc.RpcError, ValueError) as e:  # refused or closed: nobody would feed it
            _cancel_quietly(job, f"the client could not start feeding it: {e}")
            raise
        return job

    def _submit_job(self, name: str, layers: list[bytes], job_spec: JobSpec,
                    profile: tracker_pb2.ModelProfile, pending_timeout: float) -> str:
        """SubmitJob (signed under TLS); the job's id."""
        config = job_spec.to_proto()
        req = S.SubmitJobRequest(name=name, layers=layers, config=config, profile=profile,
                                 pending_timeout=pending_timeout)
        if self.tls is not None:  # the tracker and every node check it before unpickling
            signed = sign_job(self.tls, layers, config)
            req.owner, req.job_signature = signed.owner, signed.job_signature
            req.client_cert = signed.client_cert
            req.layer_digests.extend(signed.layer_digests)
        try:
            job_id: str = self.stub.SubmitJob(req, timeout=timeouts.SUBMIT_RPC).job_id
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                    is_memory_refusal(e.details() or ""):
                raise NotEnoughMemory(f"job {name} was refused at submit: {e.details()}"
                                      ) from None
            raise
        return job_id

    def job(self, job_id: str) -> Job:
        """Attach to an existing job: to watch it, fetch its weights, save it, cancel
        it, or feed it again (:meth:`Job.resume`)."""
        return Job(self, job_id)



def _check_loss(loss_fn: object) -> None:
    """Raise TypeError unless ``loss_fn`` can be called, naming what it is instead: a loss
    given by name would be sent and fail on a node at the first step."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (e.g. torch.nn.functional.cross_entropy), "
                        f"got {type(loss_fn).__name__} {reprlib.repr(loss_fn)}")


def _check_optimizers(optimizer: object, lr_scheduler: object | None
                      ) -> LRSchedulerSpec | None:
    """The LR scheduler, once both it and the optimizer are of the right kind.

    Raises:
        TypeError: an optimizer or scheduler not made by fedpipe's helpers.
        ValueError: a scheduler whose arguments do not fit it or the optimizer.
    """
    if not isinstance(optimizer, OptimizerSpec):
        raise TypeError("optimizer must come from fedpipe.optimizer(torch.optim.X, ...)")
    if lr_scheduler is None:
        return None
    if not isinstance(lr_scheduler, LRSchedulerSpec):
        raise TypeError("lr_scheduler must come from "
                        "fedpipe.lr_scheduler(torch.optim.lr_scheduler.X, ...)")
    lr_scheduler.check(optimizer)
    return lr_scheduler


def _resumed(knobs: Knobs, restore: checkpoints.SavedCheckpoint,
             resume_from: str | os.PathLike, steps: int) -> Knobs:
    """The knobs of a job resumed from ``restore``: its stages and replica groups are
    the checkpoint's unless asked otherwise (either way each new stage is restored
    from the saved stages that held its layers).

    Raises:
        checkpoints.CheckpointError: the checkpoint is at or past ``steps``.
    """
    if restore.step >= steps:
        raise checkpoints.CheckpointError(
            f"the checkpoint in {resume_from} is after step {restore.step}; the job "
            f"has only {steps} steps")
    return replace(knobs,
                   placement=replace(knobs.placement,
                                     stages=knobs.placement.stages or restore.depth),
                   replicas=replace(knobs.replicas,
                                    groups=knobs.replicas.groups or restore.replicas))


def _cancel_quietly(job: Job, reason: str) -> None:
    """Cancel ``job`` (best effort: a failure is logged)."""
    try:
        job.cancel(reason)
    except (grpc.RpcError, ValueError) as e:
        log.warning("could not cancel job %s: %s", job.id, e)
