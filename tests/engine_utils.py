"""Shared pieces of the DeepSpeed engine tests: a tiny GPT, real-text batches, a training worker."""
from __future__ import annotations

import inspect
import json

import torch

from models import GPTConfig
from models.parallel import Layout, initialize_model_parallel, model_parallel_seed
from pipeline.engine.build import build_engine
from pipeline.engine.steps import lm_batches, loss_scale, train_step
from pipeline.engine.ds_config import resolve_ds_config
from pipeline.engine.schedules import LRSchedule

SEQ = 16
LAYOUT_NAMES = {"sequence_parallel": "sequence_parallel", "tiled_mlp": "tiled_mlp", "tiled_loss": "tiled_loss",
                "moe_expert_parallel": "expert"}
TINY = dict(variant="gpt2", vocab_size=256, hidden_size=32, num_layers=4, num_heads=4, max_position_embeddings=SEQ,
            hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
BASE_DS = {
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                              "torch_adam": True}},
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
}


def real_text_tokens(n_rows: int, seq: int = SEQ) -> torch.Tensor:
    """Byte tokens of real text (the json package's source), cut into rows of seq + 1."""
    data = torch.tensor(list(inspect.getsource(json).encode("utf-8")), dtype=torch.long)
    need = n_rows * (seq + 1)
    data = data.repeat(need // len(data) + 1)[:need]
    return data.view(n_rows, seq + 1)


class GlobalBatchLoader:
    """Step k uses rows [k*G, (k+1)*G) of a fixed table; DP rank r takes its contiguous slice of them."""

    def __init__(self, table, global_batch, micro, dp_rank, dp_size):
        self.table, self.g, self.micro, self.rank, self.dp = table, global_batch, micro, dp_rank, dp_size
        self.i = 0  # micro-batches consumed

    def __iter__(self):
        return self

    def __next__(self):
        per_rank = self.g // self.dp
        per_step = per_rank // self.micro
        step, m = divmod(self.i, per_step)
        start = step * self.g + self.rank * per_rank + m * self.micro
        self.i += 1
        return {"tokens": self.table[start:start + self.micro]}


def train_worker(rank, tp=1, pp=1, ds_overrides=None, model_overrides=None, steps=5, micro=None,
                 recompute="none", fp16_on_cpu=False, after_step=None, recompute_modules=("core_attn",)):
    if fp16_on_cpu:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    model_overrides = dict(model_overrides or {})
    # the layout's fields among the overrides (a test's shorthand): into the run's Layout, not the model config
    layout = {LAYOUT_NAMES[k]: model_overrides.pop(k) for k in list(model_overrides) if k in LAYOUT_NAMES}
    state = initialize_model_parallel(layout=Layout(tensor=tp, pipeline=pp, **layout))
    model_parallel_seed(1234)
    ds = {**BASE_DS, **(ds_overrides or {})}
    ds = resolve_ds_config(ds, data_parallel=state.data_parallel, pipeline_parallel=pp,
                           micro_batch_size=micro or ds["train_batch_size"] // state.data_parallel)
    config = GPTConfig(**{**TINY, **model_overrides})
    engine = build_engine(config, ds, state, init_seed=1234, schedule=LRSchedule(3e-3, 2, steps, "cosine"),
                          recompute=recompute, recompute_modules=recompute_modules)
    table = real_text_tokens(ds["train_batch_size"] * steps)
    loader = GlobalBatchLoader(table, ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
                               state.get_data_parallel_rank(), state.data_parallel)
    batches = lm_batches(loader)
    out = {"loss": [], "scale": [], "lr": [], "skipped": [], "gnorm": []}
    for step in range(steps):
        out["loss"].append(train_step(engine, batches))
        out["scale"].append(loss_scale(engine))
        out["lr"].append(engine.get_lr()[0])
        out["skipped"].append(int(engine.skipped_steps))
        out["gnorm"].append(float(engine.get_global_grad_norm() or 0.0))
        if after_step:
            after_step()
    return out

