"""DiLoCo outer steps across replica groups: the algorithm with threads, then real processes.

The unit tests run :class:`OuterSync` of every holder in a thread of its own,
with messages passed in memory (encoded and decoded as on the wire). The
end-to-end tests pin a plan of 2 replica groups of 2 stages (``replicas=2,
stages=2``).
"""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.runtime.allreduce import StageSpan
from fedpipe.runtime.diloco import OuterSync, staleness_weight
from fedpipe.spec import DiLoCo, StageKey
from fedpipe.testing import LocalSwarm
from fedpipe.testing.outer import OuterWire
from fedpipe.spec import SpecError
from reference import max_relative_difference, single_process

pytestmark = pytest.mark.timeout(240)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4)).double()


def data(steps, batch=32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


# group 0 holds every layer in one stage; group 1 splits them in two
SPLITS = [[(0, 5)], [(0, 2), (2, 5)]]


def train_groups(model, batches, shares, config, inner, splits=SPLITS, wire=None, **kw):
    """Train one copy of ``model`` per group, each on its share of every batch,
    with an OuterSync per stage; returns the groups' models and syncs."""
    wire = wire or OuterWire()
    spans = [StageSpan(StageKey(r, s), a, b) for r, split in enumerate(splits)
             for s, (a, b) in enumerate(split)]
    models = [copy.deepcopy(model) for _ in splits]
    holders = []
    for span in spans:
        r, a, b = span.key.replica, span.start, span.end
        sync = OuterSync(models[r][a:b], span.key, spans, config, shares,
                         wire.transport(span.key), **kw)
        holders.append((inner.build(models[r][a:b].parameters()), sync))
    total = sum(shares)
    for step, (x, y) in enumerate(batches):
        cuts = torch.tensor(shares).cumsum(0)[:-1] * len(x) // total
        for m, xs, ys in zip(models, x.tensor_split(cuts), y.tensor_split(cuts)):
            (nn.functional.cross_entropy(m(xs), ys) * (len(xs) / len(x))).backward()

        def run(opt, sync, step=step):
            sync.rescale_gradients(step)
            opt.step()
            opt.zero_grad()
            sync(step)
        threads = [threading.Thread(target=run, args=h) for h in holders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    return models, [sync for _, sync in holders]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_h1_outer_lr1_equals_synchronous_sgd_with_unequal_shares_and_splits(momentum):
    model, batches = mlp(), data(5)
    spec = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=momentum)
    expected = single_process(model, nn.functional.cross_entropy, spec, batches)
    models, _ = train_groups(model, batches, [3, 1], DiLoCo(1, 1.0, 0.0), spec)
    for m in models:
        diff = max_relative_difference(m.state_dict(), expected)
        assert diff <= 1e-12, f"max relative difference {diff:.2e}"
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def diloco_reference(model, batches, shares, config, spec):
    """DiLoCo written out plainly: each replica trains alone on its shard's mean loss."""
    glob = copy.deepcopy(model)
    outer = torch.optim.SGD(glob.parameters(), lr=config.outer_lr,
                            momentum=config.outer_momentum, nesterov=True)
    replicas = [copy.deepcopy(model) for _ in shares]
    inner = [spec.build(m.parameters()) for m in replicas]
    total = sum(shares)
    cuts = torch.tensor(shares).cumsum(0)[:-1] * len(batches[0][0]) // total
    for step, (x, y) in enumerate(batches):
        for m, opt, xs, ys in zip(replicas, inner, x.tensor_split(cuts), y.tensor_split(cuts)):
            nn.functional.cross_entropy(m(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        if (step + 1) % config.inner_steps == 0 or step == len(batches) - 1:
            with torch.no_grad():
                for g, *ps in zip(glob.parameters(), *(m.parameters() for m in replicas)):
                    g.grad = sum(s / total * (g - p) for s, p in zip(shares, ps))
            outer.step()
            for m in replicas:
                m.load_state_dict(glob.state_dict())
    return glob.state_dict()


def test_outer_nesterov_over_h_steps_matches_plain_diloco_and_groups_agree():
    model, batches = mlp(), data(7)  # outer steps after steps 3, 6 and the last, 7
    config = DiLoCo(3, 0.7, 0.9)
    spec = fedpipe.optimizer(torch.optim.AdamW, lr=1e-2)
    expected = diloco_reference(model, batches, [1, 1], config, spec)
    models, _ = train_groups(model, batches, [1, 1], config, spec, last_step=len(batches) - 1)
    for m in models:
        assert max_relative_difference(m.state_dict(), expected) <= 1e-10
    assert max_relative_difference(models[0].state_dict(), model.state_dict()) > 1e-3


@pytest.mark.parametrize("codec", ["bf16", "int8:64+zstd"])
def test_lossy_codecs_keep_groups_identical(codec):
    model, batches = mlp(), data(6)
    spec = fedpipe.optimizer(torch.optim.SGD, lr=0.1)
    plain, _ = train_groups(model, batches, [1, 1], DiLoCo(2, 0.7, 0.9), spec)
    models, _ = train_groups(model, batches, [1, 1], DiLoCo(2, 0.7, 0.9, codec), spec)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    assert 0 < max_relative_difference(models[0].state_dict(), plain[0].state_dict()) < 1e-2


def two_replicas(wire: OuterWire, **sync_args):
    """Two replica groups of one zeroed Linear(1, 1) stage each over ``wire``, DiLoCo(H=1,
    outer lr 1, no momentum) to step 2: their models and OuterSyncs."""
    spans = [StageSpan(StageKey(0, 0), 0, 1), StageSpan(StageKey(1, 0), 0, 1)]
    models = [nn.Sequential(nn.Linear(1, 1, bias=False)).double() for _ in range(2)]
    for m in models:
        nn.init.zeros_(m[0].weight)
    syncs = [OuterSync(m, StageKey(r, 0), spans, DiLoCo(1, 1.0, 0.0), [1, 1],
                       wire.transport(StageKey(r, 0)), last_step=2, **sync_args)
             for r, m in enumerate(models)]
    return models, syncs


def test_late_replica_does_not_stall_and_is_applied_with_its_staleness_weight():
    """Replica 1's outer step 0 reaches replica 0 only after replica 0's step 1,
    its step 1 only after replica 0 went on too; the last step (2) waits for both.
    Each wait of replica 0 before the last step is bounded by the grace (1 s)."""
    gate = threading.Event()
    wire = OuterWire(lambda src, k: gate if (src, k) == (1, 0) else None)
    models, syncs = two_replicas(wire, grace_floor=1.0)
    moves = [[1.0, 4.0, 16.0], [2.0, 8.0, 32.0]]  # each inner step lowers the weight by this
    seen = [[], []]
    zero_done_1 = threading.Event()

    def replica(r):
        for step in range(3):
            if r == 1 and step == 1:
                zero_done_1.wait(10)
            with torch.no_grad():
                models[r][0].weight -= moves[r][step]
            t0 = time.monotonic()
            syncs[r](step)
            seen[r].append((models[r][0].weight.item(), time.monotonic() - t0))
            if r == 0 and step == 1:
                zero_done_1.set()
                threading.Timer(0.5, gate.set).start()

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    (w0, t0), (w1, t1), (w2, t2) = seen[0]
    # step 0: replica 0 waits the 1 s grace, then averages what came (itself)
    assert w0 == -1.0 and 0.5 < t0 < 3.0
    assert seen[1][0][0] == -(0.5 * 1 + 0.5 * 2)  # replica 1 had both
    # step 1: replica 1 still owes step 0: replica 0 waits for it within the grace (it is
    # held back until after), then, still owed, takes replica 1 for behind: it does not
    # wait for its step 1 beyond that
    assert w1 == -1.0 - 4.0 and 0.5 < t1 < 3.0
    # step 2, the last: waits for everything; step 0 weighs 1/3, step 1 1/2 of its share
    late = staleness_weight(2) * 0.5 * 2.0 + staleness_weight(1) * 0.5 * 8.0
    assert w2 == pytest.approx(w1 - (0.5 * 16 + 0.5 * 32 + late), rel=1e-12) and t2 > 0.2
    assert (syncs[0].missed, syncs[0].late_applied, syncs[0].owed) == (2, 2, [])
    assert (syncs[1].missed, syncs[1].late_applied) == (0, 0)
    assert seen[1][2][0] == -1.5 - (0.5 * 4 + 0.5 * 8) - (0.5 * 16 + 0.5 * 32)


def test_a_pseudo_gradient_late_once_is_waited_for_within_the_next_grace():
    """Replica 1 is not behind, but its outer step 0 message is slow on the way (held
    until 0.3 s into replica 0's step 1), and its step 1 comes 0.1 s into it: replica 0
    waits for both within step 1's grace and applies both then (before December 2026
    it took replica 1 for behind and missed its step 1 too)."""
    gate, entered = threading.Event(), threading.Event()
    wire = OuterWire(lambda src, k: gate if (src, k) == (1, 0) else None)
    models, syncs = two_replicas(wire, grace_floor=2.0)
    moves = [[1.0, 4.0, 16.0], [2.0, 8.0, 32.0]]
    seen: list[list[float]] = [[], []]

    def replica(r):
        for step in range(3):
            if r == 1 and step == 1:
                entered.wait(10)
                time.sleep(0.1)
            with torch.no_grad():
                models[r][0].weight -= moves[r][step]
            if r == 0 and step == 1:
                entered.set()
                threading.Timer(0.3, gate.set).start()
            syncs[r](step)
            seen[r].append(models[r][0].weight.item())

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen[0][0] == -1.0  # step 0: the grace passed without replica 1's
    # step 1: replica 1's step 0 (2.0) with staleness weight 1/2 of its share 1/2,
    # and both step 1 pseudo-gradients on time
    assert seen[0][1] == -1.0 - (0.5 * 4 + 0.5 * 8 + staleness_weight(1) * 0.5 * 2.0)
    assert (syncs[0].missed, syncs[0].late_applied, syncs[0].owed) == (1, 1, [])


def test_bad_settings_are_refused():
    stages = [StageSpan(StageKey(0, 0), 0, 1)]
    m = nn.Sequential(nn.Linear(1, 1))
    with pytest.raises(SpecError, match="int9"):
        DiLoCo(compression="int9")
    with pytest.raises(ValueError, match="shares"):
        OuterSync(m, StageKey(0, 0), stages, DiLoCo(), [0], None)


class Recording:
    """A transport that records every call and delivers nothing."""

    def __init__(self):
        self.calls = []

    def send_to(self, *a, **kw):
        self.calls.append(("send_to", a, kw))

    def send(self, *a):
        self.calls.append(("send", a))

    def recv(self, *a, **kw):
        self.calls.append(("recv", a, kw))
        raise TimeoutError


def test_stage_without_parameters_takes_no_outer_step():
    transport = Recording()
    calls = transport.calls
    sync = OuterSync(nn.Sequential(nn.ReLU()), StageKey(0, 0),
                     [StageSpan(StageKey(0, 0), 0, 1), StageSpan(StageKey(1, 0), 0, 1)],
                     DiLoCo(1), [1, 1], transport, last_step=0)
    sync.rescale_gradients(0)
    sync(0)
    assert calls == [], "a stage without parameters must neither send nor wait"


# -- real processes ----------------------------------------------------------
def plan_of(job, timeout=60.0):
    """The job's plan once it has one: two groups of two stages."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job.status()
        if status.plan.stages:
            break
        assert status.state not in ("FAILED", "CANCELLED"), str(status)
        time.sleep(0.1)
    groups = {a.replica for a in status.plan.stages}
    assert len(groups) == 2 and len(status.plan.stages) == 4, status.plan.summary
    return status.plan


def replica_state(job, plan, replica):
    """The weights of one replica group, fetched from its stages."""
    from fedpipe import net
    from fedpipe.proto import node_pb2
    from fedpipe.wire import frames, rpc

    out = {}
    for a in plan.stages:
        if a.replica == replica:
            stub = rpc.NodeStub(net.channel(a.address))
            for head, t in frames.read_tensors(stub.FetchState(node_pb2.FetchStateRequest(
                    job_id=job.id, replica=replica, stage=a.stage), timeout=60)):
                out[head.name] = t
    return out


@pytest.mark.processes
def test_diloco_h1_equals_allreduce_and_single_process_sgd():
    """2 groups × 2 stages (pinned)."""
    x, y, _, _ = digits.load()
    gen = digits.batches(x, y, 1024)
    batches = [next(gen) for _ in range(4)]
    model = digits.make_model(hidden=128)
    sgd = fedpipe.optimizer(torch.optim.SGD, lr=0.5)
    expected = single_process(model, nn.functional.cross_entropy, sgd, batches)
    with LocalSwarm(n_nodes=4) as swarm:
        client = swarm.client()
        for sync in (DiLoCo(inner_steps=1, outer_lr=1.0, outer_momentum=0.0), "allreduce"):
            job = client.submit(model, nn.functional.cross_entropy, sgd, batches, steps=4,
                                microbatches=4, stages=2, replicas=2, compression="none",
                                replica_sync=sync)
            plan = plan_of(job)
            job.wait(timeout=90, progress=False)
            got = job.state_dict()
            diff = max_relative_difference(got, expected)
            print(f"{sync}: {plan.summary}; max relative difference {diff:.2e}")
            assert diff <= 1e-5, f"{sync}: max relative difference {diff:.2e}"
            if isinstance(sync, DiLoCo):
                other = max_relative_difference(replica_state(job, plan, 1), got)
                assert other <= 1e-6, f"groups differ by {other:.2e}"
            job.release()
    assert max_relative_difference(expected, model.state_dict()) > 1e-3


SLOW_GROUP = {
    # everything node3 sends: about 10x slower than loopback (~200 MB/s here)
    # and 250 ms later, so node3's group (a round trip of at least one latency
    # a step) falls behind by more than the 2 s grace period every 10 steps
    "links": [{"from": "node3", "to": "*", "mbps": 160, "latency_ms": 250, "oneway": True}],
}


@pytest.mark.processes
def test_diloco_with_one_replica_behind_a_slow_link_finishes_and_converges():
    """The group with node3 is behind: the other group stops waiting for it
    after the grace period and applies its pseudo-gradients late, discounted.
    Groups are pinned (replicas=2, stages=2)."""
    x_train, y_train, x_test, y_test = digits.load()
    model = digits.make_model(hidden=128)
    with LocalSwarm(n_nodes=4, link_profile=SLOW_GROUP) as swarm:
        client = swarm.client()
        job = client.submit(model, nn.functional.cross_entropy,
                            fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                            digits.batches(x_train, y_train, 128), steps=80, microbatches=2,
                            stages=2, replicas=2, compression="none",
                            replica_sync=DiLoCo(inner_steps=10, compression="int8"))
        plan_of(job)
        status = job.wait(timeout=120, progress=False)
        assert status.state == "SUCCEEDED"
        accuracy = digits.accuracy(job.model(), x_test, y_test)
        job.release()
        logs = "".join(swarm.log(p) for p in swarm.nodes)
    late, missed = logs.count("applied replica"), logs.count("within the grace period")
    print(f"held-out accuracy {accuracy:.4f}; pseudo-gradients that missed the grace "
          f"period: {missed}, applied late: {late}")
    assert late >= 1, "no replica was late: the slow link did not slow a group enough"
    assert accuracy >= 0.9


def test_a_failed_holder_on_the_outer_wire_stops_its_peers_waiting():
    # benchmarks/sparseloco.py hung for good when one group's thread failed: the other
    # waited for its outer messages with no timeout
    wire = OuterWire()
    me = wire.transport(StageKey(0, 0))
    got: list[BaseException] = []

    def wait() -> None:
        try:
            me.recv(fedpipe.spec.Kind.OUTER, 5, 0)
        except RuntimeError as e:
            got.append(e)
    waiter = threading.Thread(target=wait)
    waiter.start()
    wire.fail(ValueError("group 1 broke"))
    waiter.join(10)
    assert not waiter.is_alive()
    assert "a peer of" in str(got[0]) and "group 1 broke" in str(got[0])
