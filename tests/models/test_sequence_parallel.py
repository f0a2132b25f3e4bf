"""Sequence parallelism (Korthikanti et al. 2022) at TP = 2 and 4 equals the GPT at TP = 1 (fp32):
logits, loss and every gathered gradient; the conjugate ops; dropout in the sequence-split region."""
import pytest
import torch
from dist import run_distributed
from test_tensor_parallel import CONFIGS, _batch, _reference, assert_matches_reference

from models import GPT, GPTConfig
from models.gpt import Embedding
from models.parallel import (
    Layout,
    full_state_dict,
    gather_from_sequence_parallel_region,
    initialize_model_parallel,
    is_sequence_parallel,
    model_parallel_seed,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    tp_rank,
)


def _run_sp(rank, tp, config):
    initialize_model_parallel(layout=Layout(tensor=tp, sequence_parallel=True))
    model_parallel_seed(1234)
    model = GPT(GPTConfig(**config))
    ids, labels = _batch()
    logits = model(ids)
    loss = model(ids, labels)
    loss.backward()
    marked = sorted(n for n, p in model.named_parameters() if is_sequence_parallel(p))
    return {"logits": logits.detach(), "loss": loss.detach(), "params": full_state_dict(model),
            "grads": full_state_dict(model, grads=True), "marked": marked}


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_equals_tp1(variant, tp):
    ref = _reference(CONFIGS[variant])
    results = run_distributed(_run_sp, tp, tp, CONFIGS[variant])
    for rank, res in enumerate(results):
        assert_matches_reference(res, ref, f"{variant} TP={tp} SP rank {rank}")
        # the parameters of the sequence-split region: every norm, the row-parallel biases, the positions
        norms = [n for n in ref["params"] if "norm" in n]
        biases = [n for n in ref["params"] if n.endswith(("dense.bias", "fc_out.bias"))]
        positions = [n for n in ref["params"] if "position_embeddings" in n]
        assert res["marked"] == sorted(norms + biases + positions)
        assert norms and (variant == "llama" or (biases and positions))


def _ops_and_dropout(rank, tp):
    initialize_model_parallel(tensor_parallel=tp)
    model_parallel_seed(1234)
    out = {}
    full = torch.arange(2 * 8 * 3, dtype=torch.float64).view(2, 8, 3).requires_grad_()
    local = scatter_to_sequence_parallel_region(full)
    (local * (rank + 1)).sum().backward()
    out["scatter"], out["scatter_grad"] = local.detach(), full.grad.clone()
    x = (torch.arange(2 * 4 * 3, dtype=torch.float64).view(2, 4, 3) + 100 * rank).requires_grad_()
    gathered = gather_from_sequence_parallel_region(x)
    (gathered * (rank + 1)).sum().backward()  # a partial gradient per rank: reduce-scattered
    out["gather"], out["gather_grad"] = gathered.detach(), x.grad.clone()
    y = (torch.ones(2, 8, 3, dtype=torch.float64) * (rank + 1)).requires_grad_()
    rs = reduce_scatter_to_sequence_parallel_region(y)
    (rs * torch.arange(4, dtype=torch.float64).view(1, 4, 1) * (rank + 1)).sum().backward()
    out["rs"], out["rs_grad"] = rs.detach(), y.grad.clone()
    # dropout of the sequence-split region: the same input chunk on both ranks, different masks
    config = GPTConfig(**{**CONFIGS["gpt2"], "hidden_dropout": 0.5, "variant": "llama", "tie_embeddings": False})
    emb = Embedding(config, Layout(tensor=tp, sequence_parallel=True), init_seed=0).train()
    out["dropped"] = emb(torch.full((1, 8), 7)).detach()
    out["tp_rank"] = tp_rank()
    try:
        emb(torch.full((1, 7), 7))
    except ValueError as e:
        out["odd_error"] = str(e)
    return out


def test_conjugate_ops_and_dropout_masks():
    a, b = run_distributed(_ops_and_dropout, 2, 2)
    full = torch.arange(2 * 8 * 3, dtype=torch.float64).view(2, 8, 3)
    assert torch.equal(a["scatter"], full[:, :4]) and torch.equal(b["scatter"], full[:, 4:])
    assert torch.equal(a["scatter_grad"], torch.cat([torch.ones(2, 4, 3), 2 * torch.ones(2, 4, 3)], 1).double())
    assert torch.equal(a["gather"], b["gather"]) and torch.equal(a["gather"][:, 4:] - a["gather"][:, :4],
                                                                 torch.full((2, 4, 3), 100.0).double())
    assert torch.equal(a["gather_grad"], torch.full((2, 4, 3), 3.0).double())  # 1 + 2 from the two ranks
    assert torch.equal(a["rs"], torch.full((2, 4, 3), 3.0).double()) and torch.equal(b["rs"], a["rs"])
    ramp = torch.arange(4, dtype=torch.float64).view(1, 4, 1).expand(2, 4, 3)
    assert torch.equal(a["rs_grad"], torch.cat([ramp, 2 * ramp], 1)) and torch.equal(b["rs_grad"], a["rs_grad"])
    # each rank embeds the same token at its own positions (no position table in llama): the chunks differ
    # only by their dropout masks, which the model-parallel RNG makes different across TP ranks
    mask_a, mask_b = a["dropped"] == 0, b["dropped"] == 0
    assert a["dropped"].shape == (1, 4, 32) and mask_a.any() and not torch.equal(mask_a, mask_b)
    assert "sequence length 7 (dimension 1) is not divisible by tensor-parallel size 2" in a["odd_error"]
