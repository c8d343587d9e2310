"""Gradient all-reduce over the replica groups of each step's quorum (elastic jobs).

:class:`ElasticGradientSync` is :class:`~fedpipe.runtime.allreduce.GradientSync`
for a job whose replica groups may drop out and come back
(``JobSpec.min_replicas`` > 0). Before it changes a gradient it agrees with
the tracker on the step's members (a :class:`~fedpipe.spec.Quorum`; the rules
are in :mod:`fedpipe.tracker.replicas`):

1. sum the step's gradients by the ring all-reduce among the holders of the
   members' groups only (the segments are those of the members' layer splits);
   the message tags carry the quorum's version, so rings of two versions never
   mix; while it waits for a ring message it asks the tracker every
   :data:`~fedpipe.net.timeouts.QUORUM_POLL` seconds whether the membership
   changed, and if so starts again over the new members;
2. report the sum and wait for the step's commit; apply the sum only then
   (every stage of every member group applies the same one), or sum again
   when the membership changed first.

The commit's answer also names the members of the step the stage syncs next
(``Quorum.next_members``), so once running a synced step costs one round trip
to the tracker (its commit), not two (members, then commit).

Loss scaling. Each group scales its microbatch losses by ``n / B`` (share of
the step's global batch, :class:`~fedpipe.runtime.stage.StageRunnerBase`), so
the sum of the groups' gradients is the global batch's gradient only if every
sample was used. The ring also sums the members' sample counts ``N``, and the
gradient is multiplied by ``B / N``: the gradient of the mean loss over the
samples the members trained on. When no group was lost mid-step ``N = B`` and
nothing is multiplied, so an undisturbed elastic job trains exactly as a
plain all-reduce job.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Protocol, Sequence, TypeVar

import torch

from ..net import timeouts
from ..spec import DiLoCo, Kind, Quorum, StageKey
from .allreduce import Held, StageSpan, held_segments, ring_allreduce
from .diloco import OuterSync, _flat
from .stage import StageError, Transport

log = logging.getLogger("fedpipe.elastic")

VERSION_TAGS = 1 << 16
"""Message tags of one quorum version: ring tags are ``version * VERSION_TAGS + tag``."""
MAX_VERSION = (2**31 - 1) // VERSION_TAGS - 1
"""The highest quorum version whose tags fit the wire's int32 tag."""


class AskQuorum(Protocol):
    """How a stage asks the tracker about a step's sync (see
    :meth:`fedpipe.tracker.replicas.ReplicaSet.ask`)."""

    def __call__(self, step: int, version: int, reduced: bool, wait: float,
                 next_step: int = 0) -> Quorum:
        """The quorum of ``step``; ``reduced``: the stage summed it under ``version``;
        ``next_step``: the step it syncs next (0: none), whose members a commit names.

        Raises:
            StageError: the tracker cannot be reached.
        """


class GroupDropped(StageError):
    """The stage's replica group was dropped from the job (a node of it was lost)."""


def _peer_failed(handler: Callable[[str], None] | None, error: StageError) -> None:
    """A send to another group's stage failed: tell the node (which reports it to the
    tracker and goes on), or, without a handler or a peer, fail the stage."""
    if not error.peer or handler is None:
        raise error
    handler(error.peer)


class _Superseded(Exception):
    def __init__(self, quorum: Quorum):
        self.quorum = quorum


_T = TypeVar("_T")


class _Member(Protocol):
    me: StageKey
    quorum: Quorum | None
    ahead: Quorum | None
    retries: int

    def ask(self, step: int, version: int, reduced: bool, wait: float,
            next_step: int = 0) -> Quorum: ...


def _commit(sync: _Member, step: int, what: str, done: str,
            compute: Callable[[Quorum], _T], next_step: int = 0) -> tuple[_T, Quorum]:
    """Run ``compute`` over the members the tracker names for ``step`` until the tracker
    commits ``step`` under the members it ran over; returns its result and that quorum
    (also kept in ``sync.quorum``). ``compute`` raises :class:`_Superseded` when the
    members changed under it; it is then run again over the new ones.

    One round trip to the tracker per step once running: the commit of the step
    before named this step's members (``sync.ahead``, asked for with ``next_step``:
    the step synced after this one, 0: none), so the stage computes over them
    without asking first. They are the tracker's members of ``step`` under their
    version; if the membership changed since, the commit of ``step`` (or a poll
    while ``compute`` waits) answers with the new version and ``compute`` runs
    again, as when a change comes mid-step.

    Raises:
        GroupDropped: ``sync``'s group is no longer in the job.
        StageError: ``what`` (e.g. "step 7") was committed under another replica epoch
            than the one this stage ``done`` it under (e.g. "summed it").
    """
    version = sync.quorum.version if sync.quorum is not None else -1
    ahead, sync.ahead = sync.ahead, None
    q = ahead if ahead is not None and ahead.step == step else \
        sync.ask(step, version, False, 0.0)
    while True:
        if q.dropped:
            raise GroupDropped(f"replica group {sync.me.replica} was dropped from the job "
                               f"(replica epoch {q.version})")
        try:
            result = compute(q)
        except _Superseded as e:
            q, sync.retries = e.quorum, sync.retries + 1
            continue
        answer = q
        while not (answer.committed or answer.dropped) and answer.version == q.version:
            answer = sync.ask(step, q.version, True, timeouts.QUORUM_COMMIT_WAIT, next_step)
        if answer.committed and answer.version == q.version:
            sync.quorum = answer
            if next_step > step and answer.next_members:
                sync.ahead = Quorum(next_step, answer.version, answer.next_members)
            return result, q
        if answer.committed:
            raise StageError(f"{what} committed under replica epoch {answer.version} "
                             f"while this stage {done} under {q.version}")
        q, sync.retries = answer, sync.retries + 1


class ElasticGradientSync:
    """Sums a stage's gradients over the groups of the step's quorum (module docstring).

    Use it as a runner's ``before_update`` hook.

    Args:
        module: the stage's layers (an ``nn.Sequential``).
        me: this stage's place in the plan.
        stages: every stage of the plan with its layers (all groups, live or not).
        transport: how ring messages travel.
        ask: the tracker's quorum (:class:`AskQuorum`).
        samples: ``(n, B)`` of the step just run: samples this stage trained on and
            the global batch size.
        peer_failed: called with a ring peer's address when a send to it failed
            (the node reports it to the tracker, which drops its group if it is
            gone); the sync then goes on waiting for the step's membership to change.

    Attributes:
        quorum: the last committed quorum (None before the first).
        retries: steps summed again because the membership changed.

    Raises:
        ValueError: as :func:`~fedpipe.runtime.allreduce.held_segments`, or a
            parameter that is neither float32 nor float64 (the sample count
            rides in the gradient's dtype and must stay an exact integer).
    """

    def __init__(self, module: torch.nn.Module, me: StageKey, stages: Sequence[StageSpan],
                 transport: Transport, ask: AskQuorum, samples: Callable[[], tuple[int, int]],
                 peer_failed: Callable[[str], None] | None = None):
        bad = {p.dtype for p in module.parameters()} - {torch.float32, torch.float64}
        if bad:
            raise ValueError(f"elastic all-reduce needs float32 or float64 parameters, got "
                             f"{sorted(map(str, bad))}")
        self.module, self.me, self.stages = module, me, list(stages)
        self.transport, self.ask, self.samples = transport, ask, samples
        self.peer_failed = peer_failed
        self.quorum: Quorum | None = None
        self.ahead: Quorum | None = None  # the next step's members, named by the last commit
        self.retries = 0
        self._held: dict[tuple[int, ...], list[Held]] = {}

    def _mine(self, members: tuple[int, ...]) -> list[Held]:
        if members not in self._held:
            spans = [s for s in self.stages if s.key.replica in members]
            self._held[members] = held_segments(self.module, self.me, spans)
        return self._held[members]

    def __call__(self, step: int) -> None:
        """Agree on ``step``'s members, all-reduce among them, and set the gradients.

        Raises:
            GroupDropped: this stage's group is no longer in the job.
            StageError: a send failed, or the tracker answered out of turn.
        """
        n, batch = self.samples()

        def reduce(q: Quorum) -> list[tuple[torch.Tensor, float]]:
            if q.version > MAX_VERSION:
                raise StageError(f"replica epoch {q.version} is past {MAX_VERSION}: the ring "
                                 f"tags no longer fit")
            return self._reduce(step, q, n)

        sums, q = _commit(self, step, f"step {step}", "summed it", reduce, step + 1)
        for (_, _, params), (total, count) in zip(self._mine(q.members), sums):
            scale = None if count == batch else batch / count
            offset = 0
            for p in params:
                g = total[offset:offset + p.numel()].view_as(p).clone()
                p.grad = g.mul_(scale) if scale is not None else g
                offset += p.numel()

    def _reduce(self, step: int, q: Quorum, n: int) -> list[tuple[torch.Tensor, float]]:
        """The ring sums of every held segment over ``q.members``: ``(gradients, samples)``.

        Raises:
            _Superseded: the membership changed while a message was awaited.
        """
        out = []
        for seg, rank, params in self._mine(q.members):
            world = len(seg.holders)
            nxt = seg.holders[(rank + 1) % world]
            base = q.version * VERSION_TAGS + seg.index * 2 * world
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in params]
                             + [torch.tensor([float(n)], dtype=params[0].dtype,
                                             device=params[0].device)])
            def send(tag: int, t: torch.Tensor, nxt: StageKey = nxt, base: int = base) -> None:
                self._send(nxt, step, base + tag, t)

            def recv(tag: int, base: int = base) -> torch.Tensor:
                return self._recv(step, base + tag, q)

            total = ring_allreduce(flat, rank, world, send, recv)
            out.append((total[:-1], float(total[-1])))
        return out

    def _failed(self, error: StageError) -> None:
        _peer_failed(self.peer_failed, error)

    def _send(self, peer: StageKey, step: int, tag: int, tensor: torch.Tensor) -> None:
        try:
            self.transport.send_to(peer, Kind.REDUCE, step, tag, tensor)
        except StageError as e:  # an earlier send failed; this one is lost with it
            self._failed(e)

    def _recv(self, step: int, tag: int, q: Quorum) -> torch.Tensor:
        while True:
            try:
                return self.transport.recv(Kind.REDUCE, step, tag, timeouts.QUORUM_POLL)[0]
            except (TimeoutError, StageError) as e:
                if isinstance(e, StageError):
                    self._failed(e)
                now = self.ask(step, q.version, False, 0.0)
                if now.dropped or now.version != q.version:
                    raise _Superseded(now) from None


class ElasticOuterSync(OuterSync):
    """DiLoCo outer steps over the replica groups of each outer step's quorum.

    :class:`~fedpipe.runtime.diloco.OuterSync` for an elastic job: at the
    outer step after inner step ``s`` the stage agrees with the tracker on
    the members of ``s`` (as :class:`ElasticGradientSync` does), sends its
    pseudo-gradient of each segment to the members' holders only, waits for
    theirs (asking whether the membership changed every
    :data:`~fedpipe.net.timeouts.QUORUM_POLL` seconds) and, once the outer
    step is committed, applies the members' share-weighted mean, the weights
    renormalised over the members. A lost group is not waited for once the
    tracker dropped it, and the outer step is taken again over the others;
    there is no grace period and no late application (a group is in an outer
    step or out of it). The outer step's own pseudo-gradient is encoded once,
    so a retry does not disturb the codec's error feedback.

    The inner steps are rescaled by ``B / n`` (global batch over the samples
    the group trained on: the client re-shards the batch over the live groups,
    so a group's share changes when one drops) instead of the plan's share:
    each inner step is that of the mean loss over the samples the group had.
    So every sample of the global batch is still trained on (unlike DiLoCo
    with a data shard per replica, where a lost replica's shard is skipped),
    and with H = 1, inner SGD, outer lr 1 and no momentum a lone survivor's
    outer step is still the synchronous step on the whole batch.

    Two INFO log lines say what the outer steps were taken over (an exact
    single-process replay of a disturbed run needs nothing else, see
    ``tests/test_elastic_replicas.py``): an outer step averaged over fewer
    groups than the plan has, and a change of the samples the stage trains
    on per step.

    Args:
        module, me, stages, config, shares, transport, last_step: as
            :class:`~fedpipe.runtime.diloco.OuterSync`.
        ask, samples, peer_failed: as :class:`ElasticGradientSync`.

    Raises:
        ValueError, fedpipe.spec.SpecError: as :class:`~fedpipe.runtime.diloco.OuterSync`.
    """

    def __init__(self, module: torch.nn.Module, me: StageKey, stages: Sequence[StageSpan],
                 config: DiLoCo, shares: Sequence[float], transport: Transport,
                 ask: AskQuorum, samples: Callable[[], tuple[int, int]],
                 peer_failed: Callable[[str], None] | None = None, *,
                 last_step: int | None = None):
        super().__init__(module, me, stages, config, shares, transport, last_step=last_step)
        self.me, self.samples, self.peer_failed = me, samples, peer_failed
        self._ask = ask
        self.quorum: Quorum | None = None
        self.ahead: Quorum | None = None  # the next outer step's members, named by the last
        self.retries = 0
        self._inner = 0
        self._groups = len({s.key.replica for s in stages})
        self._samples: int | None = None  # the samples of the last inner step

    def ask(self, step: int, version: int, reduced: bool, wait: float,
            next_step: int = 0) -> Quorum:
        """The tracker's quorum (:class:`AskQuorum`), its round trips and waits counted
        in :attr:`times`."""
        start = time.monotonic()
        try:
            return self._ask(step, version, reduced, wait, next_step)
        finally:
            self.times.asks += 1
            self.times.wait += time.monotonic() - start

    def rescale_gradients(self, step: int) -> None:
        """``before_update`` hook: scale the gradients by ``B / n`` (class docstring)."""
        n, batch = self.samples()
        if self._samples is not None and n != self._samples:
            log.info("replica group %d stage %d: step %d trains on %d of the batch's %d "
                     "samples (was %d)", self.me.replica, self.me.stage, step, n, batch,
                     self._samples)
        self._samples = n
        if n and n != batch:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(batch / n)

    def __call__(self, step: int) -> None:
        """``after_update`` hook, as :meth:`OuterSync.__call__`.

        Raises:
            GroupDropped: this stage's group is no longer in the job.
            StageError: a send failed, or the tracker answered out of turn.
        """
        self._inner = step
        if self.optimizer is None:  # no parameters, but one of the stages a commit waits for
            if (step + 1) % self.config.inner_steps == 0 or step == self.last_step:
                self._agree(step, self.outer_step, [])
                self.outer_step += 1
            return
        super().__call__(step)

    def _outer(self, k: int, deadline: float | None) -> None:
        start = time.monotonic()
        own = []
        for i, (_, _, params) in enumerate(self.mine):
            with torch.no_grad():
                delta = _flat(self.globals[i]) - _flat(params)
            own.append(self._encode(i, delta))
        self.times.send += time.monotonic() - start
        self._apply(self._agree(self._inner, k, own))

    def _agree(self, step: int, k: int, own: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> list[torch.Tensor]:
        """Outer step ``k`` after inner step ``step``: the members' mean of each segment,
        once committed (``own``: this stage's ``(sent, seen)`` pseudo-gradients)."""
        means, q = _commit(
            self, step, f"outer step after step {step}", "averaged",
            lambda q: [self._mean(k, i, q, sent, seen) for i, (sent, seen) in enumerate(own)],
            self._next_outer(step))
        if len(q.members) < self._groups:
            log.info("replica group %d stage %d: outer step %d (after step %d) over replica "
                     "groups %s of %d", self.me.replica, self.me.stage, k, step,
                     list(q.members), self._groups)
        return means

    def _next_outer(self, step: int) -> int:
        """The inner step after which the outer step after ``step`` comes (0: none)."""
        nxt = step + self.config.inner_steps
        if self.last_step is not None:
            nxt = min(nxt, self.last_step)
        return nxt if nxt > step else 0

    def _mean(self, k: int, i: int, q: Quorum, sent: torch.Tensor,
              seen: torch.Tensor) -> torch.Tensor:
        """The members' weighted mean pseudo-gradient of segment ``self.mine[i]``."""
        seg, rank, _ = self.mine[i]
        base = q.version * VERSION_TAGS
        members = [(r, h) for r, h in enumerate(seg.holders) if h.replica in q.members]
        for r, h in members:
            if r != rank:
                try:
                    self.transport.send_to(h, Kind.OUTER, k, base + self._tag(i, rank), sent,
                                           codec=self.codec)
                except StageError as e:
                    self._failed(e)
        parts = {r: seen if r == rank else self._recv_outer(k, base + self._tag(i, r), q)
                 for r, _ in members}
        total = torch.zeros_like(seen)
        weight = {r: self.weights[h.replica] for r, h in members}
        for r in sorted(parts):  # holder order: the same sum in every group
            total.add_(parts[r].to(seen), alpha=weight[r])
        return total.div_(sum(weight.values()))

    def _failed(self, error: StageError) -> None:
        _peer_failed(self.peer_failed, error)

    def _recv_outer(self, k: int, tag: int, q: Quorum) -> torch.Tensor:
        while True:
            start = time.monotonic()
            try:
                return self.transport.recv(Kind.OUTER, k, tag, timeouts.QUORUM_POLL)[0]
            except (TimeoutError, StageError) as e:
                error = e
            finally:
                self.times.wait += time.monotonic() - start
            if isinstance(error, StageError):
                self._failed(error)
            now = self.ask(self._inner, q.version, False, 0.0)
            if now.dropped or now.version != q.version:
                raise _Superseded(now) from None
