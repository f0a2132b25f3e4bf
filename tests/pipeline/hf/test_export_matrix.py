"""Every saved run exports: each precision x ZeRO stage x (TP, PP) layout that training supports.

One spawn per layout trains a tiny GPT for one step under each supported DeepSpeed config and saves
it with the project's checkpoint code; each run directory then goes through
``python -m pipeline.export_hf --verify`` (the export loads with transformers and its logits match
the project model's). fp32 ZeRO-1/2 runs are the ones whose weights are views into DeepSpeed's flat
buffers, which safetensors refuses unless the reader gives each tensor its own storage.
"""
import itertools
from pathlib import Path

import pytest
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from dist import run_distributed
from engine_utils import BASE_DS, TINY, GlobalBatchLoader, real_text_tokens

from models import GPTConfig
from models.parallel import Layout, initialize_model_parallel, model_parallel_seed
from pipeline.checkpoints import checkpoint
from pipeline.engine.ds_config import precision, resolve_ds_config
from pipeline.job.layout import LayoutCheck, refusal
from pipeline.engine.build import build_engine
from pipeline.engine.steps import lm_batches, train_step
from pipeline.export_hf import main as export_main

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True,
                                                                                 "initial_scale_power": 8}}}


def supported(tp, pp):
    """(name, DeepSpeed config overrides) of every precision x ZeRO stage training accepts at this layout."""
    out = []
    for (prec, extra), stage in itertools.product(PRECISIONS.items(), range(4)):
        ds = {**BASE_DS, **extra, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
        if refusal(LayoutCheck(Layout(pipeline=pp, zero_stage=stage, precision=prec), ds=ds)):
            continue
        out.append((f"{prec}_z{stage}", ds))
    return out


def _train_and_save(rank, tp, pp, configs, root):


    get_accelerator().is_fp16_supported = lambda: True
    state = initialize_model_parallel(tensor_parallel=tp, pipeline_parallel=pp)
    config = GPTConfig(**TINY)
    for name, ds in configs:
        model_parallel_seed(1234)
        ds = resolve_ds_config(ds, data_parallel=state.data_parallel, pipeline_parallel=pp, micro_batch_size=2)
        engine = build_engine(config, ds, state, init_seed=1234)
        loader = GlobalBatchLoader(real_text_tokens(ds["train_batch_size"]), ds["train_batch_size"], 2,
                                   state.get_data_parallel_rank(), state.data_parallel)
        train_step(engine, lm_batches(loader))
        save = Path(root) / name
        if rank == 0:
            checkpoint.save_run_files(save, config, None)
        dist.barrier()
        checkpoint.save(engine, save, 1, data_state=None,
                        layout={"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": state.data_parallel,
                                "model_type": "gpt", "precision": precision(ds)})
        engine.destroy()
    return 0


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}_pp{p}" for t, p in LAYOUTS])
def test_every_supported_run_exports(tmp_path, tp, pp, capsys):
    configs = supported(tp, pp)
    assert len(configs) == (11 if pp == 1 else 6)  # the matrix is what training accepts, not a hand-picked few
    run_distributed(_train_and_save, tp * pp, tp, pp, configs, str(tmp_path))
    failed = {}
    for name, _ in configs:
        try:
            code = export_main(["--checkpoint", str(tmp_path / name), "--out", str(tmp_path / f"hf_{name}"),
                                "--verify"])
        except SystemExit as e:
            code = e.code
        if code != 0:
            failed[name] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert not failed, f"TP={tp} PP={pp}: runs that do not export: {failed}"
