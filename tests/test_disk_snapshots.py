"""Snapshots on disk (``fedpipe node --snapshot-dir``): safetensors files written tensor by
tensor, read back lazily, pruned with the store; a restore from them is bit for bit."""
from __future__ import annotations

import contextlib
import resource
import signal

import pytest
import torch

from fedpipe.node.snapfiles import SnapshotDirInUse
from fedpipe.node.snapshots import SnapshotDesk, SnapshotStore
from fedpipe.proto import node_pb2
from fedpipe.runtime import checkpoint, tensorfile
from fedpipe.spec import Kind, StageKey
from fedpipe.wire.codecs import WireError

from reference import toy_stage, train_toy

pytestmark = pytest.mark.timeout(60)
KEY = StageKey(0, 1)


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != ".lock")


def test_a_tensor_file_reads_back_every_dtype_and_shape_and_safetensors_reads_it(tmp_path):
    from safetensors.torch import load_file
    tensors = {"a": torch.randn(3, 4), "scalar": torch.tensor(5.0), "empty": torch.zeros(0, 3),
               "half": torch.randn(4).bfloat16(), "mask": torch.tensor([True, False]),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    path = tensorfile.write(tmp_path / "x.safetensors", tensors, {"k": "v"})
    read = tensorfile.TensorFile(path)
    assert list(read) == list(tensors) and read.metadata["k"] == "v"
    assert read.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        assert read[name].dtype == t.dtype and torch.equal(read[name], t), name
    theirs = load_file(str(path))
    assert all(torch.equal(theirs[k], t) for k, t in tensors.items())
    assert files(tmp_path) == ["x.safetensors"]  # written aside, then renamed


def test_a_tensor_file_writer_refuses_an_unannounced_tensor_and_abort_leaves_nothing(tmp_path):
    writer = tensorfile.TensorFileWriter(tmp_path / "x.safetensors", ["a", "b"], {})
    writer.add("a", torch.ones(2))
    with pytest.raises(tensorfile.TensorFileError, match="'c' was not announced"):
        writer.add("c", torch.ones(2))
    with pytest.raises(tensorfile.TensorFileError, match=r"never written: \['b'\]"):
        writer.close()
    assert files(tmp_path) == []


def test_a_disk_store_keeps_files_not_tensors_and_a_restore_from_one_is_bit_for_bit(tmp_path):
    model, opt = toy_stage()
    train_toy(model, opt, 3, seed=1)
    store = SnapshotStore(keep=2, directory=tmp_path)
    # written from the stage's own tensors (no copy), then the stage goes on
    kept = store.put("job", KEY, checkpoint.take({"module": model, "optimizer": opt}, 3,
                                                 copy=False))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    train_toy(model, opt, 4, seed=2)
    assert isinstance(kept.tensors, tensorfile.TensorFile)
    assert files(tmp_path) == [store.file("job", KEY, 3).name]
    assert kept.nbytes == store.nbytes > 0

    other, oopt = toy_stage()
    train_toy(other, oopt, 1, seed=9)  # diverged on purpose before the restore
    snap = store.get("job", KEY, 3)
    assert snap is not None
    checkpoint.restore({"module": other, "optimizer": oopt}, snap)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items())
    train_toy(other, oopt, 4, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values()))


def test_a_disk_store_removes_the_files_it_prunes_or_drops(tmp_path):
    model, opt = toy_stage()
    store = SnapshotStore(keep=2, directory=tmp_path)
    for step in (100, 200):
        store.put("job", KEY, checkpoint.take({"module": model}, step))
    store.protect("job", 100)
    reader = store.get("job", KEY, 100)  # a fetch under way when its file goes
    for step in (300, 400):
        store.put("job", KEY, checkpoint.take({"module": model}, step))
    assert store.steps("job", KEY) == [100, 300, 400]
    assert files(tmp_path) == sorted(store.file("job", KEY, s).name for s in (100, 300, 400))
    store.protect("job", 400)
    assert files(tmp_path) == sorted(store.file("job", KEY, s).name for s in (300, 400))
    assert reader is not None and torch.equal(reader.tensors["module/0.weight"],
                                              model[0].weight)  # its reader still reads
    store.drop_job("job")
    assert files(tmp_path) == [] and store.steps("job", KEY) == []


def test_a_snapshot_dir_of_a_live_store_is_refused_and_an_old_ones_files_are_removed(tmp_path):
    (tmp_path / "old-r0-s0-0000000003.safetensors").write_bytes(b"left by a killed node")
    (tmp_path / "old-r0-s0-0000000006.safetensors.tmp-0a1b2c").write_bytes(b"half written")
    store = SnapshotStore(directory=tmp_path)
    assert files(tmp_path) == [] and store.on_disk
    with pytest.raises(SnapshotDirInUse, match="in use by another live node"):
        SnapshotStore(directory=tmp_path)


def envelope(step: int) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", replica=KEY.replica, stage=KEY.stage,
                             kind=Kind.SNAPSHOT.value, step=step, batch_size=1)


def test_a_buddys_snapshot_goes_to_disk_as_its_stream_comes_and_a_truncated_one_leaves_nothing(
        tmp_path):
    model, opt = toy_stage()
    train_toy(model, opt, 2, seed=1)
    snap = checkpoint.take({"module": model, "optimizer": opt}, 2)
    store = SnapshotStore(directory=tmp_path)
    desk = SnapshotDesk(store, lambda job: job == "j", 1 << 30)
    frames = list(checkpoint.to_frames(snap, envelope(2)))
    desk.receive(iter(frames), lambda env: None)
    kept = store.get("j", KEY, 2)
    assert kept is not None and isinstance(kept.tensors, tensorfile.TensorFile)
    assert kept.skeleton == snap.skeleton and list(kept.tensors) == list(snap.tensors)
    assert all(torch.equal(kept.tensors[k], t) for k, t in snap.tensors.items())
    # served back (FetchSnapshot) from the file, a tensor at a time, as it was sent
    _, back = checkpoint.from_frames(checkpoint.to_frames(desk.snapshot("j", KEY, 2)), 1 << 30)
    assert all(torch.equal(back.tensors[k], t) for k, t in snap.tensors.items())

    later = checkpoint.take({"module": model, "optimizer": opt}, 4)
    cut = list(checkpoint.to_frames(later, envelope(4)))[:-1]
    with pytest.raises(WireError, match="malformed snapshot"):
        desk.receive(iter(cut), lambda env: None)
    assert store.steps("j", KEY) == [2]
    assert files(tmp_path) == [store.file("j", KEY, 2).name]  # no partial file stays


def test_a_disk_store_refuses_a_buddys_snapshot_of_a_job_it_holds_nothing_of_before_writing(
        tmp_path):
    from fedpipe.node.errors import NoSuchStage
    model, _ = toy_stage()
    store = SnapshotStore(directory=tmp_path)
    desk = SnapshotDesk(store, lambda job: False, 1 << 30)
    frames = checkpoint.to_frames(checkpoint.take({"module": model}, 1), envelope(1))
    with pytest.raises(NoSuchStage, match="runs no stage of job 'j'"):
        desk.receive(frames, lambda env: None)
    assert files(tmp_path) == []


def test_two_writers_of_one_snapshot_file_never_share_it(tmp_path):
    """Two streams of the same stage's step (two senders, or a resend racing the first):
    the one kept first must read its own tensors after the second lands, and the second
    must land too (the last kept wins). They once shared ``NAME.tmp``: the first file read
    the second's bytes, and the second failed to rename a file already gone."""
    store = SnapshotStore(directory=tmp_path)
    skeleton = {"w": {"$t": "x"}, "v": {"$t": "y"}}
    a = checkpoint.Snapshot(5, {"x": torch.full((100,), 1.0), "y": torch.full((3,), 2.0)},
                            skeleton)
    b = checkpoint.Snapshot(5, {"x": torch.full((7,), 3.0), "y": torch.full((50,), 4.0)},
                            skeleton)
    wa, wb = store.writer("j", KEY, a), store.writer("j", KEY, b)
    wa.add("x", a.tensors["x"])
    wb.add("x", b.tensors["x"])
    wa.add("y", a.tensors["y"])
    kept_a = wa.finish()
    wb.add("y", b.tensors["y"])
    kept_b = wb.finish()
    for kept, want in ((kept_a, a), (kept_b, b)):
        assert all(torch.equal(kept.tensors[n], t) for n, t in want.tensors.items())
    assert torch.equal(tensorfile.TensorFile(store.file("j", KEY, 5))["y"], b.tensors["y"])
    assert files(tmp_path) == [store.file("j", KEY, 5).name]


@contextlib.contextmanager
def files_capped(nbytes: int):
    """Writes past ``nbytes`` of any file of this process fail (EFBIG), as on a full disk."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_signal = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_signal)


def test_a_buddys_snapshot_that_the_disk_cannot_hold_leaves_no_file(tmp_path):
    """A full disk midway through a buddy's snapshot, over the socket data plane (tensor by
    tensor) or gRPC (a stream): its partial file is removed, so the disk is not kept full.
    It once stayed: aborting closed the file first, whose flush failed again, and the
    socket path did not abort a snapshot whose last tensor failed to write."""
    store = SnapshotStore(directory=tmp_path)
    desk = SnapshotDesk(store, lambda job: True, 1 << 30)
    snap = checkpoint.Snapshot(2, {"a": torch.ones(1000), "b": torch.ones(100_000)},
                               {"a": {"$t": "a"}, "b": {"$t": "b"}})
    with files_capped(64 << 10):
        for name, t in checkpoint.to_tensors(snap):
            head = node_pb2.Frame(envelope=envelope(2), name=name)
            if name == checkpoint.SKELETON:
                desk.admit_part("buddy", head, lambda env: None)
            if name == "b":
                with pytest.raises(OSError):
                    desk.add_part("buddy", head, t)
            else:
                desk.add_part("buddy", head, t)
        assert files(tmp_path) == []
        with pytest.raises(OSError):
            desk.receive(checkpoint.to_frames(snap, envelope(2)), lambda env: None)
    assert files(tmp_path) == [] and store.steps("j", KEY) == []


def test_a_final_state_the_disk_cannot_hold_is_logged_and_the_job_goes_on(tmp_path, caplog):
    """The last step's state on a full disk: the stage's training is done, so it is a
    warning naming what a save will miss, not an error that fails the job; no file stays."""
    from types import SimpleNamespace

    from fedpipe.node.peers import ChannelPool
    from fedpipe.node.snapshots import Checkpoints
    model, opt = toy_stage()
    model[0].weight.data = torch.ones(300, 5)  # over the cap below
    stage = SimpleNamespace(job_id="j", key=KEY, parts={"module": model, "optimizer": opt})
    store = SnapshotStore(directory=tmp_path)
    checkpoints = Checkpoints(store, ChannelPool(), reporter=None)
    with files_capped(4 << 10):
        checkpoints.keep_final(stage, 9)
    assert "could not keep the final state (step 9)" in caplog.text
    assert "Job.save() will not find it" in caplog.text
    assert files(tmp_path) == [] and store.steps("j", KEY) == []


def test_a_snapshot_dir_that_cannot_be_made_is_named_as_such(tmp_path):
    """``fedpipe node --snapshot-dir`` at a path that cannot be a directory: the error names
    the snapshot directory. It once said "cannot listen on data port 0 of 127.0.0.1"."""
    import socket

    from fedpipe.node.parts import build_parts
    from fedpipe.node.probe import probe
    (tmp_path / "file").write_text("")
    for where in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(OSError, match=f"cannot use snapshot directory {where}: ") as e:
            build_parts(lambda: "n", "n", probe("cpu"), lambda r: None, data_port=0,
                        data_host="127.0.0.1", snapshot_dir=where)
        assert "data port" not in str(e.value)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on data port {port} of 127.0.0.1"):
            build_parts(lambda: "n", "n", probe("cpu"), lambda r: None, data_port=port,
                        data_host="127.0.0.1", snapshot_dir=tmp_path / "snaps")


def test_a_snapshot_dirs_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    """A ``.lock`` planted as a link (a shared directory such as /tmp): it was followed,
    and the file it named truncated to the node's pid (any file, for a node run as root)."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "snaps").mkdir()
    (tmp_path / "snaps" / ".lock").symlink_to(victim)
    with pytest.raises(OSError, match=r"\.lock"):
        SnapshotStore(directory=tmp_path / "snaps")
    assert victim.read_text() == "precious"
