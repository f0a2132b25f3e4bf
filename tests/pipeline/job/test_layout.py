"""The run's Layout (models/parallel/layout.py) and its one validator (pipeline/job/layout.py): what a checkpoint
records comes back as the same layout; the process groups are the layout's (expert groups cut from data x context);
each rule refuses in one line naming both features, and allows what it should."""
import pytest
import torch.distributed as dist
from dist import run_distributed

from models import GPTConfig, MLSTMConfig
from models.parallel import Layout, initialize_model_parallel
from pipeline.job.families import family_of
from pipeline.job.layout import RULES, LayoutCheck, layout_from_options, refusal
from pipeline.job.options import EngineOptions

GPT = GPTConfig(variant="gpt2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16)
MOE = GPTConfig(variant="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16,
                num_experts=4)
MOE_EVERY_OTHER = GPTConfig(**{**MOE.__dict__, "moe_layer_freq": 2})  # experts in layer 1 only
MLSTM = MLSTMConfig(vocab_size=64, embed_dim=8, hidden_size=16, seq_length=8)


def test_a_checkpoints_record_is_the_layout():
    layout = Layout(tensor=2, pipeline=2, context=2, data=2, expert=2, sequence_parallel=True, zero_stage=1,
                    precision="bf16", tiled_loss=4, recompute="selective", recompute_modules=("core_attn",),
                    fp8="rowwise", loss_chunk_tokens=1024)
    record = layout.record()
    assert record["tensor_parallel"] == 2 and record["expert_parallel"] == 2 and record["zero_stage"] == 1
    assert Layout.from_record(record) == layout
    old = {"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 1, "model_type": "gpt", "zero_stage": 1}
    assert Layout.from_record(old) == Layout(tensor=2, zero_stage=1)  # older records: the newer fields' defaults
    assert str(layout).startswith("TP 2 (SP), CP 2, PP 2, DP 2, EP 2, ZeRO 1, bf16, tiled loss 4, recompute")


def test_the_layout_of_the_command_line():
    options = EngineOptions(tensor_parallel=2, context_parallel=2, expert_parallel=2, sequence_parallel=True,
                            tiled_loss=2, recompute="selective", recompute_modules=("mlp",), fp8="tensorwise",
                            loss_chunk_tokens=512)
    layout = layout_from_options(options, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, world=8)
    assert layout == Layout(tensor=2, context=2, data=2, expert=2, sequence_parallel=True, zero_stage=2,
                            precision="bf16", tiled_loss=2, recompute="selective", recompute_modules=("mlp",),
                            fp8="tensorwise", loss_chunk_tokens=512)


@pytest.mark.parametrize("check, both", [
    (LayoutCheck(Layout(tensor=1, sequence_parallel=True)), ("--sequence-parallel", "--tensor-parallel 1")),
    (LayoutCheck(Layout(tensor=2, sequence_parallel=True, tiled_mlp=2)), ("--tiled-mlp", "--sequence-parallel")),
    (LayoutCheck(Layout(tensor=3), GPT), ("num_heads 4", "tensor-parallel size 3")),
    (LayoutCheck(Layout(expert=2, data=2), GPT), ("--expert-parallel 2", "dense model")),
    (LayoutCheck(Layout(expert=3, data=3), MOE), ("--expert-parallel 3", "num_experts 4")),
    (LayoutCheck(Layout(expert=2, data=1), MOE), ("--expert-parallel 2", "data x context parallel 1")),
    (LayoutCheck(Layout(zero_stage=3), MOE), ("stage 3", "MoE layers")),
    (LayoutCheck(Layout(pipeline=2), MOE_EVERY_OTHER), ("--pipeline-parallel 2", "stage(s) [0] (layers [[0]])")),
    (LayoutCheck(Layout(tiled_loss=17), GPT), ("--tiled-loss 17", "16 tokens")),
    (LayoutCheck(Layout(context=2, tiled_mlp=9), GPT), ("--tiled-mlp 9", "context parallel 2")),
    (LayoutCheck(Layout(recompute="selective", recompute_modules=("moe_act",)), GPT), ("moe_act", "dense model")),
    (LayoutCheck(Layout(data=2, zero_stage=3, compile=True), GPT), ("--compile", "ZeRO stage 3")),
    (LayoutCheck(Layout(tensor=2), MLSTM, family_of(MLSTM)), ("--tensor-parallel 2", "mlstm model")),
    (LayoutCheck(Layout(tensor=2), extras={"world": 3}), ("world size 3", "--tensor-parallel 2")),
    (LayoutCheck(Layout(context=0)), ("--context-parallel 0", "1 or more")),
    (LayoutCheck(Layout(fp8="tensorwise"), MOE), ("--fp8", "MoE layers")),
    (LayoutCheck(Layout(fp8="rowwise", tiled_mlp=2), GPT), ("--fp8", "--tiled-mlp")),
    (LayoutCheck(Layout(fp8="tensorwise"), MLSTM, family_of(MLSTM)), ("--fp8 tensorwise", "mlstm model")),
    (LayoutCheck(Layout(fp8="e5m2")), ("--fp8 e5m2", "tensorwise, rowwise")),
    (LayoutCheck(Layout(loss_chunk_tokens=64), MLSTM, family_of(MLSTM)), ("--loss-chunk-tokens 64", "mlstm model")),
])
def test_each_refusal_is_one_line_naming_both_features(check, both):
    reason = refusal(check)
    assert reason and "\n" not in reason and ";" in reason, reason  # what is wrong; what to do
    assert all(part in reason for part in both), reason


def test_what_the_rules_allow():
    allowed = [LayoutCheck(Layout()), LayoutCheck(Layout(tensor=2, sequence_parallel=True, context=2), GPT),
               LayoutCheck(Layout(expert=2, context=2), MOE),  # experts over data x context
               LayoutCheck(Layout(pipeline=2), MOE),  # experts on both stages
               LayoutCheck(Layout(tiled_mlp=2, tiled_loss=2, expert=2, data=2), MOE),
               LayoutCheck(Layout(tensor=2, sequence_parallel=True, expert=2, data=2), MOE),
               LayoutCheck(Layout(data=4), MLSTM, family_of(MLSTM)),
               LayoutCheck(Layout(tensor=2, sequence_parallel=True, compile=True, recompute="selective",  # traced
                                  recompute_modules=("core_attn", "mlp_act", "layernorm")), GPT),
               LayoutCheck(Layout(context=2, compile=True, fp8="rowwise"), GPT),  # traced (tests/models/test_compile.py)
               LayoutCheck(Layout(pipeline=2, compile=True), GPT),  # the stages' blocks compiled (the same test)
               LayoutCheck(Layout(expert=2, data=2, compile=True), MOE),  # MoE blocks: their routing eager
               LayoutCheck(Layout(tiled_mlp=2, tiled_loss=2, compile=True), GPT)]  # the MLP's tiles eager
    assert [refusal(c) for c in allowed] == [None] * len(allowed)
    assert len(RULES) >= 15  # every rule of the project is here (pipeline/job/layout.py)


def _groups(rank):
    state = initialize_model_parallel(layout=Layout(context=2, expert=2, data=2))
    ep, ep_ranks, expert_data, expert_data_ranks = state.expert_groups()
    return {"layout": state.layout.record(), "ep": list(ep_ranks), "expert_data": list(expert_data_ranks),
            "ep_group": dist.get_process_group_ranks(ep)}


def test_expert_groups_are_cut_from_data_and_context():
    """4 ranks at CP 2 x DP 2, EP 2: experts exchanged within consecutive data x context ranks (the two chunks of
    one replica's sequences), their gradients summed over the other two."""
    ranks = run_distributed(_groups, 4)
    assert [r["ep"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["expert_data"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["ep_group"] == r["ep"] and Layout.from_record(r["layout"]) == Layout(context=2, expert=2, data=2)
               for r in ranks)
