"""Replica groups as the unit of failure: which groups take part in each step's sync.

With two or more replica groups and ``min_replicas`` > 0, a lost node drops
only its group; the others go on without rewinding, and a rebuilt group joins
again later. What every surviving stage must agree on is the *membership* of
each sync: which groups' gradients a step's all-reduce sums (or whose
pseudo-gradients an outer step averages). Two survivors that summed over
different sets would part ways for good; a survivor that waited for a dead
group would wait for ever.

The tracker decides it, as torchft's lighthouse decides its quorum and its
``Manager.should_commit`` lets every replica commit a step only when all did
(torchft, ``torchft/manager.py``; no code taken). :class:`ReplicaSet` holds,
for one plan epoch of one job:

- the *replica epoch* ``version``: it grows by one at every membership change
  (a group dropped, a group scheduled to join);
- the live groups, each with the step from which it takes part (0, or its join
  step);
- for each step not yet committed, the stages that said they reduced it under
  the current version.

A stage syncs step ``s`` (:meth:`ReplicaSet.ask`): it sums over
``members(s)`` of the version it knows, then reports ``reduced``. Step ``s``
*commits* under version ``v`` when every stage of every member group reported
it under ``v`` while ``v`` was current; from then on every ask of ``s``
answers "committed, with ``v``'s members", so every stage applies the same
sum. A commit's answer also names the members of the stage's next sync step
under ``v`` (when ``v`` is still current), so the stage's next sync starts
without asking. A membership change before the commit makes every ask of ``s`` under an
older version answer "retry with the new members": the stages sum again over
the new set (their own gradients are untouched until the commit). So a step
commits under exactly one membership, and a dead group is waited for only
until the tracker drops it.

Loss scaling. A group's stage losses are scaled by its share of the step's
*global* batch (``n_g / B``), so a sum over a subset of the groups would be
too small. The sync therefore also sums the members' sample counts and
multiplies the summed gradient by ``B / Σ_members n_g``: the gradient of the
mean loss over the survivors' samples (:mod:`fedpipe.runtime.elastic`). The
client re-shards each later batch over the live groups, so then
``Σ n_g = B`` and the factor is exactly 1.

This module is pure (no I/O, no torch): ``tests/test_replicas.py`` drives it
with threads and a fake clock; :mod:`.replica_groups` keeps one per elastic job.

A tracker that takes over from another (:mod:`.leader`) must answer as the old
one did: a step committed there is committed here, a dropped group stays
dropped. So every change of the membership or of the committed steps is handed,
as a :meth:`ReplicaSet.snapshot`, to the set's ``on_change`` (which stores it)
before any stage hears of it, and :meth:`ReplicaSet.restore` rebuilds the set
from the last one. The acknowledgements of a step not yet committed are not
kept: the stages that reduced it report again when their ask fails.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from ..spec import Quorum, StageKey

COMMITTED_KEPT = 256
"""Committed steps whose decision is kept for late askers (older ones are forgotten:
every stage of a step asks within a step or two of the others)."""


class ReplicaError(ValueError):
    """A membership change that cannot be made (the message says why)."""


@dataclass
class _Group:
    stages: frozenset[StageKey]
    since: int = 0               # the first step the group takes part in
    donor: int | None = None     # where a joining group takes its state from


@dataclass
class _Decision:
    version: int
    members: tuple[int, ...]


@dataclass
class ReplicaSet:
    """The membership of one job's replica groups in one plan epoch (module docstring).

    Args:
        groups: each replica group's stages, by group.
        min_replicas: the fewest live groups with which the job goes on (>= 1).
        on_change: called with :meth:`snapshot` after every change of the membership or
            of the committed steps, under the set's lock, before any stage is answered
            with it (the tracker stores it; if it raises, the change is not made and
            the caller gets that error).

    Raises:
        ReplicaError: fewer groups than ``min_replicas``, or ``min_replicas`` < 1.
    """

    groups: dict[int, frozenset[StageKey]]
    min_replicas: int
    on_change: Callable[[dict[str, Any]], None] = lambda snapshot: None
    version: int = 0
    _live: dict[int, _Group] = field(default_factory=dict)
    _reduced: dict[int, set[StageKey]] = field(default_factory=dict)
    _committed: dict[int, _Decision] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self):
        if self.min_replicas < 1:
            raise ReplicaError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if len(self.groups) < self.min_replicas:
            raise ReplicaError(f"{len(self.groups)} replica group(s) are fewer than "
                               f"min_replicas {self.min_replicas}")
        self._live = {g: _Group(frozenset(stages)) for g, stages in self.groups.items()}

    # -- questions -----------------------------------------------------------
    @property
    def live(self) -> tuple[int, ...]:
        """The live groups (taking part now or from their join step), in order."""
        with self._cond:
            return tuple(sorted(self._live))

    def members(self, step: int) -> tuple[int, ...]:
        """The groups that take part in ``step`` under the current version."""
        with self._cond:
            return self._members(step)

    def _members(self, step: int) -> tuple[int, ...]:
        return tuple(sorted(g for g, info in self._live.items() if info.since <= step))

    def since(self, group: int) -> int:
        """The first step live group ``group`` takes part in.

        Raises:
            KeyError: the group is not live.
        """
        with self._cond:
            return self._live[group].since

    def enough(self, lost: Iterable[int]) -> bool:
        """Whether the job can go on without rewinding if groups ``lost`` drop out."""
        with self._cond:
            return len(set(self._live) - set(lost)) >= self.min_replicas

    def dropped(self) -> tuple[int, ...]:
        """The groups of the plan that are not live (dropped and not rebuilt yet)."""
        with self._cond:
            return tuple(sorted(set(self.groups) - set(self._live)))

    # -- changes -------------------------------------------------------------
    def drop(self, lost: Iterable[int]) -> int:
        """Drop groups ``lost`` (a node of each is gone); return the new version.

        Steps not yet committed are summed again over the survivors. A group
        that was to join, or to donate to a joining group, is dealt with too:
        a joining group whose donor is lost is dropped with it.

        Raises:
            ReplicaError: fewer than ``min_replicas`` groups would be left (the
                caller rewinds the job instead), or no group given is live.
        """
        with self._cond:
            gone = set(lost) & set(self._live)
            if not gone:
                raise ReplicaError(f"none of the groups {sorted(set(lost))} is live")
            gone |= {g for g, info in self._live.items() if info.donor in gone
                     and info.since > 0 and g not in gone}
            left = set(self._live) - gone
            if len(left) < self.min_replicas:
                raise ReplicaError(f"{len(left)} replica group(s) would be left, fewer than "
                                   f"min_replicas {self.min_replicas}")
            return self._bump({g: info for g, info in self._live.items() if g not in gone})

    def join(self, group: int, at_step: int, donor: int, committed_floor: int) -> int:
        """Schedule dropped ``group`` to take part from ``at_step`` on, with the state of
        ``donor`` after step ``at_step - 1``; return the new version.

        Args:
            committed_floor: the step the caller knows every stage has reached;
                ``at_step - 1`` must not be committed yet, so the donor still
                learns (in the commit of that step) that it must keep its state.

        Raises:
            ReplicaError: ``group`` is live or not of the plan, ``donor`` is not a
                member before ``at_step``, or ``at_step - 1`` is already committed.
        """
        with self._cond:
            if group not in self.groups or group in self._live:
                what = "live" if group in self._live else "not of the plan"
                raise ReplicaError(f"replica group {group} is {what}; it cannot join")
            donor_info = self._live.get(donor)
            if donor_info is None or donor_info.since >= at_step:
                raise ReplicaError(f"replica group {donor} cannot give its state at step "
                                   f"{at_step}: it is not a member before then")
            done = max([committed_floor, *self._committed], default=committed_floor)
            if at_step - 1 <= done:
                raise ReplicaError(f"step {at_step - 1} may be committed already (step "
                                   f"{done} is); join at step {done + 2} or later")
            return self._bump({**self._live, group: _Group(self.groups[group], since=at_step,
                                                           donor=donor)})

    def _bump(self, live: dict[int, _Group]) -> int:
        """Make ``live`` the membership under the next version (kept by ``on_change``
        first: if it raises, nothing changes)."""
        before = self._live, self.version
        self._live, self.version = live, self.version + 1
        try:
            self.on_change(self._snapshot())
        except BaseException:
            self._live, self.version = before
            raise
        self._reduced.clear()
        self._cond.notify_all()
        return self.version

    # -- kept across a takeover ------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What a tracker taking over needs to answer as this set does (JSON-able):
        the version, the live groups with their join step and donor, the remembered
        committed steps with their version and members."""
        with self._cond:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        return {"version": self.version,
                "live": {str(g): [info.since, info.donor] for g, info in self._live.items()},
                "committed": {str(s): [d.version, list(d.members)]
                              for s, d in self._committed.items()}}

    @classmethod
    def restore(cls, groups: dict[int, frozenset[StageKey]], min_replicas: int,
                snapshot: dict[str, Any],
                on_change: Callable[[dict[str, Any]], None] = lambda snapshot: None
                ) -> "ReplicaSet":
        """The set a :meth:`snapshot` of it describes, over the plan's ``groups``.

        Raises:
            ReplicaError: see the constructor; or the snapshot names a group not in
                ``groups``.
        """
        rs = cls(groups, min_replicas, on_change)
        live = {int(g): (int(since), donor) for g, (since, donor) in snapshot["live"].items()}
        if not set(live) <= set(groups):
            raise ReplicaError(f"the stored membership names groups {sorted(live)} but the "
                               f"plan has {sorted(groups)}")
        rs.version = int(snapshot["version"])
        rs._live = {g: _Group(groups[g], since, donor) for g, (since, donor) in live.items()}
        rs._committed = {int(s): _Decision(int(v), tuple(members))
                         for s, (v, members) in snapshot["committed"].items()}
        return rs

    # -- a stage's sync ------------------------------------------------------
    def ask(self, key: StageKey, step: int, version: int, reduced: bool,
            wait: float = 0.0, next_step: int = 0) -> Quorum:
        """Stage ``key`` about its sync of ``step`` under ``version``.

        Args:
            reduced: the stage summed ``step`` over ``version``'s members and
                waits for the commit.
            wait: with ``reduced``, block up to this many seconds for the
                step to commit or the membership to change.
            next_step: the step the stage syncs next (0: none): a committed
                answer names its members (``Quorum.next_members``) when the
                membership has not changed since the commit, so the stage's
                next sync needs one round trip (its commit), not two.

        Returns:
            The :class:`Quorum`: committed (apply), retry with other members,
            or dropped (stop).
        """
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                answer = self._answer(key, step, version, reduced)
                left = deadline - time.monotonic()
                if answer.committed or answer.dropped or answer.version != version \
                        or not reduced or left <= 0:
                    return self._with_next(answer, key, next_step)
                self._cond.wait(left)
                reduced = False  # counted once; later rounds only look

    def _with_next(self, answer: Quorum, key: StageKey, next_step: int) -> Quorum:
        """``answer`` with the members of ``next_step`` under the current version, if it
        is a commit under that version (a later version's members may need a new plan,
        which an ask brings) and ``key``'s group takes part in ``next_step``."""
        if not answer.committed or next_step <= answer.step or answer.version != self.version:
            return answer
        members = self._members(next_step)
        if key.replica not in members:
            return answer
        return replace(answer, next_members=members)

    def _answer(self, key: StageKey, step: int, version: int, reduced: bool) -> Quorum:
        done = self._committed.get(step)
        if done is not None and key.replica in done.members:
            return Quorum(step, done.version, done.members, committed=True,
                          donate_to=self._donees(key, step))
        if done is not None or key.replica not in self._live \
                or self._live[key.replica].since > step:
            return Quorum(step, self.version, self._members(step), dropped=True)
        members = self._members(step)
        if version == self.version and reduced:
            acks = self._reduced.setdefault(step, set())
            acks.add(key)
            if all(self._live[g].stages <= acks for g in members):
                self._committed[step] = _Decision(self.version, members)
                try:  # kept first: a step is committed only once a takeover would know it
                    self.on_change(self._snapshot())
                except BaseException:
                    del self._committed[step]
                    acks.discard(key)
                    raise
                del self._reduced[step]
                for old in sorted(self._committed)[:-COMMITTED_KEPT]:
                    del self._committed[old]
                self._cond.notify_all()
                return Quorum(step, self.version, members, committed=True,
                              donate_to=self._donees(key, step))
        return Quorum(step, self.version, members)

    def _donees(self, key: StageKey, step: int) -> tuple[int, ...]:
        return tuple(sorted(g for g, info in self._live.items()
                            if info.donor == key.replica and info.since == step + 1))

    def committed(self, step: int) -> bool:
        """Whether ``step`` is committed (and still remembered)."""
        with self._cond:
            return step in self._committed

    def last_committed(self) -> int:
        """The newest committed step, or -1."""
        with self._cond:
            return max(self._committed, default=-1)
