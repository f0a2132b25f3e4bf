"""Evaluation of the project GPT: tensor-parallel (and data-parallel) scoring equals TP=1."""
import pytest
import torch

from dist import run_distributed
from models import GPT, GPTConfig
from models.parallel import destroy_model_parallel, initialize_model_parallel, model_parallel_seed
from pipeline.evaluation.lm_scoring import (ByteTokenizer, DataShard, GPTScorer, LambadaExample, evaluate_lambada,
                                            score_token_stream, vocab_parallel_argmax)

# A byte-level model: vocabulary 257 (256 bytes + a start token) is prime, so every TP size pads it
# differently (264 at TP1, 272 at TP2 with the multiple 8) and the padding columns must stay out.
CONFIG = dict(variant="gpt2", vocab_size=257, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=32,
              make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
SEED = 1234
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness, it was the epoch of belief.")
PASSAGES = [("The cat sat on the", "mat"), ("She opened the door and saw her", "brother"),
            ("A much longer passage that will not fit in the window of the model, so it loses its", "beginning"),
            ("x", "y"), ("Call me", "Ishmael")]


def _evaluate(rank, tp):
    initialize_model_parallel(tensor_parallel=tp)
    model_parallel_seed(SEED)
    scorer = GPTScorer(GPT(GPTConfig(**CONFIG)))
    shard = DataShard.current()
    tokenizer = ByteTokenizer(start_id=256)
    ids = [256] + tokenizer.encode(TEXT)
    stream = score_token_stream(scorer, ids, context_length=24, stride=7, batch_size=3, shard=shard, progress=False)
    examples = [LambadaExample(c, t, i + 1) for i, (c, t) in enumerate(PASSAGES)]
    lambada = evaluate_lambada(scorer, tokenizer, examples, context_length=31, batch_size=2, shard=shard,
                               progress=False)
    greedy = scorer(torch.tensor([ids[:33], ids[40:73]]), greedy=True).greedy

    # Ties across shards go to the lowest index; padding columns (>= 257) never win.
    padded = 264 if tp == 1 else 272
    full = torch.zeros(3, padded)
    full[0, [10, 200]] = 5.0      # the same maximum in both TP=2 shards
    full[1, 150] = 5.0
    full[2, 5], full[2, 260] = 4.0, 9.0  # 260 is padding
    local = full.chunk(tp, dim=-1)[rank % tp]
    ties = vocab_parallel_argmax(local, vocab_size=257)
    return {"token_nll": stream.token_nll, "times": stream.times_scored, "context": stream.context,
            "lambada": lambada, "greedy": greedy, "ties": ties}


@pytest.fixture(scope="module")
def reference():
    destroy_model_parallel()
    out = _evaluate(0, 1)
    destroy_model_parallel()
    return out


@pytest.mark.parametrize("tp, world_size", [(2, 2), (2, 4)])  # world 4: two data-parallel replicas of TP=2
def test_tp_scoring_equals_tp1(reference, tp, world_size):
    ref = reference
    assert ref["times"].tolist() == [0] + [1] * (len(TEXT))
    assert ref["ties"].tolist() == [10, 150, 5]
    for rank, res in enumerate(run_distributed(_evaluate, world_size, tp)):
        torch.testing.assert_close(res["token_nll"], ref["token_nll"], rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(res["times"], ref["times"]) and torch.equal(res["context"], ref["context"])
        assert torch.equal(res["greedy"], ref["greedy"]), rank
        assert res["ties"].tolist() == [10, 150, 5]
        lam, ref_lam = res["lambada"], ref["lambada"]
        assert {k: v for k, v in lam.items() if k != "target_perplexity"} == \
               {k: v for k, v in ref_lam.items() if k != "target_perplexity"}
        assert lam["target_perplexity"] == pytest.approx(ref_lam["target_perplexity"], rel=1e-5)
