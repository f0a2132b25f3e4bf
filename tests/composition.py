"""The composition matrix: every pair of the project's parallel and memory features (and the triples users run),
each trained 4 steps through the real DeepSpeed engine and compared with one process, or refused by the one
layout validator (``pipeline.job.layout``) in one line before any work.

A cell is a set of features; its layout is the features' fields joined (``cell_layout``), its world the product of
their rank factors. The validator decides first: a refused cell must be refused with one line, an allowed one must
train exactly (``tests/pipeline/job/test_composition.py``). ``docs/composition.md`` is generated from this file and
the validator (``python tests/composition.py --write``); a test fails when they disagree.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from models import GPTConfig  # noqa: E402
from models.parallel import Layout  # noqa: E402
from pipeline.job.layout import POST_TRAINING, LayoutCheck, refusal  # noqa: E402
from parsers import built_parser  # noqa: E402

SEQ = 16
DENSE = dict(variant="gpt2", vocab_size=256, hidden_size=32, num_layers=4, num_heads=4, max_position_embeddings=SEQ,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
# every other layer a mixture of 4 experts, top-2, dropless (a capacity factor drops by each rank's token order)
MOE = dict(DENSE, num_experts=4, moe_top_k=2, moe_layer_freq=2, moe_aux_loss_coeff=0.01)
# DeepSeek-V3's generation: a dense first layer, 8 fine-grained experts in 4 groups (top-2 of the best 2 groups) by
# sigmoid scores, a shared expert, the sequence-wise balancing loss and the bias of auxiliary-loss-free balancing
# (its rate high enough to change the routing within the cells' 4 steps), the experts as one grouped product
V3_MOE = dict(DENSE, num_experts=8, moe_top_k=2, moe_layer_freq=1, moe_dense_layers=[0], moe_ffn_hidden_size=16,
              moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
              moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
              moe_aux_loss_coeff=0.001, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
              moe_shared_expert_intermediate_size=32, moe_grouped_gemm=True)
MODELS = {"dense": DENSE, "moe": MOE, "v3": V3_MOE}
GLOBAL_BATCH = 8
# every layout runs micro-batches of 2 sequences (gradient accumulation makes up the rest): an MoE layer's
# balancing loss is a statistic of its micro-batch, the same one at every layout only if the micro-batches are
MICRO_BATCH = 2
STEPS = 4
DOC = ROOT / "docs" / "composition.md"
TEST_ID = "tests/pipeline/job/test_composition.py::test_composition_cells"


@dataclass(frozen=True)
class Feature:
    layout: dict = field(default_factory=dict)
    data: int = 1            # data-parallel ranks it needs
    model: str = "dense"     # the model it needs (``MODELS``)
    shows: str = ""          # what proves it was in force (``tests/pipeline/job/test_composition.py``)


FEATURES = {
    "TP2": Feature({"tensor": 2}, shows="tp collectives"),
    "TP2+SP": Feature({"tensor": 2, "sequence_parallel": True}, shows="tp all-gather / reduce-scatter"),
    "CP2": Feature({"context": 2}, shows="context group of 2"),
    "PP2": Feature({"pipeline": 2}, shows="pipeline engine of 2 stages"),
    "DP2 ZeRO-1": Feature({"zero_stage": 1}, data=2, shows="ZeRO stage 1 over 2 ranks"),  # (every cell's default)
    "DP2 ZeRO-2": Feature({"zero_stage": 2}, data=2, shows="ZeRO stage 2 over 2 ranks"),
    "DP2 ZeRO-3": Feature({"zero_stage": 3}, data=2, shows="ZeRO stage 3 over 2 ranks"),
    "EP2 MoE": Feature({"expert": 2}, data=2, model="moe", shows="ep all-to-all, expert groups of 2"),
    "EP2 V3 MoE": Feature({"expert": 2}, data=2, model="v3",
                          shows="ep all-to-all, expert groups of 2, the balancing bias moved"),
    "tiled MLP": Feature({"tiled_mlp": 2}, shows="TiledMLP ran"),
    "tiled loss": Feature({"tiled_loss": 2}, shows="tiled loss ran"),
    "recompute": Feature({"recompute": "selective", "recompute_modules": ("core_attn", "layernorm")},
                         shows="recomputation ran"),
    "bf16": Feature({"precision": "bf16"}, shows="bf16 weights"),
    "fp16": Feature({"precision": "fp16"}, shows="fp16 weights, loss scale"),
    "FP8": Feature({"fp8": "tensorwise"}, shows="FP8 products ran"),
    "chunked loss": Feature({"loss_chunk_tokens": 8}, shows="the chunked cross-entropy ran"),
}
# of two features that set the same field only one can hold; SP includes TP2
EXCLUSIVE = [{"DP2 ZeRO-1", "DP2 ZeRO-2", "DP2 ZeRO-3"}, {"bf16", "fp16"}, {"TP2", "TP2+SP"},
             {"EP2 MoE", "EP2 V3 MoE"}]
TRIPLES = [("TP2", "CP2", "PP2"), ("TP2+SP", "EP2 MoE", "DP2 ZeRO-1"), ("CP2", "EP2 MoE", "DP2 ZeRO-2"),
           ("TP2", "PP2", "DP2 ZeRO-1"), ("TP2+SP", "EP2 V3 MoE", "DP2 ZeRO-2")]


def applicable(names) -> bool:
    return not any(len(group & set(names)) > 1 for group in EXCLUSIVE)


def cells() -> list[tuple[str, ...]]:
    """Every single feature, every applicable pair, and the triples users run."""
    pairs = [p for p in itertools.combinations(FEATURES, 2) if applicable(p)]
    return [(name,) for name in FEATURES] + pairs + TRIPLES


def cell_layout(names) -> tuple[Layout, str]:
    """(the layout of a cell, the model it trains: ``MODELS``). Data parallel: 2 when a feature needs it. ZeRO: the
    feature's stage, else 1 (the project's default DeepSpeed config; DeepSpeed's ZeRO-0 path keeps no gradient
    norm to compare, and ZeRO-0 is compared with one process in tests/pipeline/engine/test_engine.py)."""
    fields: dict = {}
    for name in names:
        fields.update(FEATURES[name].layout)
    if "tensor" in fields and "sequence_parallel" in fields:
        fields["tensor"] = 2
    data = max(FEATURES[name].data for name in names)
    fields.setdefault("zero_stage", 1)
    model_ranks = fields.get("tensor", 1) * fields.get("context", 1) * fields.get("pipeline", 1)
    layout = Layout.for_world(model_ranks * data, **fields)
    return layout, next((FEATURES[n].model for n in names if FEATURES[n].model != "dense"), "dense")


def ds_config(layout: Layout) -> dict:
    ds = {"train_batch_size": GLOBAL_BATCH,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                    "weight_decay": 0.1, "torch_adam": True}},
          "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False,
          "zero_optimization": {"stage": layout.zero_stage},
          "comms_logger": {"enabled": True, "prof_all": True}}
    if layout.zero_stage == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every weight gathered: counted
    if layout.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    if layout.precision == "fp16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return ds


def model_config(model: str) -> GPTConfig:
    return GPTConfig(**MODELS[model])


def cell_refusal(names) -> str | None:
    layout, model = cell_layout(names)
    return refusal(LayoutCheck(layout, model_config(model), None, ds_config(layout), "DeepSpeed config"))


def cell_id(names) -> str:
    return " x ".join(names)


# -- the commands that run a model beside pretraining, with each feature alone ----------------------------------------

# the flags by which a command takes a feature (a command with none of them does not take it)
FEATURE_FLAGS = {"TP2": ("--tensor-parallel",), "TP2+SP": ("--sequence-parallel",), "CP2": ("--context-parallel",),
                 "PP2": ("--pipeline-parallel",), "DP2 ZeRO-1": ("--deepspeed-config",),
                 "DP2 ZeRO-2": ("--deepspeed-config",), "DP2 ZeRO-3": ("--deepspeed-config",),
                 "EP2 MoE": ("--expert-parallel",), "EP2 V3 MoE": ("--expert-parallel",), "tiled MLP": ("--tiled-mlp",),
                 "tiled loss": ("--tiled-loss",), "recompute": ("--recompute",),
                 "bf16": ("--deepspeed-config", "--dtype"), "fp16": ("--deepspeed-config", "--dtype"),
                 "FP8": ("--fp8",), "chunked loss": ("--loss-chunk-tokens",)}
POST = "tests/finetune/test_post_training_layouts.py::test_post_training_layout_equals_one_process"
CLASSIFIER = "tests/finetune/test_finetune_train.py::"


@dataclass(frozen=True)
class Use:
    """A command (or an option of one) that runs a model at a layout: its module (whose ``parse_args`` gives its
    flags), the validator's extras for it, and where it is compared with one process ({feature: test id})."""
    module: str
    extras: dict = field(default_factory=dict)
    exact: dict = field(default_factory=dict)
    ds: bool = True  # it takes a DeepSpeed config (a training command), else the validator sees none


USES = {
    "samples during pretraining (`mds-pretrain --sample-interval`)": Use(
        "pipeline.pretrain", {"sample_interval": 5},
        {"TP2": "tests/pipeline/generation/test_generate_pretrain.py::test_samples_leave_the_losses_unchanged"}),
    "generation (`mds-generate`)": Use("pipeline.generate", ds=False, exact={
        "TP2": "tests/pipeline/generation/test_generate_exact.py::test_tp2_greedy_equals_transformers_and_samples_"
               "equal_tp1"}),
    "evaluation (`mds-evaluate --checkpoint`, `--harness`)": Use("pipeline.evaluate", ds=False, exact={
        "TP2": "tests/pipeline/evaluation/test_evaluate_tp.py::test_tp_scoring_equals_tp1",
        "CP2": "tests/pipeline/training/test_context_parallel_job.py::test_evaluate_at_context_parallel_equals_one_"
               "process"}),
    "classifier finetuning (`mds-finetune`)": Use("finetune.train", exact={
        "TP2": f"{CLASSIFIER}test_tensor_and_data_parallel_finetune_equals_single_process",
        "TP2+SP": f"{CLASSIFIER}test_sequence_and_context_parallel_finetune_equal_single_process",
        "CP2": f"{CLASSIFIER}test_sequence_and_context_parallel_finetune_equal_single_process"}),
    # packed documents: each conversation attends only to itself (models/documents.py)
    "SFT over packed documents (`mds-sft`)": Use("finetune.lm.job.sft", {POST_TRAINING: "SFT"}, {
        "TP2": "tests/finetune/test_post_training_tp.py::test_sft_and_dpo_tp2_equal_tp1",
        "TP2+SP": f"{POST}[SFT TP2+SP gpt2]", "CP2": f"{POST}[SFT CP2 gpt2]", "PP2": f"{POST}[SFT PP2 gpt2]",
        "DP2 ZeRO-2": f"{POST}[SFT DP2 ZeRO-2]", "DP2 ZeRO-3": f"{POST}[SFT DP2 ZeRO-3]",
        "EP2 MoE": f"{POST}[SFT EP2 MoE]", "tiled MLP": f"{POST}[SFT TP2 tiled MLP + tiled loss]",
        "tiled loss": f"{POST}[SFT TP2 tiled MLP + tiled loss]",
        "chunked loss": "tests/finetune/test_post_training_cli.py::test_sft_loss_takes_the_memory_savers"}),
    "DPO (`mds-dpo`)": Use("finetune.lm.job.dpo", {POST_TRAINING: "DPO"}, {
        "TP2": "tests/finetune/test_post_training_tp.py::test_sft_and_dpo_tp2_equal_tp1",
        "TP2+SP": f"{POST}[DPO TP2+SP]", "CP2": f"{POST}[DPO CP2]", "DP2 ZeRO-2": f"{POST}[DPO DP2 ZeRO-2]",
        "DP2 ZeRO-3": f"{POST}[DPO DP2 ZeRO-3]",
        "EP2 MoE": f"{POST}[DPO EP2 MoE]", "tiled MLP": f"{POST}[DPO TP2 tiled MLP + tiled loss]",
        "tiled loss": f"{POST}[DPO TP2 tiled MLP + tiled loss]"}),
}


def command_flags(module: str) -> set[str]:
    """The long flags of a command's parser, as its ``--help`` builds it."""
    return {o for a in built_parser(module)[0]._actions for o in a.option_strings if o.startswith("--")}


def use_refusal(use: Use, name: str) -> str | None:
    """The validator's answer to a use at a feature's layout."""
    layout, model = cell_layout((name,))
    return refusal(LayoutCheck(layout, model_config(model), None, ds_config(layout) if use.ds else {},
                               "DeepSpeed config", extras=use.extras))


def use_cell(use: Use, name: str, flags: set[str]) -> str:
    if not flags & set(FEATURE_FLAGS[name]):
        return "not an option"
    reason = use_refusal(use, name)
    if reason:
        return f"refused: {_short(reason)}"
    return f"exact (`{use.exact[name]}`)" if name in use.exact else "allowed, not compared with one process"


# -- docs/composition.md -------------------------------------------------------------------------------------------

def _pair_cell(a: str, b: str) -> str:
    if a == b:
        reason = cell_refusal((a,))
        return f"refused: {reason}" if reason else "exact"
    if not applicable((a, b)):
        return "n/a"
    reason = cell_refusal((a, b))
    return f"refused: {_short(reason)}" if reason else "exact"


def _short(reason: str) -> str:
    return reason.split(";")[0].replace("|", "/")


def render() -> str:
    names = list(FEATURES)
    lines = ["# Composition of the parallel and memory features", "",
             "Generated by `python tests/composition.py --write` from the layout validator (`pipeline/job/layout.py`)",
             "and the composition tests; `tests/pipeline/job/test_composition.py` fails when this page, the validator",
             "and the tests disagree. Do not edit by hand.", "",
             f"Each allowed cell trains {STEPS} steps of a tiny GPT (gpt2, 4 layers, h 32; the MoE cells: 4 experts, "
             "top-2, every other layer) at its layout through DeepSpeed's engine and is compared with one process: "
             "per-step losses and DeepSpeed's global gradient norm within 1e-6 relative in fp32 (bf16, fp16 and FP8, "
             "whose one process is FP8 too: the tolerances stated in the test), and the layout is shown to be in force (the group sizes the engine "
             f"used and the collectives DeepSpeed's comms logger counted). Test: `{TEST_ID}` (one launch per world "
             "size). A refused cell is refused before any work, in one line: its reason up to the remedy is shown.",
             "", "Features: " + "; ".join(f"**{n}** ({FEATURES[n].shows})" for n in names) + ".", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        lines.append(f"| **{a}** | " + " | ".join(_pair_cell(a, b) for b in names) + " |")
    lines += ["", "Triples users run:", ""]
    for triple in TRIPLES:
        reason = cell_refusal(triple)
        lines.append(f"- {cell_id(triple)}: " + (f"refused: {_short(reason)}" if reason else "exact"))
    lines += ["", "The commands that run a model beside pretraining, with each feature alone: a feature none of "
                  "whose flags the command has is not an option of it; otherwise the same validator decides "
                  "(packed documents are SFT's: each conversation attends only to itself, `models/documents.py`; "
                  "pretraining has no packed-documents option).", ""]
    for label, use in USES.items():
        flags = command_flags(use.module)
        lines += [f"**{label}**", ""] + [f"- {name}: {use_cell(use, name, flags)}" for name in names] + [""]
    counts = count_cells()
    lines += ["", f"Cells: {counts['exact']} exact, {counts['refused']} refused, {counts['n/a']} not applicable "
                  f"(pairs of the table's upper half, singles and triples).", ""]
    return "\n".join(lines)


def count_cells() -> dict:
    out = {"exact": 0, "refused": 0, "n/a": 0}
    names = list(FEATURES)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            out["n/a" if not applicable((a, b)) else "refused" if cell_refusal((a, b)) else "exact"] += 1
    for c in [(n,) for n in names] + TRIPLES:
        out["refused" if cell_refusal(c) else "exact"] += 1
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="write docs/composition.md from the validator and the matrix")
    p.add_argument("--write", action="store_true", help="write it (default: print it)")
    args = p.parse_args()
    if args.write:
        DOC.write_text(render())
    else:
        print(render())
