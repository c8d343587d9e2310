"""The data plane's admission and delivery, in process: which envelopes a stage takes,
checked on the header before a payload byte is buffered, and how an admitted tensor is
filed. A fake stage lookup stands for the registry; the mailbox is the real one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedpipe.node.admission import BOUNDED_KINDS, DataPlane, inbox_job
from fedpipe.node.errors import BadEnvelope, Duplicate, NoSuchStage, StaleEpoch, Stopped
from fedpipe.node.lifecycle import Stage, StageSlot, StageState
from fedpipe.node.mailbox import Mailbox
from fedpipe.node.linkprobe import MAX_PROBE_BYTES
from fedpipe.node.reports import StageReporter
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import Kind, PlanView
from fedpipe.wire import WireError, codecs, frames

pytestmark = pytest.mark.timeout(30)


class Runner:
    microbatches = 4


class Lookup:
    """The registry, as the data plane sees it: stages by slot."""

    def __init__(self, *stages: Stage):
        self.stages = {s.slot: s for s in stages}

    def get(self, slot: StageSlot) -> Stage:
        if slot not in self.stages:
            raise NoSuchStage(f"no stage {slot.stage}")
        return self.stages[slot]


PLAN = node_pb2.Plan(epoch=2, stages=[
    node_pb2.StageAssignment(replica=0, stage=s, address=f"10.0.0.{s}:1", node_name=f"n{s}")
    for s in range(3)])


def stage(position: int, state: StageState = StageState.RUNNING) -> Stage:
    st = Stage(StageSlot("j", 0, position), 3, 0, nn.Sequential(), 10, peers=None,
               runner=Runner(), epoch=2, plan=PlanView(PLAN, 4))  # type: ignore[arg-type]
    if state is not StageState.LOADING:
        st.move(StageState.RUNNING, "test")
    if state not in (StageState.LOADING, StageState.RUNNING):
        st.move(state, "test")
    return st


def env(position: int = 0, kind: Kind = Kind.INPUT, **kw) -> node_pb2.Envelope:
    fields = dict(job_id="j", stage=position, kind=kind, step=0, batch_size=8, epoch=2)
    fields.update(kw)
    return node_pb2.Envelope(**fields)


@pytest.fixture
def plane():
    reports: list[tracker_pb2.StageReport] = []
    stages = Lookup(stage(0), stage(1), stage(2))
    box = Mailbox(2, bounded=BOUNDED_KINDS, job_of=inbox_job)
    return DataPlane(stages, box, StageReporter(lambda: "n0", reports.append)), box, reports


def test_a_probe_is_admitted_up_to_its_limit_and_never_filed(plane):
    data, box, _ = plane
    assert data.admit(node_pb2.Envelope(kind=Kind.PROBE)) == MAX_PROBE_BYTES
    data.deliver(node_pb2.Envelope(kind=Kind.PROBE), torch.zeros(3), lambda: True)
    assert box.waiting("j") == 0


def test_a_stages_tensors_are_admitted_with_the_tensor_limit(plane):
    data, _, _ = plane
    assert data.admit(env(0, Kind.INPUT, microbatch=3)) == codecs.MAX_TENSOR_BYTES
    assert data.admit(env(2, Kind.TARGET, microbatches=4), (8, 2)) == codecs.MAX_TENSOR_BYTES
    assert data.admit(env(1, Kind.ACTIVATION, step=9)) == codecs.MAX_TENSOR_BYTES
    assert data.admit(env(1, Kind.GRADIENT)) == codecs.MAX_TENSOR_BYTES


@pytest.mark.parametrize("pinned", [False, True], ids=["cpu node", "cuda node"])
def test_a_cuda_nodes_stage_tensors_are_received_into_pinned_memory_and_probes_never(pinned):
    stages = Lookup(stage(0), stage(1), stage(2))
    data = DataPlane(stages, Mailbox(2, bounded=BOUNDED_KINDS, job_of=inbox_job),
                     StageReporter(lambda: "n0", [].append), pinned=pinned)
    assert data.admitted(env(1, Kind.ACTIVATION)).pinned is pinned
    assert data.admitted(env(0, Kind.INPUT)).pinned is pinned
    assert data.admitted(node_pb2.Envelope(kind=Kind.PROBE)).pinned is False


@pytest.mark.parametrize("envelope,error,says", [
    (env(job_id="other"), NoSuchStage, "no stage 0"),
    (env(epoch=1), StaleEpoch, "plan epoch 1"),
    (env(kind=Kind.SNAPSHOT), BadEnvelope, "unknown envelope kind"),
    (env(batch_size=0), BadEnvelope, "batch_size must be positive"),
    (env(step=10), BadEnvelope, "out of range for a job of 10 steps"),
    (env(microbatch=-1), BadEnvelope, "out of range"),
    (env(microbatches=-1), BadEnvelope, "microbatches must be >= 0"),
    (env(1, Kind.ACTIVATION, microbatches=2), BadEnvelope, "only a client's inputs"),
    (env(1, Kind.INPUT), BadEnvelope, "inputs go to stage 0"),
    (env(0, Kind.TARGET), BadEnvelope, "targets go to stage 2"),
    (env(0, Kind.INPUT, microbatch=4), BadEnvelope, "microbatches 4..4 out of range"),
    (env(0, Kind.INPUT, microbatch=2, microbatches=3), BadEnvelope, "2..4 out of range"),
])
def test_an_envelope_the_stage_cannot_take_is_refused_on_its_header(plane, envelope, error,
                                                                     says):
    data, box, _ = plane
    with pytest.raises(error, match=says):
        data.admit(envelope, (8, 2))
    assert box.waiting("j") == 0


def test_a_tensor_of_several_microbatches_needs_a_row_for_each(plane):
    data, _, _ = plane
    with pytest.raises(BadEnvelope, match=r"shape \(3, 2\) cannot hold 4"):
        data.admit(env(microbatches=4), (3, 2))
    with pytest.raises(BadEnvelope, match="cannot hold 4"):
        data.admit(env(microbatches=4), ())


def test_an_ended_stage_takes_nothing():
    data = DataPlane(Lookup(stage(0, StageState.DONE)), Mailbox(2, BOUNDED_KINDS),
                     StageReporter(lambda: "n0", lambda r: None))
    with pytest.raises(NoSuchStage, match="is stopped"):
        data.admit(env())


def test_a_tensor_of_several_microbatches_is_filed_as_its_pieces_all_or_none(plane):
    data, box, _ = plane
    x = torch.arange(8.0).reshape(4, 2)
    data.deliver(env(2, Kind.TARGET, microbatch=1), torch.zeros(1, 2), lambda: True)
    with pytest.raises(Duplicate, match="microbatch 1"):
        data.deliver(env(2, Kind.TARGET, microbatches=2), x, lambda: True)
    assert box.waiting("j") == 1  # nothing of the refused one was kept
    data.deliver(env(0, microbatches=2), x, lambda: True)
    slot = (StageSlot("j", 0, 0), 2)
    assert torch.equal(box.get(slot, Kind.INPUT, 0, 1, lambda: False)[0], x[2:])
    assert torch.equal(box.get(slot, Kind.INPUT, 0, 0, lambda: False)[0], x[:2])


def test_a_put_waiting_for_room_gives_up_when_the_caller_goes(plane):
    data, _, _ = plane
    for mb in range(2):  # the inbox of inputs holds 2
        data.deliver(env(microbatch=mb), torch.zeros(1), lambda: True)
    with pytest.raises(Stopped):
        data.deliver(env(microbatch=2), torch.zeros(1), lambda: False)


def test_a_stage_replaced_since_admission_takes_nothing_of_the_old_epoch(plane):
    data, _, _ = plane
    with pytest.raises(StaleEpoch, match="now runs epoch 2, not 1"):
        data.deliver(env(epoch=1), torch.zeros(1), lambda: True)


def test_a_broken_stream_of_pipeline_tensors_reports_the_sending_neighbour(plane):
    data, _, reports = plane
    data.suspect(env(1, Kind.ACTIVATION))
    data.suspect(env(1, Kind.GRADIENT))
    data.suspect(env(1, Kind.INPUT))  # a client's: no neighbour to suspect
    data.suspect(env(1, Kind.ACTIVATION, epoch=1))  # of an old epoch
    data.suspect(env(1, Kind.ACTIVATION, job_id="gone"))
    assert [(r.status, r.peer) for r in reports] == [
        (tracker_pb2.StageReport.STATUS_SUSPECT, "10.0.0.0:1"),
        (tracker_pb2.StageReport.STATUS_SUSPECT, "10.0.0.2:1")]
    assert "the stream from n0 broke" in reports[0].error


def test_receive_checks_each_header_then_admits_and_files_it(plane):
    data, box, _ = plane
    seen: list[int] = []
    stream = list(frames.encode_frames(torch.zeros(2), envelope=env(microbatch=1))) + \
        list(frames.encode_frames(torch.ones(2), envelope=env(microbatch=0)))
    data.receive(iter(stream), lambda head: seen.append(head.envelope.microbatch),
                 lambda: True)
    assert seen == [1, 0] and box.waiting("j") == 2
    with pytest.raises(WireError, match="malformed tensor"):
        data.receive(iter([b"garbage"]), lambda head: None, lambda: True)
    refused = list(frames.encode_frames(torch.zeros(2), envelope=env(microbatch=3)))
    with pytest.raises(PermissionError):
        data.receive(iter(refused), lambda head: (_ for _ in ()).throw(PermissionError()),
                     lambda: True)
    assert box.waiting("j") == 2  # a refused caller's tensor was not filed
