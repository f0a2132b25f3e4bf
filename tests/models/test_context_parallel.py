"""Context parallelism (DeepSpeed-Ulysses) at CP = 2 and 4, alone and with TP 2 and sequence parallelism, equals the
GPT in one process (fp32): logits, loss and every gathered gradient, both variants, llama with fewer KV heads than
CP (replicated), the prime vocabulary 101 (a multiple of no TP size), tiled MLP and loss; the mpu's groups are the
ones DeepSpeed reads."""
import pytest
import torch.distributed as dist
from dist import run_distributed
from test_tensor_parallel import CONFIGS, _batch, _reference, assert_matches_reference

from models import GPT, GPTConfig
from models.config import ConfigError
from models.parallel import Layout, full_state_dict, get_parallel_state, initialize_model_parallel, model_parallel_seed

TILING = ("tiled_mlp", "tiled_loss")


def _run_cp(rank, tp, cp, config, sequence_parallel):
    tiling = {k: v for k, v in config.items() if k in TILING}
    state = initialize_model_parallel(layout=Layout(tensor=tp, context=cp, sequence_parallel=sequence_parallel,
                                                    **tiling))
    model_parallel_seed(1234)
    model = GPT(GPTConfig(**{k: v for k, v in config.items() if k not in TILING}))
    ids, labels = _batch()
    logits = model(ids)
    loss = model(ids, labels)
    loss.backward()
    for p in model.parameters():  # what DeepSpeed's engine does over data x context: sum over the context group
        dist.all_reduce(p.grad, group=state.get_sequence_parallel_group())
    groups = {"sp": (state.get_sequence_parallel_rank(), state.get_sequence_parallel_world_size(),
                     dist.get_process_group_ranks(state.get_sequence_parallel_group())),
              "sdp": (state.get_sequence_data_parallel_rank(), state.get_sequence_data_parallel_world_size(),
                      dist.get_process_group_ranks(state.get_sequence_data_parallel_group())),
              "tp": dist.get_process_group_ranks(state.get_model_parallel_group())}
    return {"logits": logits.detach(), "loss": loss.detach(), "params": full_state_dict(model),
            "grads": full_state_dict(model, grads=True), "groups": groups}


CASES = {  # name: (variant config overrides, tp, cp, sequence parallel)
    "gpt2-cp2": ("gpt2", {}, 1, 2, False),
    "llama-cp2": ("llama", {}, 1, 2, False),
    "llama-kv1-cp4": ("llama", {"num_kv_heads": 1}, 1, 4, False),  # one KV head, four ranks: replicated 4x
    "gpt2-tp2-sp-cp2": ("gpt2", {}, 2, 2, True),
    "llama-kv2-tp2-sp-cp2": ("llama", {"num_kv_heads": 2}, 2, 2, True),  # one KV head per TP rank, CP 2
    # ALST's tiling (models/tiling.py) with TP and CP, against the untiled single process
    "llama-tp2-cp2-tiled": ("llama", {"tiled_mlp": 2, "tiled_loss": 3}, 2, 2, False),
    "gpt2-tp2-sp-cp2-tiled-loss": ("gpt2", {"tiled_loss": 2}, 2, 2, True),
}


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_equals_one_process(case):
    variant, overrides, tp, cp, sp = CASES[case]
    config = {**CONFIGS[variant], **overrides}
    ref = _reference({k: v for k, v in config.items() if not k.startswith("tiled_")})
    results = run_distributed(_run_cp, tp * cp, tp, cp, config, sp)
    for rank, res in enumerate(results):
        assert_matches_reference(res, ref, f"{case} rank {rank}")
        # layout (data, context, model), model innermost: context groups stride TP, data x context = context here
        assert res["groups"]["sp"] == (rank // tp, cp, [rank % tp + tp * c for c in range(cp)])
        assert res["groups"]["sdp"] == res["groups"]["sp"]
        assert res["groups"]["tp"] == [rank - rank % tp + t for t in range(tp)]


def test_refusals():
    config = GPTConfig(**CONFIGS["gpt2"], seq_length=12)
    with pytest.raises(ConfigError, match="seq_length 12 is not divisible by context_parallel 8"):
        config.check_parallel(1, context_parallel=8)
    with pytest.raises(ConfigError, match="the 2 attention heads of each tensor-parallel rank are not divisible by "
                                          "context_parallel 4"):
        GPTConfig(**CONFIGS["gpt2"], seq_length=8).check_parallel(2, context_parallel=4)
    with pytest.raises(ConfigError, match=r"context_parallel x tensor_parallel = 8 \(sequence parallelism\)"):
        config.check_parallel(2, context_parallel=4, sequence_parallel=True)
    assert get_parallel_state().get_sequence_parallel_world_size() == 1  # one process: no context group
