"""SFT over packed conversations and DPO through DeepSpeed's engine at the layouts beyond TP x DP (ZeRO-3, tiled
MLP and loss, expert parallelism, Megatron sequence parallelism, context parallelism; SFT on pipeline stages, in full and with LoRA) equal
one process: the per-step losses and DeepSpeed's global gradient norm, each layout shown to be in force; under
sequence and context parallelism a packed row still gives what its conversations give alone. DPO's reference is live: the initial
weights frozen at the layout, as the job's frozen copy of the base. One 2-rank launch holds every cell, one
1-rank launch the references (fp32; a bf16 cell is held to its fp32 reference within bf16's rounding)."""
import collections

import datasets
import deepspeed
import pytest
import torch
from composition import FEATURES, POST, USES, use_refusal
from deepspeed.utils import groups
from dist import run_distributed
from engine_utils import GlobalBatchLoader
from lm_utils import CONVERSATIONS, smollm2_tokenizer
from test_dpo import PAIRS

import models.documents
import models.gpt
from finetune.lm.chat import tokenize_conversations, training_chat_template
from finetune.lm.dpo import collate_pairs, tokenize_pairs
from finetune.lm.job.jobs import sft_forward, sft_pipe_batch
from finetune.lm.job.preference import dpo_forward, sequence_multiple
from finetune.lm.packing import collate, pack_conversations, unpacked
from models import GPT, GPTConfig
from models.parallel import Layout, destroy_model_parallel, initialize_model_parallel, model_parallel_seed
from models.lora import LoRAConfig
from pipeline.engine.build import build_engine
from pipeline.engine.pipe_model import lora_adder
from pipeline.engine.ds_config import resolve_ds_config
from pipeline.engine.schedules import LRSchedule
from pipeline.engine.steps import optimizer_step, pipeline_step
from pipeline.job.layout import POST_TRAINING, LayoutCheck, refusal

STEPS, GLOBAL_BATCH, MICRO_BATCH, LR = 3, 4, 2, 1e-2
SMALL = dict(num_layers=2, num_heads=4, max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0,
             init_std=0.3, make_vocab_size_divisible_by=8)
MODELS = {"gpt2": dict(variant="gpt2", hidden_size=16, **SMALL),  # tied embeddings, a position table
          "llama": dict(variant="llama", hidden_size=16, num_kv_heads=2, ffn_hidden_size=32, tie_embeddings=False,
                        **SMALL),  # RoPE, grouped-query attention
          "moe": dict(variant="gpt2", hidden_size=16, num_experts=4, moe_top_k=2, moe_layer_freq=2,
                      moe_aux_loss_coeff=0.01, **SMALL)}
MODELS["moe on every stage"] = {**MODELS["moe"], "moe_layer_freq": 1}  # (pipeline.job.layout.experts_on_every_stage)
# (what, model, the layout's fields at 2 ranks)
CELLS = {
    "SFT DP2 ZeRO-2": ("SFT", "gpt2", {"zero_stage": 2}),
    "SFT DP2 ZeRO-3": ("SFT", "gpt2", {"zero_stage": 3}),
    "SFT TP2 tiled MLP + tiled loss": ("SFT", "llama", {"tensor": 2, "tiled_mlp": 2, "tiled_loss": 2}),
    "SFT EP2 MoE": ("SFT", "moe", {"expert": 2}),
    "SFT TP2+SP gpt2": ("SFT", "gpt2", {"tensor": 2, "sequence_parallel": True}),
    "SFT TP2+SP llama": ("SFT", "llama", {"tensor": 2, "sequence_parallel": True}),
    "SFT CP2 gpt2": ("SFT", "gpt2", {"context": 2}),
    "SFT CP2 llama": ("SFT", "llama", {"context": 2}),
    "SFT PP2 gpt2": ("SFT", "gpt2", {"pipeline": 2}),
    "SFT PP2 llama recompute full": ("SFT", "llama", {"pipeline": 2, "recompute": "full"}),
    "SFT PP2 MoE": ("SFT", "moe on every stage", {"pipeline": 2}),
    "SFT LoRA PP2 gpt2": ("SFT", "gpt2", {"pipeline": 2, "lora": True}),
    "SFT LoRA PP2 llama recompute full": ("SFT", "llama", {"pipeline": 2, "recompute": "full", "lora": True}),
    # DeepSpeed's bf16 optimizer (ZeRO-0) beside the frozen tied embedding of both stages (build.py)
    "SFT LoRA PP2 gpt2 bf16 ZeRO-0": ("SFT", "gpt2", {"pipeline": 2, "lora": True, "bf16": True, "zero_stage": 0}),
    "DPO DP2 ZeRO-2": ("DPO", "gpt2", {"zero_stage": 2}),
    "DPO DP2 ZeRO-3": ("DPO", "llama", {"zero_stage": 3}),
    "DPO TP2 tiled MLP + tiled loss": ("DPO", "llama", {"tensor": 2, "tiled_mlp": 2, "tiled_loss": 2}),
    "DPO EP2 MoE": ("DPO", "moe", {"expert": 2}),
    "DPO TP2+SP": ("DPO", "llama", {"tensor": 2, "sequence_parallel": True}),
    "DPO CP2": ("DPO", "gpt2", {"context": 2}),
}
# LoRA (a cell's "lora"): q and v of the fused QKV (column parallel) and the MLP's output (row parallel) of both
# layers: on pipeline stages each stage adapts its own layer
LORA_TARGETS = {f"layers.{i}.{m}": groups for i in range(2)
                for m, groups in (("attention.qkv", [(0,), (2,)]), ("mlp.fc_out", None))}
COUNTED = collections.Counter()


def _layout(fields: dict, world: int) -> Layout:
    return Layout.for_world(world, **{"zero_stage": 1, **{k: v for k, v in fields.items() if k not in ("lora", "bf16")}})


def _count(module, name: str) -> None:
    fn = getattr(module, name)
    setattr(module, name, lambda *a, **k: COUNTED.update([name]) or fn(*a, **k))


def _engine(layout: Layout, model: str, vocab: int, lora: bool, bf16: bool):
    state = initialize_model_parallel(layout=layout)
    model_parallel_seed(1234)
    ds = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 1.0, "steps_per_print": 10**9,
          "zero_optimization": {"stage": layout.zero_stage}, "optimizer": {"type": "AdamW", "params": {
              "lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True}}}
    if bf16:
        ds["bf16"] = {"enabled": True}
    if layout.zero_stage == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every weight partitioned
    ds = resolve_ds_config(ds, data_parallel=state.data_parallel, micro_batch_size=MICRO_BATCH)
    config = GPTConfig(vocab_size=vocab, **MODELS[model])
    adapt = lora_adder(config, LORA_TARGETS, LoRAConfig(4, 8.0), seed=1234) if lora else None
    engine = build_engine(config, ds, state, init_seed=1234, schedule=LRSchedule(LR, 0, STEPS, "constant"),
                          packed_rows=layout.pipeline > 1, adapt=adapt)
    return state, engine, config


def _batches(rows: list, state, make):
    """Step k's global batch is rows [4k, 4k + 4) (cycled); each data-parallel rank takes its micro-batches."""
    table = torch.arange(GLOBAL_BATCH * STEPS)[:, None] % len(rows)
    loader = GlobalBatchLoader(table, GLOBAL_BATCH, MICRO_BATCH, state.get_data_parallel_rank(), state.data_parallel)
    for micro in loader:
        yield make([rows[int(i)] for i in micro["tokens"][:, 0]])


def _train(what: str, layout: Layout, model: str, data: dict, lora: bool = False, bf16: bool = False) -> dict:
    COUNTED.clear()
    state, engine, config = _engine(layout, model, data["vocab"], lora, bf16)
    seen = []  # the embedding's output length: this rank's chunk of the sequence under SP / CP
    for embedding in (m for m in engine.module.modules() if isinstance(m, models.gpt.Embedding)):
        embedding.register_forward_hook(lambda m, i, out: seen.append((out[0] if isinstance(out, tuple) else out)
                                                                      .shape[1]))
    if what == "SFT":
        batches = _batches(data["sft"], state, lambda rows: collate(rows, data["seq_length"], data["pad"]))
        forward = sft_forward
    else:  # the live reference: the initial weights frozen, at this rank's shard of the layout (as the job's
        multiple = sequence_multiple(layout)  # frozen copy of the base), its forward at the layout as the policy's
        batches = _batches(data["pairs"], state, lambda rows: (*collate_pairs(rows, data["pad"], multiple), None))
        forward = dpo_forward(0.1, GPT(config, init_seed=1234).eval().requires_grad_(False))
    losses, norms, margins, tokens = [], [], [], []
    for _ in range(STEPS):
        if engine.is_pipe:  # (the validator allows stages to SFT only)
            record = pipeline_step(engine, batches, sft_pipe_batch, data_group=state.get_data_parallel_group())
        else:
            record = optimizer_step(engine, batches, forward, counts=("tokens",) if what == "SFT" else ())
        losses.append(record["loss"])
        tokens.append(record.get("tokens"))
        margins.append(record.get("rewards/margins"))
        norms.append(float(engine.get_global_grad_norm()))
    out = {"losses": losses, "norms": norms, "margins": margins, "tokens": tokens, "counted": dict(COUNTED),
           "chunk": seen[0] if seen else None, "pipe": engine.is_pipe,  # (a last stage embeds nothing)
           "sizes": (state.tensor_parallel, state.context_parallel, state.data_parallel, state.pipeline_parallel),
           "zero": engine.zero_optimization_stage(),
           "trained": _trained_parameters(engine, state),
           "ep": groups._get_expert_parallel_world_size("ep_size_2") if layout.expert > 1 else 1}
    if what == "SFT" and (layout.sequence_parallel or layout.context > 1):
        engine.module.eval()
        packed, alone = data["packed_all"], data["alone_all"]
        with torch.no_grad():  # the trained model: the packed rows, each conversation alone in its row, and the
            out["packed"], out["alone"] = (float(engine.module(b.input_ids, b.targets, documents=b.documents))
                                           for b in (packed, alone))
            out["crossing"] = float(engine.module(packed.input_ids, packed.targets))  # packed rows attended whole
    del engine
    destroy_model_parallel()
    return out


def _trained_parameters(engine, state) -> int:
    """The trained parameters of the whole model (summed over the pipeline's stages)."""
    count = torch.tensor(sum(p.numel() for p in engine.module.parameters() if p.requires_grad))
    if state.pipeline_parallel > 1:
        torch.distributed.all_reduce(count, group=state.get_pipe_parallel_group())
    return int(count)


def _worker(rank, todo: dict, data: dict) -> dict:
    torch.manual_seed(0)
    _count(models.gpt, "tiled_mlp")
    _count(models.gpt, "tiled_cross_entropy")
    _count(models.gpt, "tiled_row_cross_entropy")  # DPO's completions, row by row
    _count(models.documents, "UlyssesAttention")  # the packed rows' masked core under context parallelism
    _count(deepspeed.checkpointing, "checkpoint")  # full recomputation (the pipeline's layers)
    return {key: _train(what, layout, model, data, lora, bf16) for key, (what, layout, model, lora, bf16) in todo.items()}


def _data() -> dict:
    tok = smollm2_tokenizer()
    tokenized = tokenize_conversations(datasets.Dataset.from_list([{"messages": m} for m in CONVERSATIONS * 2]), tok,
                                       training_chat_template(tok))
    seq_length = -(-2 * max(len(r) for r in tokenized["input_ids"]) // 4) * 4  # split by 2, then by 2 heads
    rows = list(pack_conversations(tokenized, seq_length))
    return {"vocab": len(tok), "pad": tok.pad_token_id, "seq_length": seq_length, "sft": rows,
            "pairs": list(tokenize_pairs(datasets.Dataset.from_list(PAIRS * 2), tok)),
            "packed_all": collate(rows, seq_length, tok.pad_token_id),
            "alone_all": collate(list(unpacked(tokenized, seq_length)), seq_length, tok.pad_token_id)}


@pytest.fixture(scope="module")
def trained():
    data = _data()
    refs = {_reference(what, model, fields): (what, Layout(zero_stage=1), model, bool(fields.get("lora")), False)
            for what, model, fields in CELLS.values()}
    cells = {name: (what, _layout(fields, 2), model, bool(fields.get("lora")), bool(fields.get("bf16")))
             for name, (what, model, fields) in CELLS.items()}
    for name, (what, layout, model, *_) in cells.items():
        config = GPTConfig(vocab_size=data["vocab"], **MODELS[model])
        assert refusal(LayoutCheck(layout, config, extras={POST_TRAINING: what, "world": 2})) is None, name
    destroy_model_parallel()
    out = run_distributed(_worker, 1, refs, data, env={"OMP_NUM_THREADS": "1"})[0]
    out.update(run_distributed(_worker, 2, cells, data, env={"OMP_NUM_THREADS": "1"})[0])
    return out


def _reference(what: str, model: str, fields: dict) -> tuple:
    return ("reference", what, model) + (("lora",) if fields.get("lora") else ())


def _rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("name", CELLS)
def test_post_training_layout_equals_one_process(name, trained):
    what, model, fields = CELLS[name]
    layout = _layout(fields, 2)
    got, ref = trained[name], trained[_reference(what, model, fields)]
    loss, norm = _rel(got["losses"], ref["losses"]), _rel(got["norms"], ref["norms"])
    print(f"{name}: losses {loss:.1e}, gradient norms {norm:.1e} from one process; losses {got['losses']}")
    # measured (fp32), losses / gradient norms: SFT ZeRO-2 0 / 0, ZeRO-3 5.2e-8 / 8.6e-8, tiled MLP + loss 4.6e-8 /
    # 2.2e-7, EP2 9.6e-8 / 0, TP2+SP 0 / 1.4e-7, CP2 8.0e-8 / 9.5e-8; DPO with its live reference (an AVX-512 CPU)
    # ZeRO-2 0 / 6.4e-8, ZeRO-3 4.6e-7 / 4.8e-7, tiled MLP + loss 8.0e-7 / 6.9e-7, EP2 9.9e-8 / 8.6e-8, TP2+SP
    # 5.6e-7 / 3.5e-7, CP2 0 / 0; SFT on pipeline stages PP2 gpt2 9.7e-8 / 6.1e-8, llama (recompute full)
    # 4.6e-8 / 7.5e-8, MoE 5.4e-8 / 1.0e-7; with LoRA gpt2 0 / 0, llama (recompute full) 4.1e-8 / 7.8e-8
    if fields.get("bf16"):  # against the fp32 run: bf16's rounding (measured 3.1e-4 / 1.4e-3)
        assert loss < 3e-3 and norm < 1.5e-2
    else:
        assert loss < 2e-6 and norm < 2e-6
    if what == "SFT":  # the assistant tokens counted over the global batch, as one process counts them
        assert got["tokens"] == ref["tokens"] and ref["tokens"][0] > 0
    if what == "DPO":  # the live reference: no margin at step 1 (the policy is the reference), then one process's
        margins = _rel(got["margins"][1:], ref["margins"][1:])
        print(f"{name}: reward margins {got['margins']}, {margins:.1e} from one process")
        assert ref["margins"][0] == 0.0 and abs(got["margins"][0]) < 1e-6 and margins < 1e-4
    assert ref["losses"][-1] < ref["losses"][0]
    # the layout was in force
    assert got["sizes"] == (layout.tensor, layout.context, layout.data, layout.pipeline)
    assert got["zero"] == layout.zero_stage and got["pipe"] == (layout.pipeline > 1)
    assert (got["counted"].get("checkpoint", 0) > 0) == (layout.recompute == "full")
    assert got["ep"] == layout.expert
    if fields.get("lora"):  # the adapters only, each stage's own: together the one process's
        assert got["trained"] == ref["trained"] and 0 < ref["trained"] < trained[("reference", what, model)]["trained"]
    split = sequence_multiple(layout)  # (DPO's rows padded up to a multiple of it)
    assert got["chunk"] == -(-ref["chunk"] // split)
    assert (got["counted"].get("UlyssesAttention", 0) > 0) == (what == "SFT" and layout.context > 1)
    if "packed" in got:
        alone = abs(got["packed"] - got["alone"]) / got["alone"]
        print(f"{name}: a packed row vs its conversations alone {alone:.1e}")
        assert alone < 1e-6  # measured 0 (SP, CP gpt2), 1.1e-7 (CP llama)
        assert abs(got["crossing"] - got["alone"]) / got["alone"] > 1e-3  # the boundaries matter here
    assert (got["counted"].get("tiled_mlp", 0) > 0) == (layout.tiled_mlp > 1)
    tiled_loss = "tiled_row_cross_entropy" if what == "DPO" else "tiled_cross_entropy"
    assert (got["counted"].get(tiled_loss, 0) > 0) == (layout.tiled_loss > 1)


def test_the_composition_page_names_these_cells_for_sft_and_dpo():
    """docs/composition.md's SFT and DPO lines (tests/composition.py's USES): each feature they call exact here is
    a cell of this module for that command at that feature's layout, and the validator allows it."""
    for use in USES.values():
        what = use.extras.get(POST_TRAINING)
        for feature, where in use.exact.items() if what else ():
            assert use_refusal(use, feature) is None, (what, feature)
            if where.startswith(POST):
                trained, _, fields = CELLS[where[len(POST) + 1:-1]]
                wanted = {k: v for k, v in FEATURES[feature].layout.items() if k != "zero_stage" or v > 1}
                assert trained == what and wanted.items() <= _layout(fields, 2).__dict__.items(), (what, feature)
