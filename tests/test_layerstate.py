"""Stage snapshots cut into per-layer pieces and re-assembled into other splits, in-process.

Two stages train with Adam and an LR schedule; their snapshots, re-split into three
stages, must continue bit for bit as the two-stage training does (and as one Adam
over the whole model does: Adam is per parameter).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedpipe.runtime import checkpoint, layerstate
from fedpipe.runtime.allreduce import StageSpan
from fedpipe.runtime.diloco import OuterSync
from fedpipe.spec import DiLoCo, StageKey


def model() -> nn.Sequential:
    torch.manual_seed(0)
    # a frozen layer (no optimizer state), a layer of buffers, one without parameters
    frozen = nn.Linear(8, 8)
    frozen.weight.requires_grad_(False)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), frozen, nn.BatchNorm1d(8), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 3))


class Stages:
    """A model cut at ``cuts``, each stage with its own Adam and LR schedule, trained as
    one pipeline would (one loss, each stage stepping its own optimizer)."""

    def __init__(self, net: nn.Sequential, cuts: list[int]):
        self.net, self.parts = net, []
        for a, b in zip(cuts, cuts[1:]):
            mod = nn.Sequential(*net[a:b])  # keys 0.., as a node builds a stage
            params = [p for p in mod.parameters() if p.requires_grad]
            opt = torch.optim.Adam(params, lr=0.01) if params else None  # as build_stage
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if opt else None
            self.parts.append({"layers": layerstate.Layout(mod, a), "module": mod,
                               "optimizer": opt, "lr_scheduler": sched})

    def train(self, steps: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            self.net.zero_grad()
            nn.functional.cross_entropy(self.net(x), y).backward()
            for p in self.parts:
                if p["optimizer"] is not None:
                    p["optimizer"].step()
                    p["lr_scheduler"].step()

    def snapshots(self, step: int) -> list[checkpoint.Snapshot]:
        return [checkpoint.take(p, step) for p in self.parts]


def resplit(snaps: list[checkpoint.Snapshot], cuts: list[int]) -> Stages:
    """A fresh model cut at ``cuts`` restored from ``snaps`` through layer pieces, the
    pieces passing the wire format on the way."""
    fresh = Stages(model(), cuts)
    for p, (a, b) in zip(fresh.parts, zip(cuts, cuts[1:])):
        pieces = [layerstate.split(s, a, b) for s in snaps]
        pieces = [checkpoint.from_frames(checkpoint.to_frames(x), 1 << 30)[1] for x in pieces]
        layerstate.restore(p, layerstate.merge([x for x in pieces if layerstate.layers(x)]))
    return fresh


@pytest.mark.parametrize("cuts", [[0, 2, 5, 7], [0, 7], [0, 1, 2, 3, 4, 5, 6, 7], [0, 4, 7]])
def test_adam_stages_resplit_continue_bit_for_bit(cuts):
    old = Stages(model(), [0, 3, 7])
    old.train(5, seed=1)
    new = resplit(old.snapshots(5), cuts)
    for a, b in zip(old.net.state_dict().values(), new.net.state_dict().values()):
        assert torch.equal(a, b)
    old.train(4, seed=2)
    new.train(4, seed=2)
    for k, v in old.net.state_dict().items():
        assert torch.equal(v, new.net.state_dict()[k]), k
    assert new.parts[-1]["lr_scheduler"].get_last_lr() == old.parts[-1]["lr_scheduler"] \
        .get_last_lr() == [0.01 * 0.5 ** 4]


def test_one_adam_over_the_whole_model_equals_the_resplit_stages():
    whole = model()
    opt = torch.optim.Adam([p for p in whole.parameters() if p.requires_grad], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    old = Stages(model(), [0, 3, 7])
    old.train(3, seed=1)
    new = resplit(old.snapshots(3), [0, 2, 5, 7])
    new.train(3, seed=2)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        for _ in range(3):
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(whole(x), y).backward()
            opt.step()
            sched.step()
    for k, v in whole.state_dict().items():
        assert torch.equal(v, new.net.state_dict()[k]), k


def test_a_piece_carries_only_its_layers_state():
    old = Stages(model(), [0, 3, 7])
    old.train(2, seed=1)
    snap = old.snapshots(2)[1]
    piece = layerstate.split(snap, 4, 5)  # the Linear(8, 8) at layer 4
    assert layerstate.layers(piece) == [4]
    lin = old.net[4]
    # weights and bias, Adam's exp_avg and exp_avg_sq of each, and its two step counters
    want = 3 * (lin.weight.nbytes + lin.bias.nbytes) + 2 * 4
    assert piece.nbytes == want
    assert layerstate.split(snap, 0, 3).skeleton.keys() == {layerstate.SHARED}


def test_pieces_that_miss_a_layer_or_disagree_are_refused():
    old = Stages(model(), [0, 3, 7])
    old.train(2, seed=1)
    a, b = old.snapshots(2)
    fresh = Stages(model(), [0, 5, 7])
    with pytest.raises(layerstate.SplitError, match="lack layer 4"):
        layerstate.restore(fresh.parts[0], layerstate.merge([layerstate.split(a),
                                                             layerstate.split(b, 3, 4)]))
    old.parts[1]["lr_scheduler"].step()  # the stages' schedules now disagree
    b2 = old.snapshots(2)[1]
    with pytest.raises(layerstate.SplitError, match="'lr_scheduler' differs"):
        layerstate.merge([layerstate.split(a), layerstate.split(b2)])
    with pytest.raises(layerstate.SplitError, match="layer 3 is in two"):
        layerstate.merge([layerstate.split(b), layerstate.split(b, 3, 4)])
    with pytest.raises(layerstate.SplitError, match="different steps"):
        layerstate.merge([layerstate.split(a), layerstate.split(old.snapshots(3)[1])])


def test_state_without_a_rule_or_a_layout_cannot_be_split():
    mod = nn.Sequential(*model()[0:3])
    snap = checkpoint.take({"layers": layerstate.Layout(mod, 0), "module": mod,
                            "weight_versions": mod}, 1)
    with pytest.raises(layerstate.SplitError, match=r"\['weight_versions'\] cannot be split"):
        layerstate.split(snap)
    old = checkpoint.take({"module": mod}, 1)
    with pytest.raises(layerstate.SplitError, match="no layer layout"):
        layerstate.split(old)
    checkpoint.restore({"layers": layerstate.Layout(mod, 0), "module": mod}, old)  # as before


def test_a_whole_stage_snapshot_refuses_a_stage_of_other_layers():
    old = Stages(model(), [0, 3, 7])
    snap = old.snapshots(0)[0]
    other = Stages(model(), [0, 2, 7])
    with pytest.raises(layerstate.SplitError, match="holds layers from 0"):
        layerstate.restore(other.parts[0], snap)


class Quiet:
    """A transport nothing is sent on (the outer state is only snapshotted here)."""


def outer(net: nn.Sequential, cuts: list[int], codec: str) -> list[dict]:
    spans = [StageSpan(StageKey(0, i), a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    out = []
    for span in spans:
        mod = nn.Sequential(*net[span.start:span.end])
        o = OuterSync(mod, span.key, spans, DiLoCo(inner_steps=2, compression=codec), [1.0],
                      Quiet())  # type: ignore[arg-type]
        out.append({"layers": layerstate.Layout(mod, span.start), "module": mod, "outer": o})
    return out


def test_diloco_outer_state_with_residuals_moves_by_layer():
    net = model()
    old = outer(net, [0, 3, 7], "int8")
    g = torch.Generator().manual_seed(3)
    for p in old:  # made-up outer state: global weights, momentum, residuals
        o = p["outer"]
        for seg in o.globals:
            for t in seg:
                t.copy_(torch.randn(t.shape, generator=g))
        for i, seg in enumerate(o.globals):
            o.optimizer.state[seg[0]]["momentum_buffer"] = torch.randn(seg[0].shape, generator=g)
            if i == 0:
                o.feedback.remember(i, torch.randn(sum(t.numel() for t in seg), generator=g))
        o.outer_step = 4
    snaps = [checkpoint.take(p, 8) for p in old]
    new = outer(copy.deepcopy(net), [0, 5, 7], "int8")
    for p, (a, b) in zip(new, [(0, 5), (5, 7)]):
        layerstate.restore(p, layerstate.merge([layerstate.split(s, a, b) for s in snaps]))
    flat_old = [t for p in old for seg in p["outer"].globals for t in seg]
    flat_new = [t for p in new for seg in p["outer"].globals for t in seg]
    assert all(torch.equal(a, b) for a, b in zip(flat_old, flat_new, strict=True))
    mom = [p["outer"].optimizer.state[t].get("momentum_buffer") for p in old
           for seg in p["outer"].globals for t in seg]
    got = [p["outer"].optimizer.state[t].get("momentum_buffer") for p in new
           for seg in p["outer"].globals for t in seg]
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(mom, got))
    assert all(p["outer"].outer_step == 4 for p in new)
    # residuals: flattened in parameter order, the old ones laid end to end (zeros where
    # an old segment owed none)
    def residual_of(stages):
        parts = []
        for p in stages:
            o = p["outer"]
            for i, seg in enumerate(o.globals):
                r = o.feedback.residual(i)
                parts.append(r if r is not None else torch.zeros(sum(t.numel() for t in seg)))
        return torch.cat(parts)
    assert torch.equal(residual_of(old), residual_of(new))
