"""A Hugging Face GPT-2 defined on the meta device trains over 3 nodes as the tied model
trains in one process (issue 22): its input embedding and its head are on different
stages, each keeping a copy whose gradients are summed every step (KIND_TIED between the
two stages), so the copies stay equal and the weights equal single-process training of
the tied ``transformers`` model within 1e-5 (float64).

Real processes: the session swarm (a tracker and 3 nodes on 127.0.0.1)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.hf import lm_loss, save_pretrained, sequential
from reference import max_relative_difference, microbatched

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]
VOCAB, SEQ, STEPS, BATCH, MICROBATCHES, SEED = 256, 16, 4, 4, 2, 13
ADAMW = fedpipe.optimizer(torch.optim.AdamW, lr=1e-2)


def _text_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    from pydoc_data.topics import topics

    data = torch.tensor(list("".join(topics[k] for k in sorted(topics))[:20000].encode()),
                        dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g).tolist()
        chunk = torch.stack([data[s:s + SEQ + 1] for s in starts])
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def _meta_gpt2():
    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0, embd_pdrop=0.0, resid_pdrop=0.0,
                        attn_pdrop=0.0)
    with torch.device("meta"):
        return sequential(GPT2LMHeadModel(config).to(torch.float64))


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits


def test_a_meta_gpt2_with_tied_embeddings_on_two_stages_trains_as_the_tied_model(swarm,
                                                                                tmp_path):
    adapted = _meta_gpt2()
    assert adapted.tied_parameters and all(t.is_meta for t in adapted.layers.parameters())
    # the reference: the tied transformers model with the weights the nodes make
    made = copy.deepcopy(adapted)
    fedpipe.materialize(made.layers, SEED, made.init_fn, ties=made.tied_parameters)
    save_pretrained(made, tmp_path / "start")
    tied = GPT2LMHeadModel.from_pretrained(tmp_path / "start", torch_dtype=torch.float64)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    want = microbatched(Logits(tied), lm_loss, ADAMW, _text_batches(), MICROBATCHES)

    job = swarm.client().submit(adapted.layers, lm_loss, ADAMW, _text_batches(), steps=STEPS,
                                microbatches=MICROBATCHES, schedule="1f1b", stages=3,
                                compression="none", seed=SEED, init_fn=adapted.init_fn,
                                ties=adapted.tied_parameters)
    status = job.wait(timeout=240, progress=False)
    assert status.state == "SUCCEEDED", status
    plan = sorted(status.plan.stages, key=lambda a: a.stage)
    last = len(adapted.layers) - 1
    assert plan[0].layer_start == 0 and plan[-1].layer_end == last + 1
    assert len({a.node_id for a in plan}) == 3
    got = job.state_dict()
    job.save(tmp_path / "saved")  # a stage at a time, under GPT-2's own names
    job.release()
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "saved", torch_dtype=torch.float64)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again
    x, _ = _text_batches()[0]
    trained = copy.deepcopy(adapted.layers)
    fedpipe.materialize(trained, SEED, adapted.init_fn, ties=adapted.tied_parameters)
    trained.load_state_dict(got)
    torch.testing.assert_close(loaded.eval()(x).logits, trained.eval()(x), rtol=0, atol=0)
    emb, head = got["0.tokens.weight"], got[f"{last}.lm_head.weight"]
    assert torch.equal(emb, head)  # the two copies stayed bit-for-bit equal
    ours = {adapted.names(int(k.split(".", 1)[0]), k.split(".", 1)[1])[0]: v
            for k, v in got.items()}
    theirs = {k.removeprefix("model."): v for k, v in want.items()}
    assert set(theirs) == set(ours)  # every tensor compared, the tied head's too
    assert max_relative_difference(ours, theirs) <= 1e-5
    start = {k.removeprefix("model."): v for k, v in Logits(tied).state_dict().items()}
    assert max_relative_difference(ours, start) > 1e-3  # it trained
