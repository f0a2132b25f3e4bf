"""The composition matrix (tests/composition.py): every cell the layout validator allows trains 4 steps through
DeepSpeed's engine exactly as one process (per-step losses and DeepSpeed's global gradient norm), with its layout
shown to be in force; every cell it refuses is refused by the job in one line, exit 2, before any work; and
docs/composition.md is what the validator and the matrix give. One launch per world size (1, 2, 4, 8 ranks), many
cells each."""
import collections

import deepspeed.comm as dc
import pytest
import torch
from composition import (DOC, GLOBAL_BATCH, MICRO_BATCH, ROOT, STEPS, USES, cell_id, cell_layout, cell_refusal, cells,
                         ds_config, model_config, render)
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups
from dist import run_distributed
from engine_utils import GlobalBatchLoader, real_text_tokens

import models.gpt
import models.moe.grouped
import models.moe.layer
from models.parallel import cross_entropy
from models.parallel.fp8 import Float8Matmul, enable_fp8
from models.parallel import Layout, destroy_model_parallel, initialize_model_parallel, model_parallel_seed
from models.moe import expert_bias_gates
from models.recompute import DiscardedOutput
from pipeline.engine.build import build_engine
from pipeline.engine.ds_config import resolve_ds_config
from pipeline.engine.schedules import LRSchedule
from pipeline.engine.steps import lm_batches, train_step

# measured on this CPU, largest over the cells (losses / gradient norms): fp32 8.7e-8 / 1.4e-7 from one process; bf16
# 7.1e-5 / 1.5e-3 and fp16 1.2e-4 / 2.3e-3 (the DeepSeek-V3-style MoE) from one process of the same precision (their reductions round in other
# orders); one bf16 / fp16 process from the fp32 one: 1.1e-4 / 1.6e-3 and 3.2e-6 / 4.0e-4. FP8 (tensorwise) from one
# FP8 process: 6.7e-8 / 1.3e-7 (its amaxes reduced over TP and CP); one FP8 process from one fp32 process: fp32
# 2.9e-5 / 2.5e-3, bf16 2.1e-4 / 9.7e-3, fp16 8.5e-5 / 2.8e-3
# FP8 against one process in FP8: an fp32 difference of 1e-7 (another layout's order of sums) can move a value
# across an FP8 rounding boundary, so a cell's gradient norm can differ by more than fp32's noise (measured
# 2026-12-05: CP2 x FP8 7.8e-6 on an AVX-512 CPU, under 1e-6 on an earlier one)
TOLERANCE = {"fp32": 1e-6, "bf16": 1.5e-2, "fp16": 5e-3, "fp32 FP8": 5e-5, "bf16 FP8": 1.5e-2, "fp16 FP8": 5e-3}
VS_FP32 = {"bf16": 1.6e-2, "fp16": 4e-3, "fp32 FP8": 2.5e-2, "bf16 FP8": 5e-2, "fp16 FP8": 2e-2}
COUNTED = collections.Counter()


def _count(module, name: str, key: str) -> None:
    """Count the calls of ``module.name`` (the project's own tiling functions) under ``key``."""
    fn = getattr(module, name)
    setattr(module, name, lambda *a, **k: COUNTED.update([key]) or fn(*a, **k))


def _counting() -> None:
    _count(models.gpt, "tiled_mlp", "tiled_mlp")
    _count(models.moe.layer, "tiled_mlp", "tiled_mlp")
    _count(models.moe.grouped, "tiled_mlp", "tiled_mlp")
    _count(models.gpt, "tiled_cross_entropy", "tiled_loss")
    recompute = DiscardedOutput._recompute
    DiscardedOutput._recompute = lambda self, grad: COUNTED.update(["recomputed"]) or recompute(self, grad)
    chunked = cross_entropy._ChunkedVocabParallelCrossEntropy.forward
    cross_entropy._ChunkedVocabParallelCrossEntropy.forward = staticmethod(
        lambda ctx, *a: COUNTED.update(["chunked_loss"]) or chunked(ctx, *a))
    fp8_matmul = Float8Matmul.__call__
    Float8Matmul.__call__ = lambda self, x, weight: COUNTED.update(["fp8"]) or fp8_matmul(self, x, weight)


def through_scaled_mm(layout: Layout) -> bool:
    """Whether a cell's FP8 products (and its reference's) run through torch's ``_scaled_mm``, not the CPU's
    default, torchao's emulation: at TP 2. The emulation's fp32 matmuls sum in an order that follows the shard's
    shape, which moves values across FP8 rounding boundaries: TP2 (+SP) x FP8 emulated 3.8e-5 / 1.4e-3 from one
    process (2026-12-06), 6.3e-3 with the amaxes not reduced over TP, too close to tell apart; CPU ``_scaled_mm``
    (a reference loop, ~7 s a cell) sums in one order at any shape: 6.7e-8 / 1.3e-7."""
    return bool(layout.fp8) and layout.tensor > 1


def _train(layout: Layout, model: str, scaled_mm: bool) -> dict:
    """4 steps at ``layout``: losses, gradient norms and what shows the layout was in force."""
    COUNTED.clear()
    state, engine, batches = cell_engine(layout, model_config(model), STEPS, scaled_mm)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(train_step(engine, batches))
        norms.append(float(engine.get_global_grad_norm()))
    shown = layout_shown(engine, state, layout)
    del engine
    destroy_model_parallel()
    return {"losses": losses, "norms": norms, "shown": shown}


def cell_engine(layout: Layout, config, steps: int, scaled_mm: bool = False) -> tuple:
    """(the process groups, DeepSpeed's engine of ``config``, the batches of ``steps`` steps) of a cell at ``layout``,
    the comms logger cleared: micro-batches of ``MICRO_BATCH`` rows of a fixed table, the same at every layout.
    ``scaled_mm``: the FP8 products through torch's ``_scaled_mm`` (``through_scaled_mm``)."""
    state = initialize_model_parallel(layout=layout)
    model_parallel_seed(1234)
    ds = resolve_ds_config(ds_config(layout), data_parallel=state.data_parallel,
                           pipeline_parallel=state.pipeline_parallel, micro_batch_size=MICRO_BATCH)
    dc.comms_logger.comms_dict.clear()
    engine = build_engine(config, ds, state, init_seed=1234, schedule=LRSchedule(3e-3, 2, steps, "cosine"))
    if scaled_mm:
        enable_fp8(engine.module, layout.fp8, emulate=False)
    table = real_text_tokens(GLOBAL_BATCH * steps)
    batches = lm_batches(GlobalBatchLoader(table, GLOBAL_BATCH, ds["train_micro_batch_size_per_gpu"],
                                           state.get_data_parallel_rank(), state.data_parallel))
    return state, engine, batches


def layout_shown(engine, state, layout: Layout) -> dict:
    """What shows ``layout`` was in force in a run of ``engine`` (``assert_in_force`` reads it): the group sizes
    the engine used, the collectives DeepSpeed's comms logger counted since it was cleared, the project's own
    counters, the weights' dtype, this rank's balancing biases."""
    name = f"ep_size_{layout.expert}"
    return {"sizes": (state.tensor_parallel, state.context_parallel, state.pipeline_parallel, state.data_parallel),
            "zero": engine.zero_optimization_stage(), "pipe_stages": engine.num_stages if engine.is_pipe else 1,
            "ep": groups._get_expert_parallel_world_size(name) if name in groups._EXPERT_PARALLEL_GROUP else 0,
            "expert_data": (groups._get_expert_data_parallel_world_size(name)
                            if name in groups._EXPERT_DATA_PARALLEL_GROUP else 0),
            "sp_world": groups._get_sequence_parallel_world_size(),
            "ops": sorted(dc.comms_logger.comms_dict), "counted": _counted_on_any_rank(),
            "dtype": str(next(engine.module.parameters()).dtype), "bias": _balancing_bias(engine.module)}


def _balancing_bias(module) -> list[float]:
    """The auxiliary-loss-free balancing biases of this rank's MoE layers, in layer order."""
    return [float(b) for gate in expert_bias_gates(module) for b in gate.balance_bias]


def _counted_on_any_rank() -> dict:
    """COUNTED summed over the ranks (a pipeline's loss runs on its last stage, not on rank 0), outside DeepSpeed's
    comms logger."""
    keys = ("tiled_mlp", "tiled_loss", "recomputed", "fp8", "chunked_loss")
    counts = torch.tensor([COUNTED[k] for k in keys], dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    return {k: int(v) for k, v in zip(keys, counts.tolist()) if v}


def _cells_worker(rank, todo) -> dict:
    get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed's CPU accelerator refuses fp16 otherwise
    torch.manual_seed(0)
    _counting()
    return {key: _train(layout, model, scaled_mm) for key, (layout, model, scaled_mm) in todo.items()}


def _one_process(layout: Layout) -> Layout:
    return Layout(precision=layout.precision, zero_stage=1, fp8=layout.fp8)


def _reference_key(layout: Layout, model: str, scaled_mm: bool = False) -> tuple:
    return ("reference", model, layout.precision, layout.fp8, scaled_mm)


@pytest.fixture(scope="module")
def trained():
    """{cell or reference key: rank 0's result}: one launch per world size."""
    by_world = collections.defaultdict(dict)
    for names in cells():
        if cell_refusal(names) is None:
            layout, model = cell_layout(names)
            scaled_mm = through_scaled_mm(layout)
            by_world[layout.world][names] = (layout, model, scaled_mm)
            by_world[1][_reference_key(layout, model, scaled_mm)] = (_one_process(layout), model, scaled_mm)
            by_world[1][_reference_key(layout.replace(precision="fp32", fp8=None), model)] = (Layout(zero_stage=1),
                                                                                             model, False)
    out = {}
    for world, todo in sorted(by_world.items()):
        out.update(run_distributed(_cells_worker, world, todo, env={"OMP_NUM_THREADS": "1"})[0])
    return out


def _rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def assert_in_force(names, layout: Layout, shown: dict) -> None:
    ops = " ".join(shown["ops"])
    assert shown["sizes"] == (layout.tensor, layout.context, layout.pipeline, layout.data)
    assert shown["zero"] == layout.zero_stage and shown["pipe_stages"] == layout.pipeline
    if layout.pipeline == 1:  # DeepSpeed's own context group (its pipeline grid counts CP ranks as data ranks)
        assert shown["sp_world"] == layout.context
    checks = {"TP2": "tp/" in ops, "TP2+SP": "tp/all_gather" in ops and "tp/reduce_scatter" in ops,
              "CP2": "all_to_all_single" in shown["ops"], "PP2": "send" in ops and "recv" in ops,
              # (under CP, ZeRO-3 reduces by all-reduce: pipeline.engine.ds_config.context_parallel_ds_config)
              "DP2 ZeRO-3": "all_gather" in ops and ("reduce_scatter" in ops or layout.context > 1),
              "EP2 MoE": "ep/" in ops and shown["ep"] == 2 and shown["expert_data"] == layout.data * layout.context // 2,
              "EP2 V3 MoE": ("ep/" in ops and shown["ep"] == 2 and shown["expert_data"] == layout.data * layout.context // 2
                             and any(shown["bias"])),
              "tiled MLP": shown["counted"].get("tiled_mlp", 0) > 0,
              "tiled loss": shown["counted"].get("tiled_loss", 0) > 0,
              "recompute": shown["counted"].get("recomputed", 0) > 0,
              "bf16": shown["dtype"] == "torch.bfloat16", "fp16": shown["dtype"] == "torch.float16",
              "FP8": shown["counted"].get("fp8", 0) > 0, "chunked loss": shown["counted"].get("chunked_loss", 0) > 0}
    failed = [name for name in names if not checks.get(name, True)]
    assert not failed, (cell_id(names), failed, shown)


@pytest.mark.parametrize("names", [c for c in cells() if cell_refusal(c) is None], ids=cell_id)
def test_composition_cells(names, trained):
    layout, model = cell_layout(names)
    alone = layout == _one_process(layout)  # bf16, fp16 or FP8 alone: against fp32, else its own reference
    ref = trained[_reference_key(layout.replace(precision="fp32", fp8=None), model) if alone
                  else _reference_key(layout, model, through_scaled_mm(layout))]
    got = trained[names]
    loss_rel, norm_rel = _rel(got["losses"], ref["losses"]), _rel(got["norms"], ref["norms"])
    print(f"{cell_id(names)} ({layout}): losses {loss_rel:.1e}, gradient norms {norm_rel:.1e} from one "
          f"{'fp32 ' if alone else ''}process")
    kind = layout.precision + (" FP8" if layout.fp8 else "")
    tol = VS_FP32[kind] if alone else TOLERANCE[kind]
    assert loss_rel < tol and norm_rel < tol, (got, ref)
    # the balancing bias moves by sign(mean load - load) from the global counts: the same steps at every layout
    # (rank 0's layers: a pipeline's first stage holds the first ones). In bf16 / fp16 a near-tie of two experts'
    # scores can route a token elsewhere than one process does, and a bias entry then steps the other way (measured)
    bias = got["shown"]["bias"]
    if layout.precision == "fp32":
        assert bias == ref["shown"]["bias"][:len(bias)], (bias, ref["shown"]["bias"])
    assert_in_force(names, layout, got["shown"])


def test_the_composition_page_is_what_the_validator_and_the_matrix_give():
    assert DOC.read_text() == render(), "docs/composition.md is stale: run python tests/composition.py --write"


def test_every_test_the_page_names_exists():
    """Each test id docs/composition.md gives a command's cell names a test function of its file."""
    for use in USES.values():
        for where in use.exact.values():
            path, _, function = where.partition("::")
            assert f"def {function.split('[')[0]}(" in (ROOT / path).read_text(), where
