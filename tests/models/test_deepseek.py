"""DeepSeek-V3's and Qwen2-MoE's MoE layers (models/router.py, models/moe.py, models/grouped_experts.py) against
transformers' own ``DeepseekV3MoE`` and ``Qwen2MoeSparseMoeBlock`` (tiny random ones, fp32, weights copied): sigmoid
group-limited routing with a balancing bias, the routed scaling, shared experts (plain and gated); the grouped
expert products against the per-expert loop; the balancing bias's update and the sequence-wise loss against hand
computations; TP2 and EP2 against one process (one 2-rank launch)."""
import pytest
import torch
from transformers import DeepseekV3Config, Qwen2MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from dist import run_distributed
from models.config import ConfigError, GPTConfig
from models.grouped_experts import grouped_linear, grouped_mm_fits, padded_grouped_linear
from models.moe import MoEMLP, forget_expert_groups, update_expert_biases
from models.parallel import destroy_model_parallel, full_state_dict, initialize_model_parallel
from models.router import RouterPolicy, balance_loss, select_experts

H, F_EXPERT, E, K = 32, 16, 16, 4
DEEPSEEK = dict(variant="llama", vocab_size=64, hidden_size=H, num_layers=2, num_heads=4, ffn_hidden_size=48,
                max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, num_experts=E, moe_top_k=K,
                moe_ffn_hidden_size=F_EXPERT, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                moe_shared_expert_intermediate_size=2 * F_EXPERT, moe_router_load_balancing_type="seq_aux_loss",
                moe_aux_loss_coeff=1e-4)
QWEN2 = dict(DEEPSEEK, moe_router_score_function="softmax", moe_router_num_groups=None, moe_router_group_topk=None,
             moe_router_topk_scaling_factor=1.0, moe_router_enable_expert_bias=False, moe_norm_topk_prob=False,
             moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True,
             moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)


def _hf_deepseek_moe():
    torch.manual_seed(0)
    c = DeepseekV3Config(hidden_size=H, moe_intermediate_size=F_EXPERT, n_routed_experts=E, num_experts_per_tok=K,
                         n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=2)
    moe = DeepseekV3MoE(c).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.gate.e_score_correction_bias.normal_(std=0.1)  # the bias moves the selection
    return moe


def _hf_qwen2_moe():
    torch.manual_seed(0)
    c = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F_EXPERT, num_experts=E, num_experts_per_tok=K,
                       shared_expert_intermediate_size=24, norm_topk_prob=False)
    moe = Qwen2MoeSparseMoeBlock(c).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _ours(config: dict, **overrides) -> MoEMLP:
    return MoEMLP(GPTConfig(**{**config, **overrides}), 0.02, 0.01).eval()


def _copy_from_hf(ours: MoEMLP, hf, shared_name: str) -> MoEMLP:
    """transformers' fused experts [E, 2f, h] ([gate; up]) and [E, h, f], router, bias and shared expert."""
    layer = ours.moe.deepspeed_moe
    shared = getattr(hf, shared_name)
    with torch.no_grad():
        layer.gate.wg.weight.copy_(hf.gate.weight)
        if layer.gate.expert_bias is not None:
            layer.gate.expert_bias.copy_(hf.gate.e_score_correction_bias)
        for e, expert in enumerate(layer.experts.deepspeed_experts):
            expert.fc_in.weight.copy_(hf.experts.gate_up_proj[e])
            expert.fc_out.weight.copy_(hf.experts.down_proj[e])
        ours.shared_expert.fc_in.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_expert.fc_out.weight.copy_(shared.down_proj.weight)
        if ours.shared_expert_gate is not None:
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return ours


def _input(seed=1, shape=(3, 8, H)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_moe_layer_equals_transformers(family, grouped):
    hf = _hf_deepseek_moe() if family == "deepseek_v3" else _hf_qwen2_moe()
    config, shared = (DEEPSEEK, "shared_experts") if family == "deepseek_v3" else (QWEN2, "shared_expert")
    ours = _copy_from_hf(_ours(config, moe_grouped_gemm=grouped), hf, shared)
    x = _input()
    with torch.no_grad():
        ref, out = hf(x), ours(x)
    diff = (ref - out).abs().max().item()
    print(f"{family} grouped={grouped}: max abs difference {diff:.1e} (outputs up to {ref.abs().max():.2f})")
    # measured 2026-12-05: 2.4e-6 (deepseek_v3, outputs up to 18), 1.9e-6 (qwen2_moe, up to 13): a few ulps
    assert ref.abs().max() > 1.0 and diff < 1e-5
    if family == "deepseek_v3":  # without the bias, other experts are chosen: the test sees the bias
        ours.moe.deepspeed_moe.gate.expert_bias.zero_()
        with torch.no_grad():
            assert (hf(x) - ours(x)).abs().max() > 1e-3


def test_group_limit_keeps_each_token_within_its_best_groups():
    scores = torch.rand(64, E, generator=torch.Generator().manual_seed(0))
    policy = RouterPolicy("sigmoid", num_groups=4, group_topk=2)
    _, experts = select_experts(scores, K, policy, normalize=True)
    groups = scores.view(64, 4, 4).topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]   # by hand: the best 2 groups
    assert all(set((experts[t] // 4).tolist()) <= set(groups[t].tolist()) for t in range(64))
    _, free = select_experts(scores, K, RouterPolicy("sigmoid"), normalize=True)
    assert not torch.equal(free.sort(-1)[0], experts.sort(-1)[0])  # the limit changed some tokens' experts


def test_grouped_experts_equal_the_loop_with_gradients():
    """Same weights, same tokens: the grouped products against the per-expert modules, forward and backward, at
    a width torch._grouped_mm takes (16 fp32 = 64 bytes) and one it does not (the padded bmm: 6 fp32)."""
    results = {}
    for grouped in (False, True):
        torch.manual_seed(0)
        ours = _ours(DEEPSEEK, moe_grouped_gemm=grouped).train()
        x = _input().requires_grad_()
        out = ours(x)
        (out * _input(2)).sum().backward()
        results[grouped] = [out.detach(), x.grad] + [p.grad for p in ours.parameters()]
    diffs = [(a - b).abs().max().item() for a, b in zip(results[False], results[True])]
    print(f"grouped vs loop: max abs difference {max(diffs):.1e}")
    assert max(diffs) == 0.0  # measured 2026-12-05: bit for bit (torch._grouped_mm on a CPU: each group's mm)
    sizes = torch.tensor([3, 0, 8])
    for width, out, fits in ((6, 5, False), (8, 4, True)):  # rows of 24 bytes: the padded bmm; 32 and 16: grouped
        rows, w = torch.randn(11, width), torch.randn(3, out, width)
        loop = torch.cat([rows[:3] @ w[0].T, rows[3:] @ w[2].T])
        assert grouped_mm_fits(rows, w) == fits
        for product in (grouped_linear, padded_grouped_linear):
            diff = (product(rows, w, sizes) - loop).abs().max().item()
            print(f"{product.__name__} width {width}: {diff:.1e}")
            assert diff < 1e-5  # measured 2026-12-05: up to 1.9e-6 (values up to 10; bmm sums in its own order)
        w.requires_grad_()
        grouped_linear(rows, w, sizes).sum().backward()  # a broadcast gradient (torch._grouped_mm refuses one)
        assert torch.allclose(w.grad[2], torch.ones(8, out).T @ rows[3:], atol=1e-5) and not w.grad[1].any()


def test_sequence_aux_loss_is_deepseeks():
    """DeepSeek-V3's equations 17-20 by hand, per sequence: f_i = E / (k T) x count_i, P_i = mean of the scores
    normalised per token, loss = mean over sequences of sum_i f_i P_i."""
    g = torch.Generator().manual_seed(0)
    scores, T = torch.rand(2 * 10, E, generator=g), 10
    policy = RouterPolicy("sigmoid", load_balancing="seq_aux_loss")
    _, experts = select_experts(scores, K, policy, normalize=True)
    loss = balance_loss(scores, torch.nn.functional.one_hot(experts, E), policy, sequence_length=T)
    expected = 0.0
    for seq in range(2):
        part, chosen = scores[seq * T:(seq + 1) * T], experts[seq * T:(seq + 1) * T]
        f = E / (K * T) * torch.bincount(chosen.reshape(-1), minlength=E).float()
        expected += (f * (part / part.sum(-1, keepdim=True)).mean(0)).sum() / 2
    assert torch.allclose(loss, expected, rtol=1e-6)
    batch = balance_loss(scores, torch.nn.functional.one_hot(experts, E), RouterPolicy("sigmoid"))
    assert not torch.allclose(loss, batch)


def test_bias_update_follows_the_counts_and_stays_fp32():
    ours = _ours(DEEPSEEK, moe_router_bias_update_rate=0.01).train()
    gate = ours.moe.deepspeed_moe.gate
    ours(_input())
    counts = ours.exp_counts.float()
    (load,) = update_expert_biases(ours)
    expected = 0.01 * torch.sign(counts.mean() - counts)
    assert torch.equal(load, counts) and torch.equal(gate.expert_bias, expected) and expected.abs().sum() > 0
    assert not gate.load_since_update.any()
    assert "moe.deepspeed_moe.gate.expert_bias" in ours.state_dict()
    ours.to(torch.bfloat16)
    assert gate.expert_bias.dtype == torch.float32 and torch.equal(gate.expert_bias, expected)
    ours.eval()(_input().bfloat16())  # evaluation routes count nothing
    assert not gate.load_since_update.any()


def test_config_refusals():
    with pytest.raises(ConfigError, match="moe_router_num_groups and moe_router_group_topk go together"):
        GPTConfig(**{**DEEPSEEK, "moe_router_group_topk": None})
    with pytest.raises(ConfigError, match="best 1 groups hold at least moe_top_k 4"):
        GPTConfig(**{**DEEPSEEK, "moe_router_num_groups": 8, "moe_router_group_topk": 1})
    with pytest.raises(ConfigError, match="moe_router_score_function must be one of"):
        GPTConfig(**{**DEEPSEEK, "moe_router_score_function": "relu"})
    with pytest.raises(ConfigError, match="moe_shared_expert_gate needs a shared expert"):
        GPTConfig(**{**QWEN2, "moe_shared_expert_intermediate_size": None})


# -- two ranks: TP2 and EP2 against one process, the bias identical on both ----------------------------------------

def _moe_run(config: dict, x: torch.Tensor) -> dict:
    torch.manual_seed(0)
    mlp = MoEMLP(GPTConfig(**config), 0.02, 0.01).train()
    if config.get("moe_expert_parallel", 1) > 1:
        mlp.moe.set_deepspeed_parallelism()
    x = x.clone().requires_grad_()
    out = mlp(x)
    (out * _input(7, x.shape)).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "grads": full_state_dict(mlp, grads=True), "mlp": mlp}


def _cases(rank):
    results = {}
    initialize_model_parallel(tensor_parallel=2)
    tp = _moe_run({**DEEPSEEK, "moe_grouped_gemm": True}, _input())
    results["tp2"] = {k: tp[k] for k in ("out", "x_grad", "grads")}
    destroy_model_parallel()
    initialize_model_parallel(tensor_parallel=1)   # two data-parallel ranks, each its own tokens
    x = _input(10 + rank)
    for grouped in (False, True):
        ep = _moe_run({**DEEPSEEK, "moe_grouped_gemm": grouped, "moe_expert_parallel": 2}, x)
        results[f"ep2_grouped{grouped}"] = {k: ep[k] for k in ("out", "x_grad", "grads")}
        results[f"ep2_grouped{grouped}"]["first"] = ep["mlp"].first_expert
    counts = ep["mlp"].exp_counts.float().clone()
    (load,) = update_expert_biases(ep["mlp"], torch.distributed.group.WORLD)
    results["bias"] = {"counts": counts, "load": load, "bias": ep["mlp"].moe.deepspeed_moe.gate.expert_bias.clone()}
    forget_expert_groups()
    return results


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_tp2_and_ep2_equal_one_process_and_biases_agree():
    ranks = run_distributed(_cases, 2)
    destroy_model_parallel()
    one = _moe_run({**DEEPSEEK, "moe_grouped_gemm": True}, _input())
    for rank in ranks:  # TP2: the same tokens on both ranks, each expert's columns split
        got = rank["tp2"]
        diffs = {"out": (got["out"] - one["out"]).abs().max().item(),
                 "x_grad": (got["x_grad"] - one["x_grad"]).abs().max().item(), "grads": _max_diff(got["grads"],
                                                                                                   one["grads"])}
        print("TP2 vs TP1:", {k: f"{v:.1e}" for k, v in diffs.items()})
        assert max(diffs.values()) < 1e-7  # measured 2026-12-05: 1.1e-8 (a gradient), 2.6e-10 (the outputs)
    for key in ("ep2_groupedFalse", "ep2_groupedTrue"):
        per_rank = [_moe_run({**DEEPSEEK, "moe_grouped_gemm": True}, _input(10 + r)) for r in range(2)]
        for r, rank in enumerate(ranks):  # EP2: each rank its tokens; an expert's gradient sums both ranks'
            got, ref = rank[key], per_rank[r]
            diffs = {"out": (got["out"] - ref["out"]).abs().max().item(),
                     "x_grad": (got["x_grad"] - ref["x_grad"]).abs().max().item()}
            for name, grad in got["grads"].items():
                if ".deepspeed_experts." in name:
                    local = int(name.split(".deepspeed_experts.")[1].split(".")[0])
                    full = name.replace(f".deepspeed_experts.{local}.",
                                        f".deepspeed_experts.{local + got['first']}.")
                    expected = per_rank[0]["grads"][full] + per_rank[1]["grads"][full]
                else:
                    expected = ref["grads"][name]
                diffs[name] = (grad - expected).abs().max().item()
            worst = max(diffs, key=diffs.get)
            print(f"{key} rank {r} vs EP1: max abs difference {diffs[worst]:.1e} ({worst})")
            assert diffs[worst] < 2e-7  # measured 2026-12-05: 2.6e-8 (an expert's gradient, summed over ranks)
    counts = ranks[0]["bias"]["counts"] + ranks[1]["bias"]["counts"]   # the hand computation from the counts
    expected = 1e-3 * torch.sign(counts.mean() - counts)
    for rank in ranks:
        assert torch.equal(rank["bias"]["load"], counts) and torch.equal(rank["bias"]["bias"], expected)
    assert not torch.equal(ranks[0]["bias"]["counts"], ranks[1]["bias"]["counts"])  # the ranks routed differently
