"""fastrwa.models.scoring: each token's log-probability given its past is the model's own
forward (float64 log-softmax over bytes and BOS), in one call or in pieces, and a step's
logits score as the forward's do (issue 61 item 3)."""

import math

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig
from fastrwa.models.scoring import score, scores_of

BOS = 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ByteLM(LMConfig(d_model=16, n_layers=2)).eval()


def test_score_is_the_forwards_log_softmax(model):
    ids = [BOS, *b"the cat", BOS, *"sat ☕".encode()]
    s = score(model, ids, top=3)
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    lp = logits[0].double().log_softmax(-1)
    assert math.isnan(s.logprobs[0]) and (s.top_ids[0] == -1).all()
    want = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.equal(s.logprobs[1:], want)
    assert torch.equal(s.top_logprobs[1:], lp[:-1].topk(3).values)
    assert torch.equal(s.next_logprobs, lp[-1])
    assert s.logprobs.dtype == torch.float64 and s.top_ids.shape == (len(ids), 3)


def test_score_in_pieces_carries_the_past(model):
    ids = [BOS, *b"a longer text, read in three pieces"]
    whole = score(model, ids, top=2)
    first = score(model, ids[:7], top=2)
    second = score(model, ids[7:20], top=2, past=first)
    empty = score(model, [], top=2, past=second)
    third = score(model, ids[20:], top=2, past=empty)
    joined = torch.cat([first.logprobs, second.logprobs, third.logprobs])
    assert torch.allclose(joined[1:], whole.logprobs[1:], rtol=1e-5, atol=1e-6)
    assert not second.logprobs.isnan().any()        # (its first token scored by the past)
    assert score(model, []).logprobs.shape == (0,)
    with pytest.raises(ValueError, match="top"):
        score(model, ids, top=258)


def test_scores_of_a_steps_logits(model):
    cache = model.allocate_cache(1)
    logits = model.prefill(torch.tensor([[BOS, *b"hi"]]), cache)
    lp, ids, top = scores_of(logits, [105], top=4)
    want = score(model, [BOS, *b"hi", 105], top=4)
    assert float(lp[0]) == pytest.approx(float(want.logprobs[-1]), rel=1e-6)
    assert ids.tolist() == want.top_ids[-1:].tolist()
    assert top.dtype == torch.float64 and top.shape == (1, 4)
