"""A save streams each stage's snapshot from its node into the shard files a tensor at a
time (issue 22, item 6): the client holds one tensor of it, never a whole stage.

The stages are real fedpipe parts (layers, AdamW after a step, layout) snapshotted as a node
snapshots them, sent as the node sends them (:func:`fedpipe.runtime.checkpoint.to_frames`,
the FetchSnapshot stream's bytes) and pulled by the client's own code
(:func:`fedpipe.client.checkpoints.pull`, as ``Job.save`` and ``checkpoint_dir`` pull);
the node's answer comes from a stand-in stub that serves those frames. The swarm test of
``job.save`` is in tests/test_bigmodel_hf.py."""
from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fedpipe.client import checkpoints
from fedpipe.proto import node_pb2
from fedpipe.runtime import checkpoint
from fedpipe.runtime.checkpoint import SnapshotStream
from fedpipe.runtime.layerstate import Layout
from fedpipe.runtime.tensorfile import TensorFileError, TensorFileWriter
from fedpipe.runtime.weights import WeightFiles
from fedpipe.spec import StageKey
from fedpipe.wire.format import WireError

pytestmark = pytest.mark.timeout(60)
SUCCEEDED = 4  # tracker_pb2.JOB_STATE_SUCCEEDED: the state only words CheckpointGone


def _trained_stages(bounds: list[int]):
    """Layers of several sizes split at ``bounds``, one AdamW step taken; the plan and each
    stage's snapshot of step 1."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 4))
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=k, layer_start=a, layer_end=b, address=f"n{k}:1")
        for k, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    snaps = {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        module = nn.Sequential(*layers[a:b])
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        module(torch.randn(2, module[0].in_features)).sum().backward()
        opt.step()
        snaps[StageKey(0, k)] = checkpoint.take(
            {"module": module, "optimizer": opt, "layers": Layout(module, a)}, 1)
    return layers, plan, snaps


class SnapshotNode:
    """Serves FetchSnapshot as a node does: the snapshot's frames, streamed."""

    def __init__(self, snaps):
        self.snaps = snaps

    def FetchSnapshot(self, request, timeout=None):
        return checkpoint.to_frames(self.snaps[StageKey(request.replica, request.stage)])


class Alive:
    """Counts the bytes of the streamed tensors still alive in this process, at each one."""

    def __init__(self):
        self.alive: dict[int, int] = {}
        self.peak = self.count = 0

    def watch(self, pulled):
        for key, snap in pulled:
            yield key, SnapshotStream(snap.step, snap.skeleton, self._tensors(snap.tensors))

    def _tensors(self, tensors):
        for name, t in tensors:
            self.count += 1
            token = self.count
            self.alive[token] = t.numel() * t.element_size()
            weakref.finalize(t, self.alive.pop, token)
            self.peak = max(self.peak, sum(self.alive.values()))
            yield name, t
            del t


def test_a_save_holds_one_tensor_at_a_time_and_writes_the_stages_state(tmp_path):
    layers, plan, snaps = _trained_stages([0, 2, 4])
    alive = Alive()
    pulled = checkpoints.pull(lambda address: SnapshotNode(snaps), "j", plan, 1, SUCCEEDED)
    folder = checkpoints.write(tmp_path / "saved", 1, alive.watch(pulled), plan, steps=3)

    largest = max(t.numel() * t.element_size() for s in snaps.values()
                  for t in s.tensors.values())
    whole_stage = max(s.nbytes for s in snaps.values())
    assert alive.count == sum(len(s.tensors) for s in snaps.values())
    assert alive.peak <= largest < whole_stage  # one tensor at a time, never a stage
    with WeightFiles(folder) as files:  # the model's weights under its own names
        assert sorted(files.keys()) == sorted(layers.state_dict())
        for name, t in layers.state_dict().items():
            assert torch.equal(files.tensor(name), t)
    saved = checkpoints.read(folder)  # and the rest of each stage's state, bit for bit
    for key, want in snaps.items():
        got = saved.snapshots[key]
        assert got.skeleton == want.skeleton
        assert set(got.tensors) == set(want.tensors)
        assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())


def test_a_stream_cut_short_fails_the_save_and_leaves_the_earlier_checkpoint(tmp_path):
    _, plan, snaps = _trained_stages([0, 2, 4])
    checkpoints.write(tmp_path, 1, snaps, plan, steps=3)

    class CutShort(SnapshotNode):
        def FetchSnapshot(self, request, timeout=None):
            frames = list(super().FetchSnapshot(request, timeout))
            return iter(frames[:-1] if request.stage == 1 else frames)
    with pytest.raises(WireError, match="truncated|ended"):
        checkpoints.write(tmp_path, 2, checkpoints.pull(lambda address: CutShort(snaps), "j",
                                                        plan, 2, SUCCEEDED), plan, steps=3)
    assert checkpoints.read(tmp_path).step == 1
    assert not list(tmp_path.glob("*.tmp.tmp*"))  # the failed stage's partial files are gone


def test_a_tensor_file_holds_every_dtype_and_shape_as_safetensors_reads_them(tmp_path):
    tensors = {"f64": torch.randn(3, 2, dtype=torch.float64), "bf16": torch.randn(5).bfloat16(),
               "f16": torch.randn(2, 2).half(), "i64": torch.arange(7), "u8": torch.zeros(0,
               dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
               "scalar": torch.tensor(2.5), "strided": torch.randn(4, 6)[:, ::2]}
    out = TensorFileWriter(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    for name, t in tensors.items():
        out.add(name, t)
    with pytest.raises(TensorFileError, match="'f64' was not announced or came twice"):
        out.add("f64", torch.zeros(1))
    out.close()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert not list(tmp_path.glob("x.safetensors.tmp*"))


@pytest.mark.parametrize("bogus", ["module/7.weight", "module/x.weight", "module/-2.weight"])
def test_a_stage_naming_a_layer_not_its_own_fails_the_save(tmp_path, bogus):
    """A node's skeleton that names a layer outside its stage's range: the save fails,
    naming it. It once saved the tensor under that layer's model name (``9.weight`` of a
    4-layer model) and left the stage's own layer out of the shards, silently; a
    non-numeric layer raised a bare ValueError."""
    _, plan, snaps = _trained_stages([0, 2, 4])
    key = StageKey(0, 1)
    snap = snaps[key]
    skeleton = json.loads(json.dumps(snap.skeleton).replace('"module/0.weight"',
                                                            json.dumps(bogus)))
    tensors = dict(snap.tensors)
    tensors[bogus] = tensors.pop("module/0.weight")
    snaps[key] = checkpoint.Snapshot(snap.step, tensors, skeleton)
    with pytest.raises(WireError, match=f"stage 1's snapshot names '{bogus}': not a layer"):
        checkpoints.write(tmp_path, 1, snaps, plan, steps=3)
    assert not (tmp_path / checkpoints.META).exists()


def test_a_stream_with_a_tensor_its_skeleton_does_not_name_fails_the_save_as_malformed(
        tmp_path):
    """A node that sends one tensor more than its skeleton names: a WireError naming the
    stage and the tensor (it was the tensor file's own ValueError), and no partial file."""
    _, plan, snaps = _trained_stages([0, 2, 4])

    class Extra(SnapshotNode):
        def FetchSnapshot(self, request, timeout=None):
            frames = list(super().FetchSnapshot(request, timeout))
            if request.stage == 1:
                more = checkpoint.Snapshot(1, {"zzz": torch.ones(3)}, {"a": {"$t": "zzz"}})
                frames += list(checkpoint.to_frames(more))[1:]  # its tensor, no skeleton
            return iter(frames)
    with pytest.raises(WireError, match="stage 1's snapshot: tensor 'zzz' was not announced"):
        checkpoints.write(tmp_path, 2, checkpoints.pull(lambda address: Extra(snaps), "j",
                                                        plan, 2, SUCCEEDED), plan, steps=3)
    assert not list(tmp_path.glob("*.tmp.tmp*"))  # the failed stage's partial files are gone
