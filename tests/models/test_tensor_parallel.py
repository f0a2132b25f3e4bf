"""The GPT at TP = 2 and 4 equals the GPT at TP = 1: logits, loss, every gradient (fp32)."""
import pytest
import torch

from dist import run_distributed
from models import GPT, GPTConfig
from models.parallel import destroy_model_parallel, full_state_dict, initialize_model_parallel, model_parallel_seed

# vocab 101 is prime, so it is a multiple of no TP size; padding multiple 8 gives
# padded vocabularies 104 (TP1), 112 (TP2), 128 (TP4): the padding itself differs.
CONFIGS = {
    "gpt2": dict(variant="gpt2", vocab_size=101, hidden_size=32, num_layers=2, num_heads=4,
                 max_position_embeddings=16, make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0),
    "llama": dict(variant="llama", vocab_size=101, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=4,
                  ffn_hidden_size=48, max_position_embeddings=16, make_vocab_size_divisible_by=8, tie_embeddings=False,
                  hidden_dropout=0.0, attention_dropout=0.0),
}
SEED = 1234


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 101, (3, 13), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :4] = -100  # ignored positions must stay ignored at every TP size
    return tokens[:, :-1], labels


def _run(rank, tp, config):
    initialize_model_parallel(tensor_parallel=tp)
    model_parallel_seed(SEED)
    model = GPT(GPTConfig(**config))
    ids, labels = _batch()
    logits = model(ids)
    loss = model(ids, labels)
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(), "params": full_state_dict(model),
            "grads": full_state_dict(model, grads=True)}


def _reference(config):
    destroy_model_parallel()
    out = _run(0, 1, config)
    destroy_model_parallel()
    return out


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_tp1(variant, tp):
    ref = _reference(CONFIGS[variant])
    results = run_distributed(_run, tp, tp, CONFIGS[variant])
    for rank, res in enumerate(results):
        assert_matches_reference(res, ref, f"{variant} TP={tp} rank {rank}")


def assert_matches_reference(res: dict, ref: dict, label: str) -> None:
    """Same initial weights; logits, loss and every gathered gradient within 1e-5 relative."""
    assert res["params"].keys() == ref["params"].keys()
    for name in ref["params"]:  # same initial weights whatever the TP size
        assert torch.equal(res["params"][name], ref["params"][name]), name
    diffs = {"logits": _max_rel(res["logits"], ref["logits"]), "loss": _max_rel(res["loss"], ref["loss"])}
    assert res["grads"].keys() == ref["grads"].keys()
    for name in ref["grads"]:
        diffs[name] = _max_rel(res["grads"][name], ref["grads"][name])
    worst = max(diffs, key=diffs.get)
    print(f"{label}: max relative difference {diffs[worst]:.2e} ({worst})")
    assert diffs[worst] < 1e-5, (worst, diffs[worst])
