"""DiLoCo outer steps across replica groups, with late replicas weighted by staleness.

Replica groups train on their own shards for H inner steps, then each stage
takes an *outer step*: its pseudo-gradient (weights at the last outer step
minus weights now) is averaged with those of the other groups' holders of the
same layers and applied to the last outer step's weights by SGD with Nesterov
momentum. Source: Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models" (2023), Algorithm 1.

Layers are cut into segments of constant holders (:func:`~fedpipe.runtime.
allreduce.segments`), so groups that split the layers differently work. Each
holder sends its pseudo-gradient of a segment to every other holder
(all-to-all), so a holder that waits for nobody still gets everyone's.

**Averaging.** Group ``g`` runs ``B_g`` of the ``B`` samples of each step
and its stage losses are scaled by ``n / B`` (share of the *global* batch,
:class:`~fedpipe.runtime.stage.StageRunnerBase`), so its gradient is the partial
sum ``G_g = (B_g / B) · ∇L_g`` (``∇L_g``: gradient of the mean loss over
its shard). In DiLoCo every replica trains as a model of its own, so
:meth:`OuterSync.rescale_gradients` (a runner's ``before_update`` hook) multiplies
the gradients by ``1 / w_g``, ``w_g = B_g / B`` (the plan's shares), before
each inner optimizer step: the inner step is that of the shard's mean loss,
for any inner optimizer. The outer gradient is the share-weighted mean
``Δ = Σ_g w_g Δ_g``. With H = 1, inner SGD (lr η), outer lr 1 and no
momentum this is ``Σ_g w_g η G_g / w_g = η Σ_g G_g``: exactly synchronous
data parallelism on the full batch (also with inner momentum, by linearity).

**Late replicas.** At outer step ``k`` a holder waits for the other holders'
step-``k`` pseudo-gradients until ``grace = max(grace_floor, grace_fraction ·
T_H)`` seconds have passed (``T_H``: its own wall time of the last H inner
steps), then goes on with those that came (set ``A_k``, itself included);
a holder that still owes an earlier step is waited for within the same
grace: first for that step's pseudo-gradient (which may be on its way over
a slow link: a holder late once is not always behind, and if it were taken
for behind from then on, as it was until December 2026, one hiccup left
every later exchange with it one step late), and if that came, for step
``k``'s; a holder whose earlier one is still not in by then is behind and is
not waited for further (a step-``k`` message already in is still used).
A pseudo-gradient of step ``j < k`` that arrived since is applied at step
``k`` with the staleness weight ``s(k - j) = 1 / (1 + k - j)``::

    Δ_k = (Σ_{h ∈ A_k} w_h Δ_h^k + Σ_{late (h, j)} s(k - j) · w_h Δ_h^j) / Σ_{h ∈ A_k} w_h

So on-time contributions are averaged over who came, and a late one is added
with its share, discounted by its staleness: the rule of staleness-aware
asynchronous SGD (Zhang, Gupta, Lian & Liu, "Staleness-aware Async-SGD for
Distributed Deep Learning", IJCAI 2016: learning rate divided by the
staleness) and FedAsync's polynomial ``s(τ) = (1 + τ)^-a`` with ``a = 1``
(Xie, Koyejo & Gupta, "Asynchronous Federated Optimization", 2019). As in
Delayed Nesterov (Liu et al., "Asynchronous Local-SGD Training for Language
Modeling", 2024), late pseudo-gradients do not get momentum steps of their
own: they join the next outer step, so the Nesterov momentum is updated
once per outer step however many arrive. Every contribution is applied
exactly once by every holder. The job's last step is always an outer step,
and it waits for every pseudo-gradient still owed, so no group's last work
is lost. When everyone is on time this is synchronous DiLoCo and every group
ends each outer step with bit-identical weights (same inputs, summed in
holder order; lossy codecs: everyone uses the decoded message, see below).
With late replicas, groups' weights differ by what each has not yet applied.

**Compression.** Pseudo-gradients travel encoded with a wire codec
(:mod:`fedpipe.wire.codecs`) with error feedback per segment (what the codec
drops is sent at the next outer step). A holder uses for itself exactly what
its peers decode from its message, so lossy codecs keep the groups consistent.

**SparseLoCo** (:meth:`fedpipe.spec.DiLoCo.sparseloco`) is this with the
``sparseloco`` codec (top 1.56 % of each 4096-chunk, 2-bit values), the error
feedback decayed by β (``e ← β·e + Δ``, send ``C(e)``, keep ``e - C(e)``) and
no outer momentum: the decayed residual stands in for it (Sarfi et al.,
"Communication Efficient LLM Pre-training with SparseLoCo", 2025). The residuals
are part of :meth:`OuterSync.state_dict`, so a job resumed from a checkpoint
sends what the uninterrupted one would have sent.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from ..spec import DiLoCo, Kind, StageKey, parse_codec
from ..wire import codecs
from .allreduce import StageSpan, held_segments
from .stage import Transport

log = logging.getLogger("fedpipe.diloco")


def staleness_weight(staleness: int) -> float:
    """Weight of a pseudo-gradient applied ``staleness`` outer steps late: 1 / (1 + staleness)."""
    return 1.0 / (1 + staleness)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in like]), like)]


class OuterTimes:
    """Where a stage's outer steps spent their time (wall clock, seconds, summed over
    its outer steps), logged at the job's last step (:meth:`line`; ``benchmarks/async.py``
    reads it from the node logs).

    Attributes:
        steps: outer steps taken.
        inner: inner steps (from the first one's end to the last one's), without
            the outer steps between them.
        send: pseudo-gradients made (the codec and its error feedback) and handed
            to the transport.
        wait: waiting for the other holders' pseudo-gradients (and, in an elastic
            job, for the tracker's commit).
        apply: the outer optimizer's step and the copy into the stage's weights.
        asks: the tracker's round trips (elastic jobs: members and commits; 0 else).
    """

    def __init__(self) -> None:
        self.steps = self.asks = 0
        self.inner = self.send = self.wait = self.apply = 0.0

    def line(self) -> str:
        """One log line: the totals and the means per outer step (ms)."""
        n = max(self.steps, 1)
        return (f"{self.steps} outer steps in {self.send + self.wait + self.apply:.2f} s, "
                f"inner steps {self.inner:.2f} s; per outer step: send {self.send / n * 1e3:.1f} "
                f"ms, wait {self.wait / n * 1e3:.1f} ms, apply {self.apply / n * 1e3:.1f} ms, "
                f"tracker asks {self.asks / n:.2f}")


class Owed(NamedTuple):
    """A peer's pseudo-gradient not yet applied: of segment ``self.mine[held]``,
    from the holder of rank ``rank``, for outer step ``outer_step``."""

    held: int  # not ``index``: that would hide tuple.index
    rank: int
    outer_step: int


class OuterSync:
    """DiLoCo outer steps of one stage (see the module docstring for the rules).

    Use :meth:`rescale_gradients` as a runner's ``before_update`` hook and the
    object itself as its ``after_update`` hook.

    Args:
        module: the stage's layers (an ``nn.Sequential``).
        me: this stage's place in the plan.
        stages: every stage of the plan with its layers.
        config: H, outer lr and momentum, and the codec of the pseudo-gradients.
        shares: share of the batch of each replica group, indexed by replica
            (any positive numbers; normalised), e.g. the plan's samples per group.
        transport: how pseudo-gradients travel, as :data:`~fedpipe.spec.Kind.OUTER`
            messages of step ``outer_step``: ``send_to`` every other holder,
            ``recv`` with a timeout (raising TimeoutError when none came).
        last_step: the job's last inner step (0-based): always an outer step,
            which waits for every pseudo-gradient owed. None: no such step.
        grace_fraction: how long to wait for late peers, as a fraction of the
            wall time of the last H inner steps.
        grace_floor: the least wait for late peers, seconds. 2 s: on a machine
            shared at load 10-25 a group's outer step came over 1 s after its
            peer's now and then (``benchmarks/async.py``, text, December 2026:
            with 1 s, 9 late pseudo-gradients in two 1,000-step runs and 3 in
            one of 400, each applied at half weight while the early group's
            outer step averaged its own shard alone; with 2 s, none in two);
            in a job whose groups run every step, waiting for the group behind
            does not delay the job, whose pace is that group's.

    Attributes:
        missed: pseudo-gradients of peers that were not in within the grace period.
        late_applied: of those, how many were applied late (the rest are still owed).

    Raises:
        ValueError: a bad plan (as :func:`~fedpipe.runtime.allreduce.segments`),
            a share that is not positive, or a bad grace.
        fedpipe.spec.SpecError: a bad codec spec.
    """

    def __init__(self, module: nn.Module, me: StageKey, stages: Sequence[StageSpan],
                 config: DiLoCo, shares: Sequence[float], transport: Transport, *,
                 last_step: int | None = None, grace_fraction: float = 0.25,
                 grace_floor: float = 2.0):
        if any(s <= 0 for s in shares):
            raise ValueError(f"replica shares must be positive, got {list(shares)}")
        if grace_fraction < 0 or grace_floor < 0:
            raise ValueError(f"grace_fraction and grace_floor must be >= 0, got "
                             f"{grace_fraction}, {grace_floor}")
        self.module, self.config, self.transport = module, config, transport
        self.me_name = f"{me.replica}/{me.stage}"
        self.codec = "raw" if config.compression in ("", "none") else config.compression
        parse_codec(self.codec)  # SpecError names what is wrong
        total = float(sum(shares))
        self.weights = [s / total for s in shares]
        self.scale = total / shares[me.replica]
        self.mine = held_segments(module, me, stages)
        self.globals = [[p.detach().clone() for p in params] for _, _, params in self.mine]
        momentum = config.outer_momentum
        self.optimizer = torch.optim.SGD(
            [t for ts in self.globals for t in ts], lr=config.outer_lr, momentum=momentum,
            nesterov=momentum > 0) if self.mine else None  # None: no parameters, nothing to do
        self.feedback = codecs.ErrorFeedback(config.feedback_decay)
        self.last_step = last_step
        self.grace_fraction, self.grace_floor = grace_fraction, grace_floor
        self.outer_step = 0  # index of the next outer step, the same in every group
        self.owed: list[Owed] = []
        self.mark: float | None = None  # end of the last outer step (or of the first inner step)
        self.late_applied = 0
        self.missed = 0
        self.times = OuterTimes()

    def anchor(self) -> None:
        """Take the module's weights now as the outer (global) weights: a stage whose
        initial weights arrived after it was built (streamed by the client,
        :mod:`fedpipe.node.initial`) calls it before its first step."""
        with torch.no_grad():
            for globals_, (_, _, params) in zip(self.globals, self.mine):
                for g, p in zip(globals_, params):
                    g.copy_(p.detach())

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the outer (global) weights, the outer optimizer's
        momentum, the index of the next outer step and the codec's error-feedback
        residuals. Pseudo-gradients still owed by late peers are not kept: a
        resumed job starts a new plan epoch, whose messages those are not."""
        return {"globals": self.globals, "outer_step": self.outer_step,
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "residuals": {i: self.feedback.residual(i) for i in range(len(self.mine))
                              if self.feedback.residual(i) is not None}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (a snapshot of the same stage).

        Raises:
            ValueError: the snapshot holds other segments than this stage.
        """
        saved = state["globals"]
        if [len(g) for g in saved] != [len(g) for g in self.globals]:
            raise ValueError("the snapshot's DiLoCo state is of another stage's segments")
        with torch.no_grad():
            for mine, theirs in zip(self.globals, saved):
                for g, s in zip(mine, theirs):
                    g.copy_(s)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = int(state["outer_step"])
        self.feedback.reset()
        for i, residual in state["residuals"].items():
            self.feedback.remember(int(i), residual.clone())
        self.owed = []

    def rescale_gradients(self, step: int) -> None:
        """``before_update`` hook: scale this group's gradients by ``1 / w_g`` so the
        inner step is that of its own shard's mean loss (see the module docstring)."""
        if self.scale != 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.scale)

    def __call__(self, step: int) -> None:
        """``after_update`` hook: take an outer step after every H-th inner step and the last.

        Raises:
            fedpipe.node.mailbox.Stopped: the stage was stopped while waiting
                (whatever the transport's ``recv`` raises).
        """
        now = time.monotonic()
        if self.mark is None:
            self.mark = now
        final = step == self.last_step
        if self.optimizer is None or (step + 1) % self.config.inner_steps and not final:
            return
        grace = max(self.grace_floor, self.grace_fraction * (now - self.mark))
        self.times.inner += now - self.mark
        self._outer(self.outer_step, None if final else now + grace)
        self.outer_step += 1
        self.times.steps += 1
        self.mark = time.monotonic()
        if final:
            log.info("outer steps of stage %s: %s", self.me_name, self.times.line())

    def _tag(self, index: int, rank: int) -> int:
        seg = self.mine[index].segment
        return seg.index * len(seg.holders) + rank

    def _take(self, outer_step: int, tag: int, deadline: float | None) -> torch.Tensor | None:
        """The message ``(outer_step, tag)``, or None if it is not in by ``deadline``
        (a ``time.monotonic()`` time; None: wait for it however long it takes)."""
        start = time.monotonic()
        timeout = None if deadline is None else max(0.0, deadline - start)
        try:
            return self.transport.recv(Kind.OUTER, outer_step, tag, timeout)[0]
        except TimeoutError:
            return None
        finally:
            self.times.wait += time.monotonic() - start

    def _encode(self, index: int, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tensor to send, what every receiver will decode from it)."""
        if self.codec == "raw":
            return delta, delta
        sent = codecs.decode(codecs.encode(delta, self.codec, feedback=self.feedback, key=index))
        seen = codecs.decode(codecs.encode(sent, self.codec))  # the peers' view, bit for bit
        return sent.to(delta.device), seen.to(delta.device)

    def _outer(self, k: int, deadline: float | None) -> None:
        """Outer step ``k``: exchange pseudo-gradients, average, apply (module docstring)."""
        start = time.monotonic()
        own = []
        for i, (seg, rank, params) in enumerate(self.mine):
            with torch.no_grad():
                delta = _flat(self.globals[i]) - _flat(params)
            sent, seen = self._encode(i, delta)
            for r, h in enumerate(seg.holders):
                if r != rank:
                    self.transport.send_to(h, Kind.OUTER, k, self._tag(i, rank), sent,
                                           codec=self.codec)
            own.append(seen)
        self.times.send += time.monotonic() - start
        means = [self._average(i, k, own[i], deadline) for i in range(len(self.globals))]
        self._apply(means)

    def _apply(self, means: Sequence[torch.Tensor]) -> None:
        """The outer optimizer's step with gradients ``means`` (one flat tensor per held
        segment), then the outer weights copied into the stage's."""
        start = time.monotonic()
        for glob, mean in zip(self.globals, means):
            for g, piece in zip(glob, _unflat(mean, glob)):
                g.grad = piece
        assert self.optimizer is not None  # step() does not come here without parameters
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for (_, _, params), glob in zip(self.mine, self.globals):
                for p, g in zip(params, glob):
                    p.copy_(g)
        self.times.apply += time.monotonic() - start

    def _average(self, i: int, k: int, own: torch.Tensor, deadline: float | None) -> torch.Tensor:
        """The outer gradient ``Δ_k`` of segment ``self.mine[i]`` (module docstring);
        ``own`` is this holder's pseudo-gradient as its peers see it."""
        seg, rank, _ = self.mine[i]
        weight = [self.weights[h.replica] for h in seg.holders]
        late = []  # earlier steps' pseudo-gradients that came since: (rank, step, tensor)
        for entry in [e for e in self.owed if e.held == i]:
            r, j = entry.rank, entry.outer_step
            # wait for it within this step's grace too: it may be on its way over a slow
            # link from a peer that is not behind (then this step's comes right after it)
            got = self._take(j, self._tag(i, r), deadline)
            if got is not None:
                self.owed.remove(entry)
                late.append((r, j, got))
        behind = {e.rank for e in self.owed if e.held == i}  # still owe: do not wait for them
        parts = {}
        for r in range(len(seg.holders)):
            wait = -math.inf if r in behind and deadline is not None else deadline
            got = own if r == rank else self._take(k, self._tag(i, r), wait)
            if got is None:
                self.owed.append(Owed(i, r, k))
                self.missed += 1
                log.info("outer step %d: no pseudo-gradient from replica %d within the grace "
                         "period; applying it when it arrives", k, seg.holders[r].replica)
            else:
                parts[r] = got
        total = torch.zeros_like(own)
        for r in sorted(parts):  # holder order: the same sum in every group
            total.add_(parts[r].to(own), alpha=weight[r])
        for r, j, got in late:
            total.add_(got.to(own), alpha=staleness_weight(k - j) * weight[r])
            self.late_applied += 1
            log.info("outer step %d: applied replica %d's pseudo-gradient of outer step %d "
                     "(staleness %d, weight %.3g)", k, seg.holders[r].replica, j, k - j,
                     staleness_weight(k - j) * weight[r])
        return total.div_(sum(weight[r] for r in parts))
