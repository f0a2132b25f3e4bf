"""DeepSeek-V3's and Qwen2-MoE's MoE layers (models/moe/: router.py, layer.py, grouped.py) against
transformers' own ``DeepseekV3MoE`` and ``Qwen2MoeSparseMoeBlock`` (tiny random ones, fp32, weights copied): sigmoid
group-limited routing with a balancing bias, the routed scaling, shared experts (plain and gated); the grouped
expert products against the per-expert loop; the balancing bias's update and the sequence-wise loss against hand
computations; TP2 and EP2 against one process (one 2-rank launch)."""
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen2MoeConfig
from transformers.modeling_layers import MtpModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3MoE,
                                                                   DeepseekV3RotaryEmbedding)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from dist import run_distributed

import models.moe.grouped
import models.moe.layer
from models.config import ConfigError, GPTConfig
from models.gpt import GPT, RotaryEmbedding
from models.kv_cache import KVCache
from models.moe.grouped import grouped_linear, grouped_mm_fits, padded_grouped_linear
from models.deepseek import MultiLatentAttention, deinterleave_rope_rows
from models.moe import MoEMLP, forget_expert_groups, update_expert_biases
from models.parallel import Layout, destroy_model_parallel, full_state_dict, get_parallel_state, initialize_model_parallel
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.convert import ConversionError, hf_family
from models.moe.router import RouterPolicy, balance_loss, select_experts

H, F_EXPERT, E, K = 32, 16, 16, 4
DEEPSEEK = dict(variant="llama", vocab_size=64, hidden_size=H, num_layers=2, num_heads=4, ffn_hidden_size=48,
                max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, num_experts=E, moe_top_k=K,
                moe_ffn_hidden_size=F_EXPERT, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                moe_shared_expert_intermediate_size=2 * F_EXPERT, moe_router_load_balancing_type="seq_aux_loss",
                moe_aux_loss_coeff=1e-4)
MLA = dict(DEEPSEEK, num_experts=0, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
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
    return MoEMLP(GPTConfig(**{**config, **overrides}), Layout(), 0.02, 0.01).eval()


def _copy_from_hf(ours: MoEMLP, hf, shared_name: str) -> MoEMLP:
    """transformers' fused experts [E, 2f, h] ([gate; up]) and [E, h, f], router, bias and shared expert."""
    layer = ours.moe.deepspeed_moe
    shared = getattr(hf, shared_name)
    with torch.no_grad():
        layer.gate.wg.weight.copy_(hf.gate.weight)
        if layer.gate.balance_bias is not None:
            layer.gate.balance_bias.copy_(hf.gate.e_score_correction_bias)
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
        ours.moe.deepspeed_moe.gate.balance_bias.zero_()
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


@pytest.mark.parametrize("grouped", [False, True])
def test_tiled_experts_equal_untiled_and_mark_every_gradient_ready(grouped, monkeypatch):
    """--tiled-mlp on the experts (each expert's rows, or the grouped rows of all local experts as one, each tile one
    grouped product over the experts it holds rows of), forward and backward, against untiled. 13 tiles of the 96
    grouped rows (24 tokens x top-4) are 12 as torch.chunk cuts them (8 rows each): TiledMLP is told 12, so it marks
    the weights' gradients ready for ZeRO after the last tile (the flag stays False if it counts to 13)."""
    counted = []
    for module in (models.moe.layer, models.moe.grouped):
        real = module.tiled_mlp
        monkeypatch.setattr(module, "tiled_mlp", lambda *a, _real=real: counted.append(a[3]) or _real(*a))
    results = {}
    for tiles in (1, 13):
        torch.manual_seed(0)
        config = GPTConfig(**{**DEEPSEEK, "moe_grouped_gemm": grouped})
        ours = MoEMLP(config, Layout(tiled_mlp=tiles), 0.02, 0.01).train()
        x = _input().requires_grad_()
        out = ours(x)
        (out * _input(2)).sum().backward()
        results[tiles] = [out.detach(), x.grad] + [p.grad for p in ours.parameters() if p.requires_grad]
        assert all(getattr(p, "ds_grad_is_ready", True) for p in ours.moe.deepspeed_moe.experts.parameters())
    assert counted == [12] if grouped else counted and max(counted) > 1
    diffs = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(results[13], results[1])]
    print(f"tiled vs untiled (grouped={grouped}): max relative difference {max(diffs):.1e}")
    assert max(diffs) < 1e-6


def test_grouped_experts_equal_the_loop_with_gradients(monkeypatch):
    """Same weights, same tokens: the grouped products against the per-expert modules, forward and backward, at
    a width torch._grouped_mm takes (16 fp32 = 64 bytes) and one it does not (the padded bmm: 6 fp32); the layer's
    experts also through the padded batched products (its path where torch._grouped_mm does not fit)."""
    results, padded = {}, []
    for system in ("loop", "grouped", "padded"):
        torch.manual_seed(0)
        with monkeypatch.context() as patch:
            if system == "padded":  # (counted: the padded path ran, not torch._grouped_mm)
                patch.setitem(models.moe.grouped.GROUPED_MM_DTYPES, "cpu", ())
                padding = models.moe.grouped._Padding
                patch.setattr(models.moe.grouped, "_Padding", lambda sizes: padded.append(1) or padding(sizes))
            ours = _ours(DEEPSEEK, moe_grouped_gemm=system != "loop").train()
            x = _input().requires_grad_()
            out = ours(x)
            (out * _input(2)).sum().backward()
        results[system] = [out.detach(), x.grad] + [p.grad for p in ours.parameters() if p.requires_grad]
    diffs = {system: max((a - b).abs().max().item() for a, b in zip(results["loop"], results[system]))
             for system in ("grouped", "padded")}
    print(f"grouped / padded vs loop: max abs difference {diffs['grouped']:.1e} / {diffs['padded']:.1e}")
    assert diffs["grouped"] == 0.0  # measured 2026-12-05: bit for bit (torch._grouped_mm on a CPU: each group's mm)
    assert padded and diffs["padded"] < 1e-5  # measured 2026-12-06: 0.0 here (bmm may sum in its own order)
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
    loss = balance_loss(scores, experts, policy, sequence_length=T)
    expected = 0.0
    for seq in range(2):
        part, chosen = scores[seq * T:(seq + 1) * T], experts[seq * T:(seq + 1) * T]
        f = E / (K * T) * torch.bincount(chosen.reshape(-1), minlength=E).float()
        expected += (f * (part / part.sum(-1, keepdim=True)).mean(0)).sum() / 2
    assert torch.allclose(loss, expected, rtol=1e-6)
    batch = balance_loss(scores, experts, RouterPolicy("sigmoid"))
    assert not torch.allclose(loss, batch)


def test_bias_update_follows_the_counts_and_stays_fp32():
    ours = _ours(DEEPSEEK, moe_router_bias_update_rate=0.01).train()
    gate = ours.moe.deepspeed_moe.gate
    ours(_input())
    counts = ours.exp_counts.float()
    (load,) = update_expert_biases(ours)
    expected = 0.01 * torch.sign(counts.mean() - counts)
    assert torch.equal(load, counts) and torch.equal(gate.balance_bias, expected) and expected.abs().sum() > 0
    assert not gate.load_since_update.any()
    assert "moe.deepspeed_moe.gate.balance_bias" in ours.state_dict()
    ours.to(torch.bfloat16)
    assert gate.balance_bias.dtype == torch.float32 and torch.equal(gate.balance_bias, expected)
    ours.eval()(_input().bfloat16())  # evaluation routes count nothing
    assert not gate.load_since_update.any()


@pytest.mark.parametrize("schedule", ["constant", "lr"])
def test_bias_rate_follows_the_lr_decay_only_under_the_lr_schedule(schedule):
    ours = _ours(DEEPSEEK, moe_router_bias_update_rate=0.01, moe_router_bias_rate_schedule=schedule).train()
    ours(_input())
    counts = ours.exp_counts.float()
    update_expert_biases(ours, lr_decay=0.25)
    rate = 0.01 * (0.25 if schedule == "lr" else 1.0)
    assert torch.equal(ours.moe.deepspeed_moe.gate.balance_bias, rate * torch.sign(counts.mean() - counts))


def test_config_refusals():
    with pytest.raises(ConfigError, match="moe_router_num_groups and moe_router_group_topk go together"):
        GPTConfig(**{**DEEPSEEK, "moe_router_group_topk": None})
    with pytest.raises(ConfigError, match="best 1 groups hold at least moe_top_k 4"):
        GPTConfig(**{**DEEPSEEK, "moe_router_num_groups": 8, "moe_router_group_topk": 1})
    with pytest.raises(ConfigError, match="moe_router_score_function must be one of"):
        GPTConfig(**{**DEEPSEEK, "moe_router_score_function": "relu"})
    with pytest.raises(ConfigError, match="moe_shared_expert_gate needs a shared expert"):
        GPTConfig(**{**QWEN2, "moe_shared_expert_intermediate_size": None})
    with pytest.raises(ConfigError, match="multi_latent_attention is an option of the llama variant"):
        GPTConfig(**{**MLA, "num_kv_heads": 2})
    config = GPTConfig(**DEEPSEEK_MODEL)
    assert GPTConfig.from_dict(config.to_dict()) == config and config.to_dict()["moe_router_group_topk"] == 2


def _mla(config: dict) -> MultiLatentAttention:
    c = GPTConfig(**config)
    return MultiLatentAttention(c, RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta))


def _hf_attention(q_lora_rank, interleave: bool):
    torch.manual_seed(0)
    c = DeepseekV3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                         rope_interleave=interleave, max_position_embeddings=32)
    c._attn_implementation = "eager"
    attention = DeepseekV3Attention(c, layer_idx=0).eval()
    for p in attention.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.2)
    return attention, DeepseekV3RotaryEmbedding(c)


def _copy_attention(ours: MultiLatentAttention, hf, interleave: bool) -> MultiLatentAttention:
    q_rows, kv_rows = (hf.q_proj if hf.q_lora_rank is None else hf.q_b_proj).weight, hf.kv_a_proj_with_mqa.weight
    if interleave:  # the RoPE rows of the query (each head's last 8) and of kv_a (its last 8) reordered
        q_rows, kv_rows = deinterleave_rope_rows(q_rows, 8, 16), deinterleave_rope_rows(kv_rows, 8, 24)
    with torch.no_grad():
        if hf.q_lora_rank is None:
            ours.q_proj.weight.copy_(q_rows)
        else:
            ours.q_a_proj.weight.copy_(hf.q_a_proj.weight)
            ours.q_a_norm.weight.copy_(hf.q_a_layernorm.weight)
            ours.q_b_proj.weight.copy_(q_rows)
        ours.kv_a_proj.weight.copy_(kv_rows)
        ours.kv_a_norm.weight.copy_(hf.kv_a_layernorm.weight)
        ours.kv_b_proj.weight.copy_(hf.kv_b_proj.weight)
        ours.dense.weight.copy_(hf.o_proj.weight)
    return ours


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_equals_transformers(q_lora_rank, interleave):
    hf, rotary = _hf_attention(q_lora_rank, interleave)
    ours = _copy_attention(_mla({**MLA, "q_lora_rank": q_lora_rank}).eval(), hf, interleave)
    x = _input(shape=(2, 12, H))
    causal = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = hf(x, rotary(x, torch.arange(12)[None]), causal)[0]
        out = ours(x)
    diff = (ref - out).abs().max().item()
    print(f"MLA q_lora_rank={q_lora_rank} interleave={interleave}: max abs difference {diff:.1e} "
          f"(outputs up to {ref.abs().max():.1f})")
    assert ref.abs().max() > 1.0 and diff < 1e-6  # measured 2026-12-05: 0.0, bit for bit (outputs up to 3.2)
    if interleave:  # the same weights without the reordering: another RoPE, another output
        with torch.no_grad():
            assert (ref - _copy_attention(ours, hf, False)(x)).abs().max() > 1e-2


# -- the whole model: a dense first layer, MLA, sigmoid group-limited routing with biases, shared experts, MTP --------

def _hf_deepseek(mtp_layers=1):
    torch.manual_seed(0)
    c = DeepseekV3Config(vocab_size=96, hidden_size=H, intermediate_size=48, moe_intermediate_size=F_EXPERT,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E,
                         num_experts_per_tok=K, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=32,
                         num_mtp_layers=mtp_layers)
    model = DeepseekV3ForCausalLM(c).eval()
    mtp = MtpModel(model, mtp_layers).eval()
    for name, p in mtp.named_parameters(remove_duplicate=False):  # MtpModel leaves its own tensors unset
        if not name.startswith(("embed_tokens", "shared_head")):
            torch.nn.init.normal_(p, std=0.02)
    for module in (model, mtp):
        for name, p in module.named_parameters():
            if "norm" in name:  # the norms away from 1, the biases away from 0: a wrong copy shows
                torch.nn.init.normal_(p, mean=1.0, std=0.2)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(std=0.02)
    return model, mtp


def _moe_names(ours: str, theirs: str) -> dict:
    return {f"{theirs}.gate.weight": f"{ours}.moe.deepspeed_moe.gate.wg.weight",
            f"{theirs}.shared_experts.down_proj.weight": f"{ours}.shared_expert.fc_out.weight"}


def _our_state_dict(model, mtp, layers=3) -> dict:
    """transformers' DeepSeek-V3 (and MtpModel) tensors under the project's names (a test's converter)."""
    hf = {**model.state_dict(), **{f"mtp.{k}": v for k, v in mtp.state_dict().items()}}
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"], "lm_head.weight": hf["lm_head.weight"],
           "final_norm.norm.weight": hf["model.norm.weight"]}
    blocks = {f"layers.{i}": f"model.layers.{i}" for i in range(layers)}
    blocks.update({f"mtp.layers.{d}.block": f"mtp.layers.{d}.mtp_block" for d in range(len(mtp.layers))})
    for d in range(len(mtp.layers)):
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("final_norm", "post_norm")):
            out[f"mtp.layers.{d}.{ours}.weight"] = hf[f"mtp.layers.{d}.{theirs}.weight"]
    for ours, theirs in blocks.items():
        a, t = f"{ours}.attention", f"{theirs}.self_attn"
        out.update({f"{ours}.input_norm.weight": hf[f"{theirs}.input_layernorm.weight"],
                    f"{ours}.post_attention_norm.weight": hf[f"{theirs}.post_attention_layernorm.weight"],
                    f"{a}.q_a_proj.weight": hf[f"{t}.q_a_proj.weight"], f"{a}.q_a_norm.weight": hf[f"{t}.q_a_layernorm.weight"],
                    f"{a}.q_b_proj.weight": deinterleave_rope_rows(hf[f"{t}.q_b_proj.weight"], 8, 16),
                    f"{a}.kv_a_proj.weight": deinterleave_rope_rows(hf[f"{t}.kv_a_proj_with_mqa.weight"], 8, 24),
                    f"{a}.kv_a_norm.weight": hf[f"{t}.kv_a_layernorm.weight"],
                    f"{a}.kv_b_proj.weight": hf[f"{t}.kv_b_proj.weight"], f"{a}.dense.weight": hf[f"{t}.o_proj.weight"]})
        m, t = f"{ours}.mlp", f"{theirs}.mlp"
        if f"{t}.gate_proj.weight" in hf:  # a dense layer
            out[f"{m}.fc_in.weight"] = torch.cat([hf[f"{t}.gate_proj.weight"], hf[f"{t}.up_proj.weight"]])
            out[f"{m}.fc_out.weight"] = hf[f"{t}.down_proj.weight"]
            continue
        experts = f"{m}.moe.deepspeed_moe.experts.deepspeed_experts"
        for e in range(E):
            out[f"{experts}.{e}.fc_in.weight"] = hf[f"{t}.experts.gate_up_proj"][e]
            out[f"{experts}.{e}.fc_out.weight"] = hf[f"{t}.experts.down_proj"][e]
        out.update({f"{m}.moe.deepspeed_moe.gate.wg.weight": hf[f"{t}.gate.weight"],
                    f"{m}.shared_expert.fc_in.weight": torch.cat([hf[f"{t}.shared_experts.gate_proj.weight"],
                                                                  hf[f"{t}.shared_experts.up_proj.weight"]]),
                    f"{m}.shared_expert.fc_out.weight": hf[f"{t}.shared_experts.down_proj.weight"],
                    f"{m}.moe.deepspeed_moe.gate.balance_bias": hf[f"{t}.gate.e_score_correction_bias"]})
    return out


DEEPSEEK_MODEL = dict(DEEPSEEK, vocab_size=96, num_layers=3, moe_dense_layers=[0], tie_embeddings=False, norm_eps=1e-6,
                      **{k: v for k, v in MLA.items() if k not in DEEPSEEK or k == "num_experts"}, mtp_num_layers=1)
DEEPSEEK_MODEL["num_experts"] = E


def _deepseek_gpt(model, mtp, **overrides) -> GPT:
    ours = GPT(GPTConfig(**{**DEEPSEEK_MODEL, **overrides}), init_seed=0).eval()
    load_full_state_dict(ours, _our_state_dict(model, mtp))  # the balancing biases with the weights
    return ours


@pytest.mark.parametrize("grouped", [False, True])
def test_deepseek_v3_logits_and_mtp_equal_transformers(grouped):
    model, mtp = _hf_deepseek()
    ours = _deepseek_gpt(model, mtp, moe_grouped_gemm=grouped)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        logits = ours(ids)
        # MTP depth 1 as transformers drafts: the main model's last hidden states of tokens 0..10, tokens 1..11 at
        # positions 1..11; ours at positions 0..10 (RoPE is relative)
        hf_mtp = mtp.shared_head(mtp.forward_layer(0, ref.hidden_states[-1][:, :-1], torch.arange(1, 12)[None], None,
                                                   input_ids=ids[:, 1:]))
        ours.train()  # the MTP hidden states are kept by training forwards (dropout 0, no capacity: the same)
        hidden = ours._local_hidden_states(ids)
        (depth1,) = ours.mtp.hidden_states(hidden, ids, ours.embedding.word_embeddings)
        our_mtp = ours.lm_head(depth1)[:, :-1, :96]
    diffs = {"logits": (ref.logits - logits).abs().max().item(), "mtp": (hf_mtp - our_mtp).abs().max().item()}
    print(f"DeepSeek-V3 grouped={grouped}: max abs differences", {k: f"{v:.1e}" for k, v in diffs.items()},
          f"(logits up to {ref.logits.abs().max():.2f})")
    # measured 2026-12-05: 6.0e-8 (logits), 7.5e-8 (MTP, whose RoPE positions are shifted by one in transformers)
    assert ref.logits.abs().max() > 0.1 and max(diffs.values()) < 6e-7


def test_decoding_with_the_latent_cache_equals_the_whole_sequence_and_transformers_generate():
    """Greedy decoding's path: 6 tokens read at once, then one at a time through a KVCache holding each layer's
    compressed latent and RoPE key: every step's logits against those of the whole sequence without a cache, and
    the greedy tokens against transformers' ``generate`` with its own cache."""
    model, mtp = _hf_deepseek()
    ours = _deepseek_gpt(model, mtp)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(6))
    cache, tokens = KVCache(ours.config.num_layers), ids
    with torch.no_grad():
        cache.read(torch.ones(2, 6, dtype=torch.bool))
        steps = [ours.parallel_logits(ids, cache)[..., :96]]
        for _ in range(8):
            tokens = torch.cat([tokens, steps[-1][:, -1].argmax(-1, keepdim=True)], dim=1)
            cache.read(torch.ones(2, 1, dtype=torch.bool))
            steps.append(ours.parallel_logits(tokens[:, -1:], cache)[..., :96])
        whole = ours.parallel_logits(tokens)[:, 5:, :96]
        reference = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    diff = (torch.cat(steps, dim=1)[:, :-1] - whole[:, :-1]).abs().max().item()
    print(f"latent cache: max abs difference {diff:.1e} (logits up to {whole.abs().max():.2f})")
    assert cache.keys[0].shape == (2, 1, 14, 16) and cache.values[0].shape == (2, 1, 14, 8)  # latent, RoPE key
    assert diff < 5e-7  # measured 2026-12-05: 8.9e-8
    assert torch.equal(tokens, reference)


def test_mtp_loss_is_lambda_times_the_depths_mean():
    model, mtp = _hf_deepseek(mtp_layers=2)
    ours = _deepseek_gpt(model, mtp, mtp_num_layers=2, mtp_loss_scaling_factor=0.3).train()
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(4))
    x, labels = ids[:, :-1], ids[:, 1:]
    total = ours(x, labels)
    main = torch.nn.functional.cross_entropy(ours.eval()(x).reshape(-1, 96), labels.reshape(-1))
    ours.train()
    hidden = ours._local_hidden_states(x)
    depths = ours.mtp.hidden_states(hidden, x, ours.embedding.word_embeddings)
    by_hand = [torch.nn.functional.cross_entropy(ours.lm_head(h)[:, :-k, :96].reshape(-1, 96),
                                                 ids[:, k + 1:].reshape(-1)) for k, h in enumerate(depths, start=1)]
    aux = ours.moe_aux_loss() + ours.mtp.moe_aux_loss()
    expected = main + 0.3 * sum(by_hand) / 2 + aux
    print(f"MTP loss: total {total:.6f}, by hand {expected:.6f}")
    assert torch.allclose(total, expected, rtol=1e-6) and float(sum(by_hand).detach()) > 1.0
    total.backward()
    assert ours.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0


# -- two ranks: TP2 and EP2 against one process, the bias identical on both ----------------------------------------

def _moe_run(config: dict, x: torch.Tensor) -> dict:
    torch.manual_seed(0)
    config = dict(config)
    ep = config.pop("expert_parallel", 1)  # the layout's, not the model's
    mlp = MoEMLP(GPTConfig(**config), get_parallel_state().layout.replace(expert=ep), 0.02, 0.01).train()
    if ep > 1:
        mlp.moe.set_deepspeed_parallelism()
    x = x.clone().requires_grad_()
    out = mlp(x)
    (out * _input(7, x.shape)).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "grads": full_state_dict(mlp, grads=True), "mlp": mlp}


def _mla_run(config: dict) -> dict:
    torch.manual_seed(0)
    mla = _mla(config).train()
    x = _input(shape=(2, 12, H)).requires_grad_()
    out = mla(x)
    (out * _input(7, out.shape)).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "grads": full_state_dict(mla, grads=True)}


def _gpt_run() -> dict:
    """The DeepSeek-like GPT (MLA, MoE, shared experts, MTP): its logits, its training loss (MTP's included) and
    every gradient."""
    model = GPT(GPTConfig(**{**DEEPSEEK_MODEL, "moe_grouped_gemm": True}), init_seed=0)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(5))
    logits = model.eval()(ids[:, :-1])
    loss = model.train()(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": full_state_dict(model, grads=True)}


def _cases(rank):
    results = {}
    initialize_model_parallel(tensor_parallel=2)
    results["gpt_tp2"] = _gpt_run()
    tp = _moe_run({**DEEPSEEK, "moe_grouped_gemm": True}, _input())
    results["tp2"] = {k: tp[k] for k in ("out", "x_grad", "grads")}
    results["mla_tp2"] = {q: _mla_run({**MLA, "q_lora_rank": q}) for q in (24, None)}
    destroy_model_parallel()
    initialize_model_parallel(tensor_parallel=1)   # two data-parallel ranks, each its own tokens
    x = _input(10 + rank)
    for grouped in (False, True):
        ep = _moe_run({**DEEPSEEK, "moe_grouped_gemm": grouped, "expert_parallel": 2}, x)
        results[f"ep2_grouped{grouped}"] = {k: ep[k] for k in ("out", "x_grad", "grads")}
        results[f"ep2_grouped{grouped}"]["first"] = ep["mlp"].first_expert
    counts = ep["mlp"].exp_counts.float().clone()
    (load,) = update_expert_biases(ep["mlp"], torch.distributed.group.WORLD)
    results["bias"] = {"counts": counts, "load": load, "bias": ep["mlp"].moe.deepspeed_moe.gate.balance_bias.clone()}
    forget_expert_groups()
    return results


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_tp2_and_ep2_equal_one_process_and_biases_agree():
    ranks = run_distributed(_cases, 2)
    destroy_model_parallel()
    one = _gpt_run()
    for rank in ranks:  # the whole DeepSeek-like model at TP2
        got = rank["gpt_tp2"]
        diffs = {"logits": (got["logits"] - one["logits"]).abs().max().item(),
                 "loss": (got["loss"] - one["loss"]).abs().item(), "grads": _max_diff(got["grads"], one["grads"])}
        print("DeepSeek-like GPT TP2 vs TP1:", {k: f"{v:.1e}" for k, v in diffs.items()})
        # measured 2026-12-05: 8.9e-8 (logits up to 0.4), 3.7e-8 (a gradient), the loss bit for bit
        assert got["grads"].keys() == one["grads"].keys() and max(diffs.values()) < 5e-7
    for q_lora_rank in (24, None):  # MLA at TP2: two heads a rank, the latents replicated
        one = _mla_run({**MLA, "q_lora_rank": q_lora_rank})
        for rank in ranks:
            got = rank["mla_tp2"][q_lora_rank]
            diffs = {"out": (got["out"] - one["out"]).abs().max().item(),
                     "x_grad": (got["x_grad"] - one["x_grad"]).abs().max().item(),
                     "grads": _max_diff(got["grads"], one["grads"])}
            print(f"MLA q_lora_rank={q_lora_rank} TP2 vs TP1:", {k: f"{v:.1e}" for k, v in diffs.items()})
            assert got["grads"].keys() == one["grads"].keys()
            assert max(diffs.values()) < 1e-6  # measured 2026-12-05: 1.2e-7 (a gradient), 3.7e-9 (the outputs)
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


@pytest.mark.parametrize("field, value", [("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True),
                                          ("moe_shared_expert_intermediate_size", 32), ("moe_router_topk_scaling_factor", 2.5)])
def test_no_hugging_face_family_exports_what_it_cannot_compute(field, value):
    """A Mixtral-shaped MoE with a DeepSeek-V3-generation router or shared expert is not exported as Mixtral (whose
    routing would give other logits): the export's family choice refuses it, naming the field."""
    base = dict(variant="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16,
                num_experts=4, moe_top_k=2)
    assert hf_family(GPTConfig(**base)).architecture == "MixtralForCausalLM"
    with pytest.raises(ConversionError, match=field):
        hf_family(GPTConfig(**base, **{field: value}))
