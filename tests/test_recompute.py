"""Activation recomputation and bf16 mixed precision (issue 22, item 4).

Real processes: a tracker and 3 nodes on 127.0.0.1 (the session swarm). With
``recompute=True`` each stage keeps only its inputs and re-runs its forward in backward;
the trained weights must equal single-process training bit for bit, dropout included
(each layer's masks are seeded from the job's seed: :mod:`fedpipe.runtime.rng`, which the
reference uses too). ``precision="bf16-mixed"`` trains end to end with float32 weights.
In-process: what a recomputing stage keeps for backward, and that the seeds matter.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.runtime.async_stage import AsyncStageRunner
from fedpipe.runtime.rng import LayerSeeds
from fedpipe.runtime.stage import SyncStageRunner
from fedpipe.spec import JobSpecError, Kind
from reference import digit_batches, max_relative_difference, microbatched, not_bit_equal

STEPS, BATCH, MICROBATCHES = 4, 32, 4
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
LOSS = nn.functional.cross_entropy


def dropout_mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.3), nn.Linear(48, 48),
                         nn.Tanh(), nn.Dropout(0.3), nn.Linear(48, 10))


def _train(swarm, model, schedule: str, **kw) -> dict:
    job = swarm.client().submit(model, LOSS, SGD, digit_batches(STEPS, BATCH), steps=STEPS,
                                microbatches=MICROBATCHES, schedule=schedule, stages=3,
                                compression="none", **kw)
    status = job.wait(timeout=180, progress=False)
    assert status.state == "SUCCEEDED" and status.step == STEPS, status
    assert len({a.node_id for a in status.plan.stages}) == 3, "expected a 3-stage pipeline"
    got = job.state_dict()
    job.release()
    return got


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_recomputation_with_dropout_is_bit_equal_to_single_process_training(swarm):
    # GPipe: every stage recomputes all 4 microbatches (1F1B: the "auto" test below)
    model = dropout_mlp()
    expected = microbatched(model, LOSS, SGD, digit_batches(STEPS, BATCH), MICROBATCHES,
                            seed=5)
    # the masks matter: another seed trains other weights
    other = microbatched(model, LOSS, SGD, digit_batches(STEPS, BATCH), MICROBATCHES, seed=6)
    assert not_bit_equal(other, expected) != []
    got = _train(swarm, model, "gpipe", recompute=True, seed=5)
    assert not_bit_equal(got, expected) == []


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_bf16_mixed_precision_trains_end_to_end_with_float32_weights(swarm):
    model = dropout_mlp()
    fp32 = microbatched(model, LOSS, SGD, digit_batches(STEPS, BATCH), MICROBATCHES)
    got = _train(swarm, model, "1f1b", precision="bf16-mixed")
    assert all(t.dtype == torch.float32 for t in got.values())
    assert max_relative_difference(got, model.state_dict()) > 1e-3  # it trained
    diff = max_relative_difference(got, fp32)
    assert 0 < diff < 2e-2, f"bf16-mixed against fp32: max relative difference {diff:.2e}"


class Wires:
    """A stage's transport in one process: tensors handed in beforehand, sends kept."""

    def __init__(self, given: dict):
        self.given, self.sent = given, {}

    def recv(self, kind, step, tag, timeout=None):
        return self.given[(kind, step, tag)], BATCH

    def send(self, kind, step, microbatch, tensor, batch_size):
        self.sent[(kind, step, microbatch)] = tensor

    def send_to(self, *args, **kwargs):  # pragma: no cover - one stage, no peers
        raise AssertionError("a lone stage sends to no peer")


def test_a_bf16_mixed_stage_sends_bfloat16_activations_and_gradients():
    """What the planner prices a bf16-mixed boundary at (half of float32's bytes,
    ``fedpipe.planner.costs.boundary_bytes``): a middle stage's autocast output, sent as
    it is, and the gradient of its input, of its input's dtype."""
    sent = {}
    for precision in ("fp32", "bf16-mixed"):
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
        wires = Wires({(Kind.ACTIVATION, 0, 0): torch.randn(8, 64, dtype=dtype),
                       (Kind.GRADIENT, 0, 0): torch.ones(8, 32, dtype=dtype)})
        runner = SyncStageRunner(layers, None, None, "gpipe", 1, 3, 1, wires,
                                 precision=precision)
        list(runner.run(1))
        sent[precision] = {kind: t.dtype for (kind, _, _), t in wires.sent.items()}
    assert sent["fp32"] == {Kind.ACTIVATION: torch.float32, Kind.GRADIENT: torch.float32}
    assert sent["bf16-mixed"] == {Kind.ACTIVATION: torch.bfloat16, Kind.GRADIENT: torch.bfloat16}


def _saved_bytes(recompute: bool) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward after the forward of one microbatch through a
    middle stage of 4 layers of width 256, and the input's gradient after backward."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
    x = torch.randn(8, 256)
    wires = Wires({(Kind.ACTIVATION, 0, 0): x.clone(), (Kind.GRADIENT, 0, 0): torch.ones(8, 256)})
    runner = SyncStageRunner(layers, None, None, "gpipe", 1, 3, 1, wires, recompute=recompute,
                             seeds=LayerSeeds(layers, 1, seed=0))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kept = runner._forward(0, 0)
    runner._backward(0, 0, *kept)
    return sum(saved), wires.sent[(Kind.GRADIENT, 0, 0)]


def test_a_recomputing_stage_keeps_only_its_input_and_gets_the_same_gradient():
    full, grad = _saved_bytes(recompute=False)
    kept, grad_recomputed = _saved_bytes(recompute=True)
    assert kept == 8 * 256 * 4, f"kept {kept} bytes, not just the (8, 256) float32 input"
    assert full > 4 * kept
    assert torch.equal(grad, grad_recomputed)


def test_bad_recompute_and_precision_values_are_refused_naming_them():
    with pytest.raises(JobSpecError, match=r"recompute: must be True, False or \"auto\", "
                                           r"got str 'yes'"):
        fedpipe.spec.Knobs.gather({}, {"recompute": "yes"})
    with pytest.raises(JobSpecError, match=r"precision: must be one of \['fp32', "
                                           r"'bf16-mixed'\], got 'fp16'"):
        fedpipe.spec.Knobs.gather({}, {"precision": "fp16"})
    spec = fedpipe.spec.Knobs.gather({}, {"recompute": "auto", "precision": "bf16-mixed"}) \
        .job_spec(steps=1, optimizer=b"o", loss_fn=b"l")
    back = fedpipe.spec.JobSpec.from_proto(spec.to_proto())
    assert (back.recompute, back.precision) == ("auto", "bf16-mixed")
    assert fedpipe.spec.JobSpec.from_proto(
        fedpipe.spec.JobSpec(steps=1).to_proto()).recompute == "off"


def test_layer_seeds_repeat_a_layers_dropout_mask_and_differ_between_microbatches():
    layers = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5))
    seeds = LayerSeeds(layers, 0, seed=1)
    x = torch.ones(4, 64)
    with seeds.drawing(0, 0, x.device):
        a = layers(x)
    torch.rand(10)  # the process's own draws do not move the masks
    with seeds.drawing(0, 0, x.device):
        b = layers(x)
    with seeds.drawing(0, 1, x.device):
        c = layers(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = torch.get_rng_state()
    with seeds.drawing(2, 0, x.device):
        layers(x)
    assert torch.equal(torch.get_rng_state(), state)  # the global state is restored
    assert copy.deepcopy(layers)  # hooked layers still copy (checkpoints deep-copy them)


def _async_stage(recompute: bool) -> tuple[dict, list]:
    """A lone async stage (weight stashing: forwards through ``functional_call``) with
    dropout, 3 steps of 2 microbatches; its weights and losses."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    given = {}
    for step in range(3):
        for m in range(2):
            given[(Kind.INPUT, step, m)] = torch.randn(4, 8)
            given[(Kind.TARGET, step, m)] = torch.randint(0, 3, (4,))
    runner = AsyncStageRunner(layers, torch.optim.SGD(layers.parameters(), lr=0.1), LOSS, 0, 1,
                              2, Wires(given), max_staleness=1, recompute=recompute,
                              seeds=LayerSeeds(layers, 0, seed=3))
    return layers.state_dict(), [r.loss for r in runner.run(3)]


def test_recomputation_under_async_weight_stashing_is_bit_equal_with_dropout():
    plain, plain_losses = _async_stage(recompute=False)
    again, losses = _async_stage(recompute=True)
    assert not_bit_equal(again, plain) == [] and losses == plain_losses


def _load(mode: str, chosen: bool, precision: str = "fp32"):
    """Stage 1 of 2 of a Linear-Tanh-Linear job built as a node builds it, its plan's
    assignment marked ``recompute=chosen``; the stage's runner."""
    import cloudpickle

    from fedpipe.node.admission import BOUNDED_KINDS
    from fedpipe.node.mailbox import Mailbox
    from fedpipe.node.peers import ChannelPool, StagePeers
    from fedpipe.node.wiring import build_stage
    from fedpipe.proto import node_pb2
    from fedpipe.spec import JobSpec

    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    spec = JobSpec(steps=2, microbatches=2, batch_size=8, schedule="1f1b",
                   optimizer=cloudpickle.dumps(SGD), loss_fn=cloudpickle.dumps(LOSS),
                   recompute=mode, precision=precision).validate()
    plan = node_pb2.Plan(stages=[
        node_pb2.StageAssignment(replica=0, stage=s, node_id=f"n{s}", node_name=f"n{s}",
                                 address=f"127.0.0.1:{s + 1}", layer_start=a, layer_end=b,
                                 recompute=chosen and s == 1)
        for s, (a, b) in enumerate([(0, 2), (2, 3)])])
    request = node_pb2.LoadStageRequest(job_id="job", replica=0, stage=1, plan=plan,
                                        config=spec.to_proto(),
                                        layers=[cloudpickle.dumps(la) for la in layers[2:]])
    pool = ChannelPool()
    peers = StagePeers(pool)
    try:
        return build_stage(request, torch.device("cpu"), Mailbox(4, BOUNDED_KINDS), peers).runner
    finally:
        peers.close()


@pytest.mark.parametrize("mode, chosen, recomputes", [
    ("off", True, False), ("on", False, True), ("auto", True, True), ("auto", False, False)])
def test_a_node_recomputes_as_the_job_and_the_plans_choice_say(mode, chosen, recomputes):
    runner = _load(mode, chosen)
    assert runner.recompute is recomputes and not runner.mixed
    assert _load(mode, chosen, "bf16-mixed").mixed


def wide_dropout_mlp() -> nn.Sequential:
    """Few parameters, wide activations: with 256-sample microbatches its activations
    outweigh its state, so recomputation decides what fits."""
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, 64),
                         nn.Tanh(), nn.Dropout(0.3), nn.Linear(64, 10))


def _short_memory(model: nn.Sequential, spec) -> tuple[int, float, float]:
    """A node memory between the least a 3-stage split needs recomputing (A) and without
    (B), as the tracker prices it; and A, B."""
    import itertools

    from fedpipe.client.profile import profile_model
    from fedpipe.planner import stage_memory_bytes
    from fedpipe.planner.protoio import model_profile, train_config

    prof, cfg = model_profile(profile_model(model, torch.zeros(8, 64))), train_config(spec)
    L = len(model)

    def least(recompute: bool) -> float:
        return min(max(stage_memory_bytes(prof, a, b, cfg, s, 3, recompute=recompute)
                       for s, (a, b) in enumerate(zip((0, *cuts), (*cuts, L))))
                   for cuts in itertools.combinations(range(1, L), 2))

    a, b = least(True), least(False)
    return int((a + b) / 2), a, b


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_auto_recomputes_where_the_nodes_memory_is_short_and_stays_bit_equal():
    from fedpipe.spec import JobSpec
    from fedpipe.testing import LocalSwarm

    model, steps, batch = wide_dropout_mlp(), 3, 1024
    spec = JobSpec(steps=steps, microbatches=MICROBATCHES, batch_size=batch, schedule="1f1b",
                   stages=3, recompute="auto", checkpoint_every=100,
                   optimizer_kind=SGD.kind)  # priced as the tracker prices the job it submits
    memory, least_recomputing, least_plain = _short_memory(model, spec)
    assert least_plain > 1.2 * least_recomputing  # recomputation decides what fits
    batches = digit_batches(steps, batch)
    expected = microbatched(model, LOSS, SGD, batches, MICROBATCHES, seed=2)
    with LocalSwarm(n_nodes=3, node_args=["--memory-limit", str(memory)]) as swarm:
        job = swarm.client().submit(model, LOSS, SGD, batches, steps=steps,
                                    microbatches=MICROBATCHES, schedule="1f1b", stages=3,
                                    compression="none", recompute="auto", seed=2,
                                    checkpoint_every=100)
        status = job.wait(timeout=180, progress=False)
        assert status.state == "SUCCEEDED" and status.step == steps, status
        chosen = [a.recompute for a in sorted(status.plan.stages, key=lambda a: a.stage)]
        got = job.state_dict()
        job.release()
    assert any(chosen) and len(chosen) == 3, f"recompute per stage: {chosen}"
    assert not_bit_equal(got, expected) == []
