"""How a stage is wired from its LoadStage request: layers, optimizer, loss, replica
sync, runner, and the transport between its runner and the node's mailbox and peers.

:func:`build_stage` makes a :class:`~fedpipe.node.lifecycle.Stage` in state
LOADING; :class:`~fedpipe.node.stages.StageRegistry` runs its life from there.
"""
from __future__ import annotations

import logging
from typing import Callable

import cloudpickle
import torch
from torch import nn

from ..proto import node_pb2, tracker_pb2
from ..runtime import checkpoint, layerstate, libraries
from ..runtime.checkpoint import FEEDBACK, LAYOUT
from ..runtime.gradfeedback import GradientFeedbackPart
from ..runtime.allreduce import GradientSync, StageSpan
from ..runtime.async_stage import AsyncStageRunner
from ..runtime.clip import GlobalNormClip
from ..runtime.diloco import OuterSync
from ..runtime.elastic import AskQuorum, ElasticGradientSync, ElasticOuterSync
from ..runtime.materialize import norm_parameters
from ..runtime.rng import LayerSeeds
from ..runtime.ties import TiedGradients
from ..runtime.stage import StageError, StepHook, SyncStageRunner, TimedTransport
from ..spec import (CODEC_POLICIES, LOWRANK_CODECS, JobSpec, Kind, PlanView, Quorum, StageKey,
                    parse_codec, stage_recomputes)
from ..wire import lowrank
from .errors import StageLoadError
from .initial import make_layers
from .lifecycle import Stage, StageSlot
from .mailbox import Mailbox
from .peers import StagePeers

log = logging.getLogger(__name__)


def uses_lowrank(plan: PlanView) -> bool:
    """Whether a stage of ``plan`` sends activations or gradients with a lowrank codec: then
    every stage keeps the bases of its boundaries (:attr:`~.lifecycle.Stage.subspace`)."""
    return any(parse_codec(c).name in LOWRANK_CODECS for a in plan.stages.values()
               for c in (a.activation_codec, a.gradient_codec) if c not in ("", *CODEC_POLICIES))


class StageTransport:
    """:class:`~fedpipe.runtime.stage.Transport` over the node's mailbox and a stage's peers.

    Args:
        stage: the stage (its slot, state, peers, and plan: to find peers and the codecs
            of this stage's links).
        mailbox: where the node puts what arrives for its stages.
        device: where received tensors go (to a CUDA device asynchronously: :meth:`recv`).
        foreign_failed: elastic replica groups: called with the address of another
            group's stage a send failed to, instead of failing this stage (None: every
            failure fails it).
    """

    def __init__(self, stage: Stage, mailbox: Mailbox, device: torch.device,
                 foreign_failed: Callable[[str], None] | None = None):
        self.stage, self.mailbox, self.device = stage, mailbox, device
        self._async = device.type == "cuda"
        self.foreign_failed = foreign_failed
        mine = self.plan[stage.key]
        prev, nxt = self.plan.neighbours(stage.key)
        # the plan gives each stage the codecs of what it sends
        self.routes = {Kind.ACTIVATION: (nxt, mine.activation_codec or "raw"),
                       Kind.GRADIENT: (prev, mine.gradient_codec or "raw")}

    @property
    def plan(self) -> PlanView:
        """The stage's plan now (an elastic job's changes with its membership)."""
        if self.stage.plan is None:
            raise StageError(f"stage {self.stage.key.stage} was released")
        return self.stage.plan

    def recv(self, kind: Kind, step: int, tag: int,
             timeout: float | None = None) -> tuple[torch.Tensor, int]:
        """As :meth:`Transport.recv`; also raises Stopped when the stage is stopped.

        To a CUDA device the tensor is copied with ``non_blocking=True``: from pinned
        memory (the socket data plane receives a CUDA stage's raw tensors into it:
        :attr:`fedpipe.wire.frames.Admitted.pinned`) the copy is queued on the current
        stream and this returns at once; the stage's kernels on that stream run after
        it, and torch's caching host allocator keeps the pinned block from being reused
        until the copy completed (PyTorch's "A guide on good usage of ``non_blocking``
        and ``pin_memory()``"). From pageable memory (gRPC's tensors) the driver copies
        it out before the call returns, as a blocking copy does. On the CPU nothing
        changes: the tensor is returned as it is.
        """
        t, batch = self.mailbox.get(self.stage.inbox, kind, step, tag, stopped=self._stopped,
                                    timeout=timeout)
        return t.to(self.device, non_blocking=self._async), batch

    def _stopped(self) -> bool:
        """Whether to give up waiting: the stage was stopped; StageError if a send failed
        (the peer will not answer what it never got)."""
        try:
            self.stage.peers.check()
        except StageError as e:
            own = {a.address for a in self.plan.chain(self.stage.key.replica)}
            if self.foreign_failed is None or not e.peer or e.peer in own:
                raise
            self.foreign_failed(e.peer)
        return not self.stage.live

    def send(self, kind: Kind, step: int, microbatch: int, tensor: torch.Tensor,
             batch_size: int) -> None:
        peer, codec = self.routes[kind]
        if peer is None:  # a runner's bug: a first stage sends no gradient, a last no activation
            raise StageError(f"stage {self.stage.key.stage} has no neighbour to send "
                             f"{Kind(kind).name.lower()}s to")
        self._submit(peer, kind, step, microbatch, tensor, batch_size, codec)

    def send_to(self, peer: StageKey, kind: Kind, step: int, tag: int, tensor: torch.Tensor,
                batch_size: int = 1, codec: str = "raw") -> None:
        self._submit(self.plan[peer], kind, step, tag, tensor, batch_size, codec)

    def _submit(self, peer: node_pb2.StageAssignment, kind: Kind, step: int, tag: int,
                tensor: torch.Tensor, batch_size: int, codec: str) -> None:
        env = node_pb2.Envelope(job_id=self.stage.job_id, replica=peer.replica,
                                stage=peer.stage, kind=Kind(kind).value, step=step,
                                microbatch=tag, batch_size=batch_size, epoch=self.stage.epoch)
        self.stage.peers.sender(peer).submit(env, tensor, codec,
                                             self.stage.codec_end(env, sending=True))


class ElasticHooks:
    """A stage's link to the tracker's quorum (elastic replica groups,
    :mod:`fedpipe.tracker.replicas`): asks it, follows the plan it sends when the
    membership changed, and keeps its state for a joining group when told to.

    Args:
        stage: the stage (its plan is replaced with the tracker's when it changed).
        quorum: one ReplicaQuorum call to the tracker.
        node_id: returns this node's id.
        keep: keeps a snapshot on this node, under a stage key.
        suspect: reports a peer a send failed to (the tracker pings it).
    """

    def __init__(self, stage: Stage,
                 quorum: Callable[[tracker_pb2.ReplicaQuorumRequest],
                                  tracker_pb2.ReplicaQuorumReply],
                 node_id: Callable[[], str],
                 keep: Callable[[str, StageKey, checkpoint.Snapshot], object],
                 suspect: Callable[[Stage, str], None]):
        self.stage, self.quorum = stage, quorum
        self.node_id, self.keep, self.suspect = node_id, keep, suspect
        self.donate: tuple[int, ...] = ()

    def ask(self, step: int, version: int, reduced: bool, wait: float,
            next_step: int = 0) -> Quorum:
        """As :class:`~fedpipe.runtime.elastic.AskQuorum`."""
        st = self.stage
        reply = self.quorum(tracker_pb2.ReplicaQuorumRequest(
            job_id=st.job_id, epoch=st.epoch, replica=st.key.replica, stage=st.key.stage,
            node_id=self.node_id(), step=step, version=version, reduced=reduced,
            wait_seconds=wait, next_step=next_step))
        if reply.plan.stages and st.plan is not None:  # the membership changed: a joining
            st.plan = PlanView(reply.plan, st.plan.job_microbatches)  # group's nodes are new
            st.peers.keep_only({a.address for a in reply.plan.stages})
        q = Quorum(reply.step, reply.version, tuple(reply.members), reply.committed,
                   reply.dropped, tuple(reply.donate_to), tuple(reply.next_members))
        if q.committed:
            self.donate = q.donate_to
        return q

    def peer_failed(self, address: str) -> None:
        """A send to another group's stage at ``address`` failed: report it, and forget
        the sender so the stage's other sends and receives go on."""
        self.stage.peers.forget(address)
        self.suspect(self.stage, address)

    def after_update(self, step: int) -> None:
        """``after_update`` hook: after the step before a group joins, keep this stage's
        state (weights, optimizer, LR schedule) under the joining group's stage key."""
        if self.donate:
            snap = checkpoint.take(self.stage.parts, step + 1)
            for group in self.donate:
                self.keep(self.stage.job_id, StageKey(group, self.stage.key.stage), snap)
            log.info("job %s stage %d: kept the state after step %d for joining group(s) %s",
                     self.stage.job_id, self.stage.key.stage, step, list(self.donate))
            self.donate = ()


ElasticFactory = Callable[[Stage], ElasticHooks]
"""Makes a stage's :class:`ElasticHooks` (a node that reaches a tracker has one)."""


def build_stage(request: node_pb2.LoadStageRequest, device: torch.device, mailbox: Mailbox,
                peers: StagePeers, elastic: ElasticFactory | None = None,
                unpickled: Callable[[], None] | None = None) -> Stage:
    """Wire a stage from its request: layers, optimizer, loss, replica sync, runner.

    The config is validated before anything is unpickled. ``elastic``: how a stage
    of an elastic job (``min_replicas`` > 0) reaches the tracker's quorum; without
    it such a stage syncs as a plain all-reduce. ``unpickled``: called once its layers'
    code is in and before their weights are made (:func:`~.initial.make_layers`).

    Raises:
        StageLoadError: the config or plan is invalid, or unpickling the layers,
            loss or optimizer, or building them, failed (the message names why).
    """
    try:
        return _build(request, device, mailbox, peers, elastic, unpickled)
    except BaseException as e:  # noqa: BLE001 — user code (even sys.exit) is the caller's error
        raise StageLoadError(f"cannot load stage {request.stage}: {type(e).__name__}: {e}") \
            from e


def _tie_and_clip(cfg: JobSpec, key: StageKey, n_stages: int, by_index: dict[int, nn.Module],
                  params: list[nn.Parameter], spans: list[StageSpan], transport: TimedTransport
                  ) -> list[StepHook]:
    """The before-update hooks after the replica sync: each tied copy's gradient becomes
    the sum of all copies' (:mod:`fedpipe.runtime.ties`), then the clip to the global
    norm, in which every stage of the group takes part and a tie counts once."""
    hooks: list[StepHook] = []
    ties = cfg.weights.ties
    if ties:
        hooks.append(TiedGradients(by_index, key, ties, spans, transport))
    if cfg.clip_grad_norm:
        counted = [p for p in norm_parameters(by_index, ties) if p.requires_grad] \
            if ties else params
        hooks.append(GlobalNormClip(counted, cfg.clip_grad_norm, key.stage,
                                    {s: StageKey(key.replica, s) for s in range(n_stages)
                                     if s != key.stage}, transport))
    return hooks


def _build(request: node_pb2.LoadStageRequest, device: torch.device, mailbox: Mailbox,
           peers: StagePeers, elastic: ElasticFactory | None,
           unpickled: Callable[[], None] | None = None) -> Stage:
    cfg = JobSpec.from_proto(request.config).validate()  # before unpickling anything
    plan = PlanView(request.plan, cfg.microbatches)
    key = StageKey(request.replica, request.stage)
    mine = plan.get(key)
    if mine is None:
        raise ValueError(f"the plan has no stage {key.stage} in replica group {key.replica}")
    n_stages = plan.depth(key.replica)
    libraries.check(cfg.libraries, request.job_id)  # before the layers are unpickled
    layers, pending = make_layers(request, cfg.weights, mine.layer_start, device, unpickled)
    module = nn.Sequential(*layers)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = cloudpickle.loads(cfg.optimizer).build(params) if params else None
    last = key.stage == n_stages - 1
    loss_fn = cloudpickle.loads(cfg.loss_fn) if last else None
    if not 0 <= request.resume_step < cfg.steps:
        raise ValueError(f"resume_step must be in [0, {cfg.steps}), got {request.resume_step}")
    stage = Stage(StageSlot(request.job_id, *key), n_stages, mine.layer_start, module,
                  cfg.steps, peers, epoch=request.plan.epoch, start=request.resume_step,
                  checkpoint_every=cfg.checkpoint_every, plan=plan, pending=pending,
                  subspace=lowrank.Subspace() if uses_lowrank(plan) else None)
    hooks = elastic(stage) if len(plan.replicas) > 1 and cfg.elastic and elastic else None
    # one timed transport for the runner and the syncs, so their waiting counts too
    transport = TimedTransport(StageTransport(stage, mailbox, device,
                                              hooks.peer_failed if hooks else None))
    before: list[StepHook] = []
    after: list[StepHook] = []
    spans = [StageSpan(k, a.layer_start, a.layer_end) for k, a in plan.stages.items()]
    outer: OuterSync | None = None
    schedule = None
    shares = [plan.share(g) for g in range(len(plan.replicas))]

    def samples() -> tuple[int, int]:
        return stage.runner.step_samples if stage.runner is not None else (0, 1)

    if cfg.replica_sync == "diloco":  # "auto" is resolved by the tracker; else all-reduce
        outer = OuterSync(module, key, spans, cfg.diloco, shares, transport,
                          last_step=cfg.steps - 1) if hooks is None else \
            ElasticOuterSync(module, key, spans, cfg.diloco, shares, transport, hooks.ask,
                             samples, hooks.peer_failed, last_step=cfg.steps - 1)
        before.append(outer.rescale_gradients)
        after.append(outer)
        if hooks is not None:
            after.append(hooks.after_update)
    elif hooks is not None:
        ask: AskQuorum = hooks.ask
        before.append(ElasticGradientSync(module, key, spans, transport, ask, samples,
                                          hooks.peer_failed))
        after.append(hooks.after_update)
    elif len(plan.replicas) > 1:
        before.append(GradientSync(module, key, spans, transport))
    by_index = {mine.layer_start + k: layer for k, layer in enumerate(module)}
    before += _tie_and_clip(cfg, key, n_stages, by_index, params, spans, transport)
    if opt is not None and cfg.lr_scheduler:  # stepped after each optimizer step, first
        schedule = cloudpickle.loads(cfg.lr_scheduler).build(opt)
        after.insert(0, lambda step: schedule.step())
    if pending is not None and outer is not None:  # its outer weights: the streamed ones
        pending.loaded.append(outer.anchor)
    stage.parts = {LAYOUT: layerstate.Layout(module, mine.layer_start), "module": module,
                   "optimizer": opt, "lr_scheduler": schedule, "outer": outer,
                   "codec": stage.subspace,
                   FEEDBACK: GradientFeedbackPart(peers.feedback, peers.settle,
                                                  mine.layer_start, key.replica, key.stage - 1)}
    recompute = stage_recomputes(cfg.recompute, mine.recompute)
    common = dict(before_update=before, after_update=after)
    seeds = LayerSeeds(module, mine.layer_start, cfg.weights.seed, key.replica)
    microbatches = plan.microbatches(key.replica)
    if cfg.schedule == "async":
        stage.runner = AsyncStageRunner(module, opt, loss_fn, key.stage, n_stages, microbatches,
                                        transport, max_staleness=cfg.max_staleness, **common,
                                        recompute=recompute, precision=cfg.precision, seeds=seeds)
    else:
        stage.runner = SyncStageRunner(module, opt, loss_fn, cfg.schedule, key.stage, n_stages,
                                       microbatches, transport, **common,
                                       recompute=recompute, precision=cfg.precision, seeds=seeds)
    # behind NAT: dial the plan's other nodes now
    peers.connect(mine, plan.stages.values(), request.job_id)
    return stage


