"""torch.compile per transformer block (models/compile.py): one forward and one backward graph per block, no graph
break, at TP 1 and 2, with and without sequence parallelism, with FP8 linears too, with DeepSpeed's comms logger on
(which broke the graph 13-30 times per block before the TP collectives became custom ops), with dropout drawn from the
model-parallel RNG (10 breaks per block before its draws became custom ops), under selective recomputation of each
module (refused before: DeepSpeed's checkpoint inside a block), whose forward ops its backward graph then holds; and
the compiled GPT (inductor) equals the eager one in fp32: loss and every gradient, with and without FP8, with dropout
(the same masks), and a DeepSpeed engine recomputing (full or selective) trains as the eager one, on pipeline
stages, with experts and with a tiled MLP too (two graphs around the eager routing or tiles)."""
import contextlib

import deepspeed
import deepspeed.comm as ds_comm
import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from dist import run_distributed
from engine_utils import BASE_DS, TINY, GlobalBatchLoader, real_text_tokens
from models import GPT, GPTConfig
from models.compile import compile_transformer_layers
from models.gpt import TransformerLayer, select_recompute_modules
from models.parallel import (Layout, destroy_model_parallel, full_state_dict, get_parallel_state, get_rng_tracker,
                             initialize_model_parallel, model_parallel_seed, tp_world_size)
from models.parallel import random as parallel_random
from models.parallel.fp8 import RECIPES, enable_fp8
from pipeline.engine.build import build_engine
from pipeline.engine.ds_config import resolve_ds_config
from pipeline.engine.steps import lm_batches, train_step
from test_tensor_parallel import CONFIGS, _batch

# measured, inductor against eager in fp32 (|loss difference|, max |gradient difference| / max |gradient| over the
# parameters): TP1 gpt2 4.8e-7 and 3.2e-7, llama 0 and 3.9e-7; TP2 + SP gpt2 0 and 4.7e-7, llama 0 and 4.9e-7;
# with FP8 linears (compiled FP8 against eager FP8) at TP1: 0 and at most 5.3e-7, both recipes
TOLERANCE = 1e-5
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
# (ZeRO stage, selective recomputation's modules; none: full recomputation)
ENGINE_CASES = ((1, ()), (2, ()), (1, ("core_attn", "mlp_act", "layernorm")), (2, ("mlp",)))
# every other block MoE (the composition matrix's): 4 experts, top-2, the balancing loss
MOE = dict(num_experts=4, moe_top_k=2, moe_layer_freq=2, moe_aux_loss_coeff=0.01)


def _layout(sequence_parallel: bool) -> Layout:
    return get_parallel_state().layout.replace(sequence_parallel=sequence_parallel)


def build_block(variant: str, sequence_parallel: bool = False, fp8: str | None = None,
                dropout: bool = False) -> TransformerLayer:
    """One block of the tests' tiny GPT (the one place that says how a block is configured), its linears in FP8
    with torchao's recipe ``fp8``, with dropout 0.1 (hidden and attention) or none."""
    config = GPTConfig(**{**CONFIGS[variant], **(DROPOUT if dropout else {})})
    block = TransformerLayer(config, _layout(sequence_parallel), init_seed=0)
    if fp8:
        enable_fp8(block, fp8)
    return block


def build_gpt(variant: str, sequence_parallel: bool = False, fp8: str | None = None, dropout: bool = False) -> GPT:
    config = GPTConfig(**{**CONFIGS[variant], **(DROPOUT if dropout else {})})
    model = GPT(config, init_seed=7, layout=_layout(sequence_parallel))
    if fp8:
        enable_fp8(model, fp8)
    return model


def count_graphs(block: torch.nn.Module, x: torch.Tensor) -> dict:
    """Compile ``block`` with a backend that counts the forward and backward graphs AOTAutograd hands over (one
    each when nothing breaks the trace), run it forward and backward; and the graph breaks Dynamo counted."""
    torch._dynamo.reset()
    counters.clear()
    graphs = {"forward": 0, "backward": 0}

    def counting(kind):
        def compiler(gm, example_inputs):
            graphs[kind] += 1
            return make_boxed_func(gm.forward)
        return compiler

    block.compile(backend=aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward")))
    block(x).sum().backward()
    return {**graphs, "breaks": sum(counters["graph_break"].values())}


# gpt2: an op of each recompute module's forward that a compiled block's backward holds only where it recomputes
# the module (inductor's partitioner, min-cut, recomputes some cheap ops of its own choice, none of these)
RECOMPUTED_OPS = {"core_attn": "aten._softmax.default", "mlp": "aten.addmm.default", "mlp_act": "aten.gelu.default",
                  "layernorm": "aten.native_layer_norm.default"}


def recomputing_graphs(modules: tuple[str, ...], dropout: bool = True) -> dict:
    """The gpt2 block (SP, dropout or none) recomputing ``modules`` compiled as inductor partitions it: its graphs,
    breaks, and which of ``RECOMPUTED_OPS`` its backward graph computes."""
    torch._dynamo.reset()
    counters.clear()
    block = build_block("gpt2", True, dropout=dropout)
    select_recompute_modules(block, deepspeed.checkpointing.checkpoint, modules)  # eager's; compiled: torch's
    graphs = {"forward": [], "backward": []}

    def keeping(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    block.compile(backend=aot_autograd(fw_compiler=keeping("forward"), bw_compiler=keeping("backward"),
                                       partition_fn=min_cut_rematerialization_partition), fullgraph=True)
    block(_block_input(True)).sum().backward()
    ops = {str(n.target) for gm in graphs["backward"] for n in gm.graph.nodes if n.op == "call_function"}
    return {"forward": len(graphs["forward"]), "backward": len(graphs["backward"]),
            "breaks": sum(counters["graph_break"].values()),
            "recomputed": sorted(m for m, op in RECOMPUTED_OPS.items() if op in ops)}


def _block_input(sequence_parallel: bool) -> torch.Tensor:
    seq = 8 // (tp_world_size() if sequence_parallel else 1)
    return torch.randn(2, seq, CONFIGS["gpt2"]["hidden_size"], generator=torch.Generator().manual_seed(1),
                       requires_grad=True)


def _compiled_against_eager(variant: str, sequence_parallel: bool, fp8: str | None = None,
                            dropout: bool = False) -> dict:
    """Loss and gradients of the GPT with inductor-compiled blocks against the same GPT eager (with ``dropout``:
    each from the same state of every RNG stream, so that both draw the same masks)."""
    torch._dynamo.reset()
    models = [build_gpt(variant, sequence_parallel, fp8, dropout) for _ in range(2)]
    eager, compiled = models
    assert compile_transformer_layers(compiled, fullgraph=True) == CONFIGS[variant]["num_layers"]
    ids, labels = _batch()
    losses, streams = [], (torch.get_rng_state(), get_rng_tracker().get_states())
    for model in (eager, compiled):
        torch.set_rng_state(streams[0])
        get_rng_tracker().set_states(dict(streams[1]))
        loss = model(ids, labels)
        loss.backward()
        losses.append(loss.detach())
    grads = [full_state_dict(m, grads=True) for m in (eager, compiled)]
    names = [n for n, _ in eager.named_parameters()]
    assert names == [n for n, _ in compiled.named_parameters()]  # compiled in place: the same state dict
    return {"loss": (losses[1] - losses[0]).abs().item(),
            "grad": max(((grads[1][n] - grads[0][n]).abs().max() / grads[0][n].abs().max()).item() for n in names)}


@pytest.mark.parametrize("fp8", [None, *RECIPES])
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_one_graph_per_block_at_tp1(variant, fp8):
    destroy_model_parallel()
    graphs = count_graphs(build_block(variant, fp8=fp8), _block_input(False))
    assert graphs == {"forward": 1, "backward": 1, "breaks": 0}


def test_compiled_fp8_gpt_equals_eager_at_tp1():
    """(without FP8, gpt2 and llama are compared at TP2 + SP below: the same blocks with the collectives in)"""
    destroy_model_parallel()
    diff = _compiled_against_eager("llama", False, "tensorwise")
    assert diff["loss"] <= TOLERANCE and diff["grad"] <= TOLERANCE, diff


@contextlib.contextmanager
def attention_as_on_a_gpu():
    """Compiled attention with dropout as where SDPA drops in its fused kernel: one custom op, recomputed in its
    backward (on a CPU, SDPA with dropout is its math path, which the compiled block holds itself)."""
    kept = parallel_random.MATH_ATTENTION_DEVICES
    parallel_random.MATH_ATTENTION_DEVICES = ()
    try:
        yield
    finally:
        parallel_random.MATH_ATTENTION_DEVICES = kept


def _engine_losses(state, compile: bool, zero_stage: int, modules: tuple[str, ...] = (),
                   steps: int = 3, recompute: str = "full", model: dict | None = None) -> tuple[list[float], dict]:
    """Losses of a DeepSpeed engine (ZeRO ``zero_stage``; full recomputation, DeepSpeed's checkpoint around each
    block, which replays the RNG streams for the recomputed dropout, or selective recomputation of ``modules``)
    training the engine tests' tiny gpt2 with sequence parallelism and dropout 0.1, its blocks compiled (whole:
    fullgraph; by AOTAutograd without inductor's code generation, whose numerics the other tests measure) or eager;
    and how many graphs Dynamo compiled (a guard that failed at each step, on the RNG tracker's states say, would
    compile more) and the graph breaks it counted."""
    # pipeline stages: 2 micro-batches; data parallelism: each rank its rows
    micro = BASE_DS["train_batch_size"] // state.pipeline_parallel // state.data_parallel
    ds = resolve_ds_config({**BASE_DS, "zero_optimization": {"stage": zero_stage}}, data_parallel=state.data_parallel,
                           pipeline_parallel=state.pipeline_parallel, micro_batch_size=micro)
    model_parallel_seed(1234)
    config = GPTConfig(**{**TINY, **DROPOUT, **(model or {})})
    engine = build_engine(config, ds, state, init_seed=1234,  # the state's layout
                          recompute="selective" if modules else recompute, recompute_modules=modules or None)
    counters.clear()
    if compile:
        torch._dynamo.reset()
        # an MoE block breaks once (its routed experts run eagerly), a tiled MLP's block too (its tiles)
        compile_transformer_layers(engine.module, backend="aot_eager",
                                   fullgraph=not (config.num_experts or state.layout.tiled_mlp > 1))
    batch = BASE_DS["train_batch_size"]
    batches = lm_batches(GlobalBatchLoader(real_text_tokens(batch * steps), batch, micro,
                                           state.get_data_parallel_rank(), state.data_parallel))
    losses = [train_step(engine, batches) for _ in range(steps)]
    return losses, {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def _tp2(rank):
    initialize_model_parallel(tensor_parallel=2)
    model_parallel_seed(1234)
    ds_comm.configure(enabled=True, prof_all=True)  # the comms logger times every call: no trace may see it
    out = {f"{variant} sp={sp}": count_graphs(build_block(variant, sp), _block_input(sp))
           for variant in ("gpt2", "llama") for sp in (False, True)}
    out |= {f"{variant} sp=True {fp8}": count_graphs(build_block(variant, True, fp8), _block_input(True))
            for variant in ("gpt2", "llama") for fp8 in RECIPES}
    out |= {f"{variant} sp={sp} dropout": count_graphs(build_block(variant, sp, dropout=True), _block_input(sp))
            for variant in ("gpt2", "llama") for sp in (False, True)}
    out["numerics"] = {variant: _compiled_against_eager(variant, True) for variant in ("gpt2", "llama")}
    out["numerics"]["gpt2 dropout"] = _compiled_against_eager("gpt2", True, dropout=True)
    cases = [(m, True) for m in ((), *((m,) for m in RECOMPUTED_OPS), ("core_attn", "mlp_act", "layernorm"))]
    cases.append((("core_attn",), False))  # the short sequences' attention of a CPU
    out["recomputing"] = {case: recomputing_graphs(*case) for case in cases}
    with attention_as_on_a_gpu():
        out["llama sp=True dropout, the fused kernel's op"] = count_graphs(build_block("llama", True, dropout=True),
                                                                           _block_input(True))
        out["numerics"]["gpt2 dropout, the fused kernel's op"] = _compiled_against_eager("gpt2", True, dropout=True)
    ds_comm.configure(enabled=False)
    state = initialize_model_parallel(layout=Layout(tensor=2, sequence_parallel=True))
    out["engine"] = {(zero, modules): (_engine_losses(state, False, zero, modules),
                                       _engine_losses(state, True, zero, modules))
                     for zero, modules in ENGINE_CASES}
    return out


def test_tp2_one_graph_per_block_and_compiled_equals_eager():
    """The blocks' graphs and numerics at TP2 (+SP); and a DeepSpeed engine at ZeRO 1 and 2 with DeepSpeed's
    activation checkpointing around the compiled blocks, with dropout, trains as the eager one does, the blocks
    sharing two graphs (the no-grad forward, the recomputing one) and none compiled again."""
    for rank, res in enumerate(run_distributed(_tp2, 2)):
        for (zero, modules), ((eager, _), (compiled, graphs)) in res.pop("engine").items():
            assert max(abs(a - b) for a, b in zip(eager, compiled)) <= TOLERANCE, (rank, zero, modules, eager, compiled)
            assert graphs == {"graphs": 1 if modules else 2, "breaks": 0}, (rank, zero, modules, graphs)  # selective:
            # no no-grad forward
        for (modules, _), graphs in res.pop("recomputing").items():  # selective recomputation, compiled
            recomputed = set(modules) | ({"mlp_act"} if "mlp" in modules else set())  # the MLP: its activation too
            assert graphs == {"forward": 1, "backward": 1, "breaks": 0, "recomputed": sorted(recomputed)}, (rank, graphs)
        numerics = res.pop("numerics")
        for case, graphs in res.items():
            assert graphs == {"forward": 1, "backward": 1, "breaks": 0}, (rank, case)
        for variant, diff in numerics.items():
            assert diff["loss"] <= TOLERANCE and diff["grad"] <= TOLERANCE, (rank, variant, diff)


def _cp2_pp2_ep2(rank):
    initialize_model_parallel(layout=Layout(context=2))
    model_parallel_seed(1234)
    out = {f"{variant} dropout={dropout}": count_graphs(build_block(variant, dropout=dropout), _block_input(False))
           for variant in ("gpt2", "llama") for dropout in (False, True)}
    out |= {f"llama {fp8}": count_graphs(build_block("llama", fp8=fp8), _block_input(False)) for fp8 in RECIPES}
    out["numerics"] = {"gpt2 dropout": _compiled_against_eager("gpt2", False, dropout=True),
                       "llama": _compiled_against_eager("llama", False),
                       "llama rowwise": _compiled_against_eager("llama", False, "rowwise")}
    destroy_model_parallel()
    state = initialize_model_parallel(layout=Layout(pipeline=2))
    out["pipeline"] = {recompute: (_engine_losses(state, False, 1, recompute=recompute),
                                   _engine_losses(state, True, 1, recompute=recompute))
                       for recompute in ("none", "full")}
    destroy_model_parallel()
    state = initialize_model_parallel(layout=Layout(expert=2))
    out["experts"] = {zero: (_engine_losses(state, False, zero, recompute="none", model=MOE),
                             _engine_losses(state, True, zero, recompute="none", model=MOE)) for zero in (1, 2)}
    out["tiled"] = {}
    for zero, tiled_loss in ((1, 2), (2, 1)):  # (ZeRO-2 refuses the tiled loss with tied embeddings)
        destroy_model_parallel()
        state = initialize_model_parallel(layout=Layout(tiled_mlp=2, tiled_loss=tiled_loss))
        out["tiled"][zero] = (_engine_losses(state, False, zero, recompute="none"),
                              _engine_losses(state, True, zero, recompute="none"))
    return out


def test_cp2_pp2_ep2_compiled_blocks_equal_eager():
    """Context parallelism (DeepSpeed-Ulysses, 2 ranks): one graph each way per block, with the residual dropout
    drawn from the context-parallel stream and llama's RoPE at the chunk's global positions (a positions tensor's
    largest, read back to the host, broke the block 3 times); compiled equals eager, with FP8 linears too (their
    amaxes MAX-reduced over the context group by a custom op, where an eager collective broke the trace). Pipeline stages (2 ranks, 2
    micro-batches, ZeRO-1, dropout 0.1): DeepSpeed's pipeline engine runs the compiled blocks of its stage, with its
    activation checkpointing around each or without, as it runs the eager ones. Experts (EP 2, every other block MoE,
    ZeRO-1 and 2): each MoE block compiles around its routed experts, which run eagerly, and trains as eager. ALST's
    tiled MLP (ZeRO-1 with the tiled loss, which stays outside the blocks, and ZeRO-2): each block compiles around the
    MLP's tiles, and trains as eager."""
    for rank, res in enumerate(run_distributed(_cp2_pp2_ep2, 2)):
        for recompute, ((eager, _), (compiled, graphs)) in res.pop("pipeline").items():
            assert max(abs(a - b) for a, b in zip(eager, compiled)) <= TOLERANCE, (rank, recompute, eager, compiled)
            assert graphs == {"graphs": 2 if recompute == "full" else 1, "breaks": 0}, (rank, recompute, graphs)
        for zero, ((eager, _), (compiled, graphs)) in res.pop("experts").items():
            assert max(abs(a - b) for a, b in zip(eager, compiled)) <= TOLERANCE, (rank, zero, eager, compiled)
            # the dense blocks' graph and the MoE blocks' two, around their eager routing: shared, not one per layer
            assert graphs["graphs"] == 3 and graphs["breaks"] >= 1, (rank, zero, graphs)
        for zero, ((eager, _), (compiled, graphs)) in res.pop("tiled").items():
            assert max(abs(a - b) for a, b in zip(eager, compiled)) <= TOLERANCE, (rank, zero, eager, compiled)
            assert graphs["graphs"] == 2 and graphs["breaks"] >= 1, (rank, zero, graphs)  # around the MLP's tiles
        numerics = res.pop("numerics")
        for case, graphs in res.items():
            assert graphs == {"forward": 1, "backward": 1, "breaks": 0}, (rank, case, graphs)
        for variant, diff in numerics.items():
            assert diff["loss"] <= TOLERANCE and diff["grad"] <= TOLERANCE, (rank, variant, diff)
