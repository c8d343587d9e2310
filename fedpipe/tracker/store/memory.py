"""The tracker's state in dicts: fast, and gone when the process ends.

For tests, and for a tracker that need not survive a restart (``fedpipe tracker
--store memory:``). Keeps the same contract as the SQL stores (``tests/test_store.py``).
"""
from __future__ import annotations

import copy
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ...proto import node_pb2, tracker_pb2
from ...spec import TERMINAL
from . import base
from .base import RECOVERY_FIELDS, Lease, NodeRecord, Store, bare, new_id, recovery_only


@dataclass
class _Job:
    spec: tracker_pb2.SubmitJobRequest
    info: tracker_pb2.JobInfo
    layers: list[bytes]
    stages: dict[tuple[int, int], bool]
    order: int


class MemoryStore(Store):
    """The tracker's state in dicts: fast, and gone when the process ends."""

    where = "memory (nothing is kept when the tracker exits)"

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._nodes: dict[str, NodeRecord] = {}
        self._links: dict[tuple[str, str], node_pb2.LinkMeasurement] = {}
        self._jobs: dict[str, _Job] = {}
        self._events: list[tuple[str, tracker_pb2.JobEvent]] = []
        self._seq = itertools.count(1)
        self._order = itertools.count()
        self._lease = Lease("", "", 0, 0.0)
        self._replicas: dict[str, tuple[int, bytes]] = {}

    # -- nodes --------------------------------------------------------------
    def _update(self, node_id: str, fenced: bool | None = None, **info: Any) -> None:
        r = self._nodes[node_id]
        new = copy.deepcopy(r.info)
        for k, v in info.items():
            if k == "resources":
                new.resources.CopyFrom(v)
            else:
                setattr(new, k, v)
        self._nodes[node_id] = NodeRecord(new, r.boot_id, r.versions,
                                          r.fenced if fenced is None else fenced)

    def add_node(self, node_id: str, name: str, address: str, resources: node_pb2.Resources,
                 boot_id: str, versions: tracker_pb2.Versions, now: float,
                 data_address: str = "", relay: str = "") -> None:
        with self.lock:
            if node_id in self._nodes:
                raise KeyError(f"node {node_id} exists")
            self._nodes[node_id] = NodeRecord(
                tracker_pb2.NodeInfo(node_id=node_id, name=name, address=address,
                                     resources=resources, alive=True, last_heartbeat=now,
                                     registered=now, data_address=data_address,
                                     relay=relay),
                boot_id, copy.deepcopy(versions))

    def renew_node(self, node_id: str, resources: node_pb2.Resources,
                   versions: tracker_pb2.Versions, now: float, address: str = "",
                   data_address: str = "", relay: str = "") -> None:
        with self.lock:
            r = self._nodes.get(node_id)
            if r is None or r.fenced:
                return
            self._update(node_id, resources=resources, last_heartbeat=now, alive=True,
                         address=address or r.info.address, data_address=data_address,
                         relay=relay)
            r = self._nodes[node_id]
            self._nodes[node_id] = NodeRecord(r.info, r.boot_id, copy.deepcopy(versions))

    def fence_node(self, node_id: str) -> None:
        with self.lock:
            if node_id in self._nodes:
                self._update(node_id, fenced=True, alive=False)

    def heartbeat(self, node_id: str, now: float) -> bool:
        with self.lock:
            r = self._nodes.get(node_id)
            if r is None or r.fenced:
                return False
            self._update(node_id, last_heartbeat=now, alive=True)
            return True

    def mark_lost(self, node_id: str) -> bool:
        with self.lock:
            if node_id not in self._nodes or not self._nodes[node_id].info.alive:
                return False
            self._update(node_id, alive=False)
            return True

    def mark_lost_many(self, node_ids: Iterable[str]) -> None:
        with self.lock:
            for nid in node_ids:
                if nid in self._nodes:
                    self._update(nid, alive=False)

    def set_heartbeats(self, beats: Mapping[str, float]) -> None:
        with self.lock:
            for nid, now in beats.items():
                r = self._nodes.get(nid)
                if r is not None and r.info.alive and not r.fenced:
                    self._update(nid, last_heartbeat=now)

    def expire_nodes(self, cutoff: float) -> list[str]:
        with self.lock:
            ids = [nid for nid, r in self._nodes.items()
                   if r.info.alive and r.info.last_heartbeat < cutoff]
            for nid in ids:
                self._update(nid, alive=False)
            return ids

    def renew_all(self, now: float) -> None:
        with self.lock:
            for nid, r in list(self._nodes.items()):
                if r.info.alive:
                    self._update(nid, last_heartbeat=now)

    def node_records(self, include_lost: bool = False) -> list[NodeRecord]:
        with self.lock:
            records = [r for r in self._nodes.values() if include_lost or r.info.alive]
            records.sort(key=lambda r: (r.info.registered, r.info.node_id))
            return [copy.deepcopy(r) for r in records]

    # -- links --------------------------------------------------------------
    def set_links(self, links: Iterable[node_pb2.LinkMeasurement]) -> None:
        with self.lock:
            for m in links:
                if not m.error:
                    self._links[(m.src_id, m.dst_id)] = node_pb2.LinkMeasurement(
                        src_id=m.src_id, dst_id=m.dst_id, bandwidth=m.bandwidth,
                        latency=m.latency, measured_at=m.measured_at)

    def links(self) -> list[node_pb2.LinkMeasurement]:
        with self.lock:
            return [copy.deepcopy(m) for _, m in sorted(self._links.items())]

    # -- jobs ---------------------------------------------------------------
    def _job(self, job_id: str) -> _Job:
        j = self._jobs.get(job_id)
        if j is None:
            raise KeyError(job_id)
        return j

    def _event(self, job_id: str, now: float, **fields: Any) -> None:
        self._events.append((job_id, tracker_pb2.JobEvent(seq=next(self._seq), time=now,
                                                          **fields)))

    def add_job(self, spec: tracker_pb2.SubmitJobRequest, reason: str, now: float) -> str:
        job_id = new_id()
        with self.lock:
            info = tracker_pb2.JobInfo(job_id=job_id, name=spec.name, owner=spec.owner,
                                       state=tracker_pb2.JOB_STATE_PENDING, reason=reason,
                                       steps=spec.config.steps, created=now)
            self._jobs[job_id] = _Job(bare(spec), info, list(spec.layers), {},
                                      next(self._order))
            self._event(job_id, now, state=tracker_pb2.JOB_STATE_PENDING, reason=reason)
        return job_id

    def spec(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        with self.lock:
            return copy.deepcopy(self._job(job_id).spec)

    def layers(self, job_id: str, start: int, end: int) -> list[bytes]:
        with self.lock:
            j = self._jobs.get(job_id)
            return [] if j is None else j.layers[max(0, start):max(0, end)]

    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        with self.lock:
            j = self._job(job_id)
            info = copy.deepcopy(j.info)
            info.checkpoint_every = j.spec.config.checkpoint_every
            return info

    def jobs_in(self, *states: int) -> list[str]:
        with self.lock:
            found = [j for j in self._jobs.values() if j.info.state in states]
            return [j.info.job_id for j in sorted(found, key=lambda j: (j.info.created, j.order))]

    def set_state(self, job_id: str, state: int, reason: str, now: float, *,
                  only_from: set[int] | None = None) -> bool:
        with self.lock:
            j = self._jobs.get(job_id)
            if j is None or j.info.state in TERMINAL or (only_from and
                                                         j.info.state not in only_from):
                return False
            j.info.state, j.info.reason = base.job_state(state), reason
            self._event(job_id, now, state=state, reason=reason)
            if state in TERMINAL:
                j.layers = []
                self._replicas.pop(job_id, None)
            return True

    def set_plan(self, job_id: str, plan: node_pb2.Plan, readdressed: bool = False) -> None:
        with self.lock:
            j = self._job(job_id)
            j.info.plan.CopyFrom(plan)
            if not readdressed:
                j.stages = {(a.replica, a.stage): False for a in plan.stages}

    def set_config(self, job_id: str, config: node_pb2.JobConfig) -> None:
        with self.lock:
            self._job(job_id).spec.config.CopyFrom(config)

    def record_step(self, job_id: str, step: int, loss: float, samples_per_second: float,
                    now: float) -> None:
        with self.lock:
            j = self._job(job_id)
            j.info.step, j.info.loss = step, loss
            self._event(job_id, now, state=j.info.state, reason="", step=step, loss=loss,
                        samples_per_second=samples_per_second)
            if base.compact_due(step):
                drop = set(base.thinned([e.seq for jid, e in self._events if jid == job_id
                                         and e.step > 0 and not e.checkpoint_step
                                         and not e.reason]))
                if drop:
                    self._events = [(jid, e) for jid, e in self._events if e.seq not in drop]

    def stage_done(self, job_id: str, replica: int, stage: int) -> bool:
        with self.lock:
            j = self._job(job_id)
            if (replica, stage) in j.stages:
                j.stages[(replica, stage)] = True
            return all(j.stages.values())

    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        with self.lock:
            return [copy.deepcopy(e) for jid, e in self._events
                    if jid == job_id and e.seq > after_seq]

    def set_recovery(self, job_id: str, fields: tracker_pb2.JobInfo, now: float, *,
                     rewind_to: int | None = None, event: tracker_pb2.JobEvent | None = None
                     ) -> None:
        with self.lock:
            j = self._jobs.get(job_id)
            if j is None:
                return
            for name in RECOVERY_FIELDS:
                j.info.ClearField(name)
            j.info.MergeFrom(recovery_only(fields))
            if rewind_to is not None:
                j.info.step = rewind_to
            if event is not None:
                ev = tracker_pb2.JobEvent()
                ev.CopyFrom(event)
                ev.seq, ev.time = next(self._seq), now
                self._events.append((job_id, ev))

    def set_replicas(self, job_id: str, epoch: int, snapshot: bytes) -> None:
        with self.lock:
            if job_id in self._jobs and self._jobs[job_id].info.state not in TERMINAL:
                self._replicas[job_id] = (epoch, bytes(snapshot))

    def replicas(self, job_id: str) -> tuple[int, bytes] | None:
        with self.lock:
            return self._replicas.get(job_id)

    # -- the leader lease (one process: trackers in it may share the store) ----
    def take_lease(self, holder: str, address: str, now: float, seconds: float) -> Lease:
        with self.lock:
            if self._lease.expires <= now or self._lease.holder == holder:
                self._lease = Lease(holder, address, self._lease.epoch + 1, now + seconds)
            return self._lease

    def renew_lease(self, holder: str, epoch: int, now: float, seconds: float) -> bool:
        with self.lock:
            if (self._lease.holder, self._lease.epoch) != (holder, epoch):
                return False
            self._lease = Lease(holder, self._lease.address, epoch, now + seconds)
            return True

    def release_lease(self, holder: str, epoch: int) -> None:
        with self.lock:
            if (self._lease.holder, self._lease.epoch) == (holder, epoch):
                self._lease = Lease(holder, self._lease.address, epoch, 0.0)

    def lease(self) -> Lease:
        with self.lock:
            return self._lease
