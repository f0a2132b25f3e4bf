"""Activation recomputation policies (``--recompute none|selective|full``): what one layer saves, and the step time.

TP gloo CPU ranks build the same gpt2 GPT (bf16, or ``--dtype fp32``; dropout 0.1 everywhere, as in Korthikanti
et al. 2022) with each policy wired by ``pipeline.engine.build``'s own switches (``select_recompute_modules`` for
selective: core_attn, each of mlp_act, mlp (the whole MLP) and layernorm alone, and core_attn + mlp_act + layernorm; the model's ``checkpoint_fn`` for full; DeepSpeed's ``checkpointing.checkpoint``, which restores the
model-parallel RNG streams), and count the bytes autograd saves for the backward of one TransformerLayer
(bench/activation_memory.py's census: each storage once, parameters left out, plus the inputs DeepSpeed's
checkpoint keeps on its ctx) beside the planner's
``pipeline.planning.memory.layer_activations`` for the same shape and policy (the paper's formulas:
sbh (10 + 24/t + 5as/(ht)) for none, sbh (10 + 24/t) for selective core_attn, less 8sbh/t for mlp_act and 4sbh
for layernorm, 2sbh for full; x2 in fp32).

Then the step time (forward + backward of the whole model, no optimizer) of each policy over none, median
of per-round ratios with the six models interleaved in the same processes. ``--compile``: every model's blocks
compiled (``models.compile``, inductor), where selective recomputation is torch's checkpoint inside the compiled
block (``models.recompute.compiled_recompute``) and full recomputation DeepSpeed's around it; the census then
counts what the compiled graphs save, after a first step that compiles them.

    python bench/recompute.py [--tp 1,2] [--seq 256] [--batch 2] [--hidden 256] [--heads 8] [--layers 2]
                              [--vocab 2048] [--rounds 10] [--dtype bf16|fp32] [--compile]
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import deepspeed  # noqa: E402
import torch  # noqa: E402
from activation_memory import SavedTensorCensus, _batch, _param_storages, _step_seconds, parse_shape_args  # noqa: E402
from dist import run_distributed  # noqa: E402
from common import format_table  # noqa: E402

from models import GPT, GPTConfig  # noqa: E402
from models.compile import compile_transformer_layers  # noqa: E402
from models.gpt import select_recompute_modules  # noqa: E402
from models.parallel import initialize_model_parallel, model_parallel_seed  # noqa: E402
from pipeline.planning.memory import layer_activations  # noqa: E402
from pipeline.families.gpt.shape import gpt_shape  # noqa: E402


_CENSUSES: list[SavedTensorCensus] = []
# (label, --recompute, --recompute-modules): each selective module alone, then all of them
VARIANTS = (("none", "none", ()), ("selective", "selective", ("core_attn",)),
            ("selective mlp_act", "selective", ("mlp_act",)), ("selective mlp", "selective", ("mlp",)),
            ("selective layernorm", "selective", ("layernorm",)),
            ("selective all three", "selective", ("core_attn", "mlp_act", "layernorm")), ("full", "full", ()))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _checkpoint(fn, *args):
    """DeepSpeed's checkpoint keeps its inputs on its ctx, outside autograd's saved-tensor hooks: counted here."""
    for census in _CENSUSES:
        for t in args:
            if torch.is_tensor(t):
                census._pack(t)
    return deepspeed.checkpointing.checkpoint(fn, *args)


def _build(config: GPTConfig, policy: str, modules, dtype, compile: bool):
    model = GPT(config, init_seed=0).to(dtype).train()
    if policy == "full":
        model.checkpoint_fn = _checkpoint
    elif policy == "selective":
        select_recompute_modules(model, _checkpoint, modules)
    if compile:
        compile_transformer_layers(model, fullgraph=True)
    return model


def _layer_bytes(model, b: int, s: int, h: int) -> int:
    x = torch.randn(b, s, h, dtype=next(model.parameters()).dtype, requires_grad=True)
    layer = model.layers[0]
    with SavedTensorCensus(_param_storages(model)) as census:
        _CENSUSES[:] = [census]
        # full recomputation checkpoints the layer from the model's loop: the same call here
        y = model.checkpoint_fn(layer, x) if model.checkpoint_fn is not None else layer(x)
        _CENSUSES.clear()
    y.float().sum().backward()  # the backward's collectives pair with the other ranks'
    return census.bytes


def _rank(rank, tp, config_kw, b, s, rounds, dtype, compile):
    state = initialize_model_parallel(tensor_parallel=tp)
    model_parallel_seed(1234)
    deepspeed.checkpointing.configure(state)
    config = GPTConfig(**config_kw)
    models = {label: _build(config, policy, modules, DTYPES[dtype], compile) for label, policy, modules in VARIANTS}
    if compile:  # the first call compiles the block (a census of tracing is not one of the compiled graph)
        for m in models.values():
            _layer_bytes(m, b, s, config.hidden_size)
    out = {label: _layer_bytes(m, b, s, config.hidden_size) for label, m in models.items()}
    ids, labels = _batch(b, s, config.vocab_size)
    times = _step_seconds(models, ids, labels, rounds)
    out["ratio"] = {k: statistics.median(a / n for a, n in zip(times[k], times["none"])) for k in models}
    out["seconds"] = {k: statistics.median(t) for k, t in times.items()}
    return out


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)  # this benchmark's own option, beside parse_shape_args' ones
    pre.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    pre.add_argument("--compile", action="store_true", help="compile every model's blocks (models/compile.py)")
    known, argv = pre.parse_known_args(argv)
    dtype = known.dtype
    args, config_kw = parse_shape_args(__doc__, "1,2", argv)
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    # the paper's accounting: with attention dropout a CPU runs SDPA's math path, which materialises the scores
    shape = replace(gpt_shape(GPTConfig(**config_kw), seq=s), fused_attention=False)
    scale = DTYPES[dtype].itemsize / 2  # the planner's terms are for 2-byte activations
    print(f"# one layer's activation bytes saved for the backward (rank 0), gpt2 {dtype}, s={s} b={b} h={h} a={a} "
          f"L={args.layers} V={args.vocab}, dropout 0.1{', blocks compiled' if known.compile else ''}; "
          f"{common.machine_note()}")
    rows, mib = [], 1 / 2**20
    for tp in map(int, args.tp.split(",")):
        r = run_distributed(_rank, tp, tp, config_kw, b, s, args.rounds, dtype, known.compile)[0]
        for label, policy, modules in VARIANTS:
            rows.append([f"TP{tp}", label, r[label] * mib,
                         scale * layer_activations(shape, b, tp, False, policy, modules) * mib,
                         r["seconds"][label], r["ratio"][label]])
    print(format_table(["layout", "recompute", "one layer MiB", "planner (paper) MiB", "step s", "step / none"],
                       rows))


if __name__ == "__main__":
    main()
