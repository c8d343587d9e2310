"""SparseLoCo: DiLoCo's pseudo-gradients through the ``sparseloco`` codec (top-k per
4096-chunk, 2-bit values) and decayed error feedback, with no outer momentum.

The codec's round trip and size; the decayed error feedback; groups that stay
bit-identical and a run that replays bit for bit; the residuals in the
checkpoint (a resumed run equals the uninterrupted one, and would not without
them); and a real 2-group job that ends SUCCEEDED and, killed and rewound from a
checkpoint, equals the uninterrupted job.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.runtime.allreduce import StageSpan
from fedpipe.runtime.diloco import OuterSync
from fedpipe.spec import DiLoCo, PlanView, SpecError, StageKey, parse_codec
from fedpipe.testing import LocalSwarm
from fedpipe.testing.outer import OuterWire
from fedpipe.wire import codecs
from fedpipe.wire.codecmodel import MODELS, SPARSELOCO_CHUNK, Layout
from reference import digit_batches, job_info, max_relative_difference
from test_diloco import data, mlp, train_groups

pytestmark = pytest.mark.timeout(120)
CODEC = "sparseloco:0.015625"  # 64 of each 4096


# -- the codec ---------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 100, 4096, 4097, 3 * 4096 + 5])
def test_round_trip_keeps_the_top_k_of_each_chunk_in_2_bits_and_its_size_is_the_model(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    msg = codecs.encode(x, CODEC)
    y = codecs.decode(msg)
    k = parse_codec(CODEC).k(SPARSELOCO_CHUNK)
    assert k == 64 and msg.k == k
    chunks = -(-n // SPARSELOCO_CHUNK)
    assert msg.encoded_bytes == MODELS["sparseloco"].encoded_bytes(Layout(n, k=k)) \
        == chunks * (4 + 96 + 16)
    for c in range(chunks):
        xs, ys = (t[c * SPARSELOCO_CHUNK:(c + 1) * SPARSELOCO_CHUNK] for t in (x, y))
        kept = ys != 0
        top = xs.abs().topk(min(k, len(xs))).indices
        assert kept.sum() == len(top) and kept[top].all()  # exactly the chunk's top k
        scale = xs[kept].abs().max()
        levels = torch.tensor([-1, -1 / 3, 1 / 3, 1]) * scale
        assert ((ys[kept, None] - levels).abs().min(dim=1).values < 1e-6 * scale).all()
        assert (ys[kept].sign() == xs[kept].sign()).all()
        assert ((ys[kept] - xs[kept]).abs() <= scale / 3 + 1e-6).all()  # nearest level
    assert torch.equal(codecs.decode(codecs.encode(y, CODEC)), y)  # what peers see of it


def test_a_pseudo_gradient_is_over_100x_smaller_than_dense_fp32():
    x = torch.randn(10 * SPARSELOCO_CHUNK)
    assert 4 * x.numel() / len(codecs.encode(x, CODEC).payload) > 140
    assert 4 * x.numel() / len(codecs.encode(x, "sparseloco").payload) > 200  # F = 0.01


def test_malformed_messages_and_specs_are_refused():
    msg = codecs.encode(torch.randn(5000), CODEC)
    bad = copy.deepcopy(msg)
    payload = bytearray(bad.payload)
    payload[8:11] = payload[11:14]  # chunk 0's first pair of indices repeats its second
    bad.payload = bytes(payload)
    with pytest.raises(codecs.WireError, match="strictly increase within a chunk"):
        codecs.decode(bad)
    bad = copy.deepcopy(msg)
    bad.k = SPARSELOCO_CHUNK + 1
    with pytest.raises(codecs.WireError, match=r"sparseloco k must be in \[1, 4096\]"):
        codecs.decode(bad)
    with pytest.raises(SpecError, match="sparseloco fraction"):
        parse_codec("sparseloco:2")
    with pytest.raises(SpecError, match="gradients only"):
        fedpipe.spec.check_compression("sparseloco", "activations")
    with pytest.raises(SpecError, match="feedback_decay=0.9 needs a lossy outer compression"):
        DiLoCo(feedback_decay=0.9)
    with pytest.raises(SpecError, match=r"feedback_decay must be in \(0, 1\]"):
        DiLoCo.sparseloco(feedback_decay=0.0)


def test_decayed_error_feedback_sends_the_top_of_beta_e_plus_delta_and_keeps_the_rest():
    fb = codecs.ErrorFeedback(decay=0.5)
    g = torch.Generator().manual_seed(3)
    first, second = torch.randn(6000, generator=g), torch.randn(6000, generator=g)
    sent1 = codecs.decode(codecs.encode(first, CODEC, feedback=fb, key="s"))
    e1 = fb.residual("s").clone()
    torch.testing.assert_close(e1, first - sent1)
    sent2 = codecs.decode(codecs.encode(second, CODEC, feedback=fb, key="s"))
    acc = 0.5 * e1 + second
    assert torch.equal(sent2, codecs.decode(codecs.encode(acc, CODEC)))
    torch.testing.assert_close(fb.residual("s"), acc - sent2)
    with pytest.raises(ValueError, match="decay"):
        codecs.ErrorFeedback(decay=1.5)


# -- DiLoCo with it, in threads ----------------------------------------------
SPARSE = DiLoCo.sparseloco(inner_steps=2)


def test_groups_stay_identical_a_run_replays_bit_for_bit_and_it_is_not_dense_diloco():
    model, batches = mlp(), data(8)
    spec = fedpipe.optimizer(torch.optim.AdamW, lr=1e-2)
    assert SPARSE.compression == CODEC and SPARSE.outer_momentum == 0
    runs = [train_groups(model, batches, [1, 1], SPARSE, spec, last_step=7)[0] for _ in "ab"]
    for a, b in zip(runs[0][0].parameters(), runs[0][1].parameters()):
        assert torch.equal(a, b)  # every group applies what its peers decoded
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(a, b)  # deterministic: a replay sends the same bytes
    dense = train_groups(model, batches, [1, 1], DiLoCo(2, 1.0, 0.0), spec, last_step=7)[0]
    assert max_relative_difference(runs[0][0].state_dict(), dense[0].state_dict()) > 1e-3


def _run(groups, batches, start):
    """Train ``groups`` (``[(model, inner optimizer, sync)]``) on ``batches[start:]``."""
    for step, (x, y) in enumerate(batches[start:], start):
        for (m, _, _), xs, ys in zip(groups, x.chunk(len(groups)), y.chunk(len(groups))):
            (nn.functional.cross_entropy(m(xs), ys) / len(groups)).backward()

        def one(opt, sync, step=step):
            sync.rescale_gradients(step)
            opt.step()
            opt.zero_grad()
            sync(step)
        threads = [threading.Thread(target=one, args=(o, s)) for _, o, s in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)


def _groups(model, wire, last_step):
    spans = [StageSpan(StageKey(r, 0), 0, 5) for r in range(2)]
    out = []
    for r in range(2):
        m = copy.deepcopy(model)
        sync = OuterSync(m, StageKey(r, 0), spans, SPARSE, [1, 1], wire.transport(StageKey(r, 0)),
                         last_step=last_step)
        out.append((m, torch.optim.AdamW(m.parameters(), lr=1e-2), sync))
    return out


@pytest.mark.parametrize("keep_residuals", [True, False])
def test_the_residual_is_checkpointed_and_a_resumed_run_equals_the_uninterrupted_one(
        keep_residuals):
    model, batches = mlp(), data(10)
    whole = _groups(model, OuterWire(), 9)
    _run(whole, batches, 0)

    first = _groups(model, OuterWire(), 9)
    _run(first, batches[:6], 0)  # a checkpoint after step 5, an outer step
    snaps = [copy.deepcopy((m.state_dict(), o.state_dict(), s.state_dict())) for m, o, s in first]
    assert all(snap[2]["residuals"] for snap in snaps)  # the residual is in the checkpoint
    resumed = _groups(mlp(), OuterWire(), 9)  # fresh processes: new weights, optimizers and syncs
    for (m, o, s), (ms, os_, ss) in zip(resumed, snaps):
        m.load_state_dict(ms)
        o.load_state_dict(os_)
        s.load_state_dict(ss if keep_residuals else {**ss, "residuals": {}})
    _run(resumed, batches, 6)
    diff = max_relative_difference(resumed[0][0].state_dict(), whole[0][0].state_dict())
    if keep_residuals:
        assert diff == 0, f"resumed run differs by {diff:.2e}"
    else:
        assert diff > 1e-4  # the residual matters: without it the resumed run is another


# -- a real job --------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_two_group_sparseloco_job_succeeds_and_a_recovered_run_equals_the_uninterrupted():
    """2 groups × 1 stage on 3 nodes; the second run loses group 1's node at step 10,
    rewinds to the checkpoint of step 8 (min_replicas=2) and replays from there."""
    steps, every = 20, 4
    data = digit_batches(steps)
    model = digits.make_model(hidden=32)
    sgd = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.5)
    config = DiLoCo.sparseloco(inner_steps=every)
    finals = []
    with LocalSwarm(n_nodes=3, lease=5.0) as swarm:
        client = swarm.client()
        for kill in (False, True):
            inj, running = swarm.inject(), []
            if kill:
                inj.at_step(10, "kill group 1", lambda running=running: swarm.kill(
                    PlanView(job_info(client, running[0]).plan)[StageKey(1, 0)].address))
            job = client.submit(model, nn.functional.cross_entropy, sgd, inj.feed(data),
                                steps=steps, microbatches=2, stages=1, replicas=2,
                                replica_sync=config, compression="none",
                                checkpoint_every=every, min_replicas=2, rebalance="never")
            running.append(job)
            inj.start(job.id)
            status = job.wait(timeout=150, progress=False)
            inj.stop()
            assert status.state == "SUCCEEDED", status
            info = job_info(client, job)
            assert len(info.recoveries) == (1 if kill else 0)
            finals.append(job.state_dict())
            job.release()
    diff = max_relative_difference(finals[1], finals[0])
    print(f"recovered vs uninterrupted SparseLoCo job: max relative difference {diff:.2e}")
    assert diff <= 1e-5
    assert max_relative_difference(finals[0], model.state_dict()) > 1e-3  # it trained


def test_the_settings_travel_in_the_job_config():
    from fedpipe.spec import JobSpec

    spec = JobSpec(steps=4, replica_sync="diloco", diloco=DiLoCo.sparseloco(3, feedback_decay=0.9))
    assert JobSpec.from_proto(spec.to_proto()).diloco == spec.diloco
    assert JobSpec.from_proto(JobSpec(steps=4, replica_sync="diloco").to_proto()).diloco \
        == DiLoCo()  # an older client's config: decay unset, plain error feedback
