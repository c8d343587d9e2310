"""Stage snapshots: a restored stage continues bit for bit; bad streams are refused."""
import copy

import pytest
import torch

from fedpipe.runtime import checkpoint
from fedpipe.wire.codecs import WireError

from reference import toy_stage, train_toy

pytestmark = pytest.mark.timeout(60)


def parts(model, opt, sched):
    return {"module": model, "optimizer": opt, "lr_scheduler": sched}


def test_a_restored_stage_continues_bit_for_bit():
    model, opt, sched = toy_stage("adamw")
    train_toy(model, opt, sched=sched, steps=3, seed=1)
    snap = checkpoint.take(parts(model, opt, sched), step=3)
    train_toy(model, opt, sched=sched, steps=4, seed=2)  # the original goes on

    other, oopt, osched = toy_stage("adamw")
    train_toy(other, oopt, sched=osched, steps=1, seed=9)  # diverged on purpose before the restore
    _, received = checkpoint.from_frames(checkpoint.to_frames(snap), max_bytes=2**20)
    assert received.step == 3
    checkpoint.restore(parts(other, oopt, osched), received)
    train_toy(other, oopt, sched=osched, steps=4, seed=2)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert osched.get_last_lr() == sched.get_last_lr()
    assert oopt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


def test_the_snapshot_is_a_copy():
    model, opt, sched = toy_stage("adamw")
    snap = checkpoint.take(parts(model, opt, sched), step=0)
    before = copy.deepcopy(snap.tensors)
    train_toy(model, opt, sched=sched, steps=2, seed=1)
    assert all(torch.equal(before[k], snap.tensors[k]) for k in before)
    assert snap.nbytes == sum(t.numel() * t.element_size() for t in before.values())


def test_a_restore_leaves_the_kept_snapshot_as_it_was_taken():
    """An optimizer keeps the tensors it is given as its state and trains them in place:
    a second restore of the same kept snapshot (two recoveries to one checkpoint) must
    find the state of its step, and continue bit for bit as the first did."""
    model, opt, sched = toy_stage("adamw")
    train_toy(model, opt, sched=sched, steps=3, seed=1)
    snap = checkpoint.take(parts(model, opt, sched), step=3)
    taken = copy.deepcopy(snap.tensors)
    runs = []
    for _ in range(2):
        checkpoint.restore(parts(model, opt, sched), snap)
        train_toy(model, opt, sched=sched, steps=2, seed=2)
        assert all(torch.equal(taken[k], snap.tensors[k]) for k in taken)
        runs.append(copy.deepcopy(model.state_dict()))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_truncated_and_inconsistent_snapshots_are_refused():
    model, opt, sched = toy_stage("adamw")
    train_toy(model, opt, sched=sched, steps=2, seed=1)
    frames = list(checkpoint.to_frames(checkpoint.take(parts(model, opt, sched), step=2)))
    with pytest.raises(WireError, match="missing"):
        checkpoint.from_frames(frames[:-1], max_bytes=2**20)  # the last tensor lost
    with pytest.raises(WireError, match="skeleton"):
        checkpoint.from_frames(frames[1:], max_bytes=2**20)
    with pytest.raises(WireError, match="limit"):
        checkpoint.from_frames(frames, max_bytes=100)
    cut = frames[-1][:-4]  # a short payload
    with pytest.raises(WireError):
        checkpoint.from_frames(frames[:-1] + [cut], max_bytes=2**20)


def test_a_part_missing_from_the_snapshot_is_named():
    model, opt, sched = toy_stage("adamw")
    snap = checkpoint.take({"module": model}, step=0)
    with pytest.raises(WireError, match="optimizer"):
        checkpoint.restore({"module": model, "optimizer": opt}, snap)


def test_state_that_is_not_data_is_refused():
    class Odd:
        def state_dict(self):
            return {"f": lambda: 0}

    with pytest.raises(TypeError, match="odd/f"):
        checkpoint.take({"odd": Odd()}, step=0)


def _skeleton_only(meta: bytes) -> list[bytes]:
    from fedpipe.wire import frames as wire_frames
    return list(wire_frames.encode_frames(torch.frombuffer(bytearray(meta), dtype=torch.uint8),
                                          name=checkpoint.SKELETON))


@pytest.mark.parametrize("meta, match", [
    (b'{"step": 1, "skeleton": {"module": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
     "nested deeper"),
    (b'{"step": 1, "skeleton": {"module": ' + b'{"$l": [' * 400 + b"1" + b"]}" * 400 + b"}}",
     "nested deeper"),
    (b'{"step": 1, "skeleton": [["module", 1]]}', "want"),  # pairs, not a mapping
    (b'{"step": "1", "skeleton": {}}', "want"),
    (b'[1, 2]', "want"),
    (b'{"step": 1, "skeleton": {"module": {"$t": 5}}}', "not a string"),
])
def test_a_malformed_skeleton_is_a_wire_error(meta, match):
    with pytest.raises(WireError, match=match):
        checkpoint.from_frames(_skeleton_only(meta), max_bytes=2**20)


def test_an_oversized_snapshot_is_refused_on_a_header():
    model, opt, sched = toy_stage("adamw")
    snap = checkpoint.take(parts(model, opt, sched), step=0)
    frames = list(checkpoint.to_frames(snap))
    with pytest.raises(checkpoint.SnapshotTooLarge, match="limit of 100 bytes"):
        checkpoint.from_frames(frames, max_bytes=100)
    _, back = checkpoint.from_frames(frames, max_bytes=snap.nbytes)  # exactly fits
    assert set(back.tensors) == set(snap.tensors)


def test_a_node_keeps_the_last_complete_checkpoint_however_many_newer_come():
    from fedpipe.node.snapshots import SnapshotStore
    from fedpipe.spec import StageKey
    model, opt, sched = toy_stage("adamw")
    store, key = SnapshotStore(keep=2), StageKey(0, 0)
    store.put("job", key, checkpoint.take(parts(model, opt, sched), step=100))
    store.protect("job", 100)  # the tracker: 100 is the last complete checkpoint
    for step in (200, 300, 400):  # checkpoints the tracker never completes
        store.put("job", key, checkpoint.take(parts(model, opt, sched), step=step))
    assert store.steps("job", key) == [100, 300, 400]
    store.protect("job", 300)  # once a newer one completes, the old one may go
    assert store.steps("job", key) == [300, 400]
    store.put("other", key, checkpoint.take(parts(model, opt, sched), step=1))
    store.put("other", key, checkpoint.take(parts(model, opt, sched), step=2))
    store.put("other", key, checkpoint.take(parts(model, opt, sched), step=3))
    assert store.steps("other", key) == [2, 3]  # another job: the newest two, as before


def test_a_node_names_the_acknowledged_steps_it_keeps_that_are_not_complete_yet():
    """What a node's heartbeat says it acked (``StageRef.acked``): a tracker that took over
    counts these again."""
    from fedpipe.node.snapshots import SnapshotStore
    from fedpipe.spec import StageKey
    model, opt, sched = toy_stage("adamw")
    store, key = SnapshotStore(keep=2), StageKey(0, 1)
    for step in (10, 20):
        store.put("job", key, checkpoint.take(parts(model, opt, sched), step=step))
        store.acked("job", key, 1, step)
    assert store.acked_steps("job", key, 1) == [10, 20]
    assert store.acked_steps("job", key, 2) == []  # another plan epoch acked nothing
    assert store.acked_steps("job", StageKey(0, 0), 1) == []  # nor another stage
    store.protect("job", 10)  # complete: the tracker counted it
    assert store.acked_steps("job", key, 1) == [20]
    store.put("job", key, checkpoint.take(parts(model, opt, sched), step=30))  # not acked yet
    store.protect("job", 0)
    assert store.acked_steps("job", key, 1) == [20]  # 10 was pruned; 30 is not acked
    store.drop_job("job")
    assert store.acked_steps("job", key, 1) == []


@pytest.mark.parametrize("state, said", [("DONE", True), ("RUNNING", True),
                                         ("STOPPED", False)])
def test_a_shipped_checkpoint_is_reported_unless_its_stage_was_stopped(state, said):
    """A last stage may run its last steps while its snapshot still travels to its buddy: a
    DONE stage still reports the checkpoint (it was once dropped, so the tracker never
    completed the job's last checkpoint); a stopped one (an old epoch's) says nothing."""
    from types import SimpleNamespace

    from fedpipe.node.lifecycle import StageSlot, StageState
    from fedpipe.node.peers import ChannelPool
    from fedpipe.node.reports import StageReporter
    from fedpipe.node.snapshots import Checkpoints, SnapshotStore
    from fedpipe.proto import tracker_pb2

    model, opt, sched = toy_stage("adamw")
    sent: list = []
    store = SnapshotStore(keep=2)
    shipping = Checkpoints(store, ChannelPool(), StageReporter(lambda: "n", sent.append))
    slot = StageSlot("job", 0, 1)
    stage = SimpleNamespace(job_id="job", slot=slot, key=slot.key, epoch=1, plan=None,
                            parts=parts(model, opt, sched), state=StageState[state],
                            live=StageState[state] == StageState.RUNNING)
    shipping.take(stage, 4)
    shipping.shipper.shutdown(wait=True)
    reported = [(r.status, r.step) for r in sent]
    assert reported == ([(tracker_pb2.StageReport.STATUS_CHECKPOINT, 4)] if said else [])
