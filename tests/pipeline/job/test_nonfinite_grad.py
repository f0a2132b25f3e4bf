"""A finite loss with an Inf gradient stops the run, naming the step and the gradient, at ZeRO 0-3 and with
pipeline stages (2 gloo ranks, real DeepSpeed engines): the gradient of one parameter is made Inf on rank 1
only, at step 2, by a hook of the test; rank 0's line names it (the other rank's, or the other stage's)."""
import torch
from dist import run_distributed
from engine_utils import BASE_DS, TINY, GlobalBatchLoader, real_text_tokens

from models import GPTConfig
from models.parallel import initialize_model_parallel, model_parallel_seed
from pipeline.engine.build import build_engine
from pipeline.engine.ds_config import resolve_ds_config
from pipeline.engine.steps import lm_batches, train_step
from pipeline.job import faults
from pipeline.job.loop import train_loop

TARGET = "layers.2.mlp.fc_in.weight"  # on the second stage under PP 2 (4 layers)
LAYOUTS = [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2)]  # (ZeRO stage, pipeline stages)


def _poison(engine, rank: int, at_step: int):
    """Rank 1's gradient of TARGET is Inf from the ``at_step``-th backward of the watched parameter on."""
    rename = getattr(engine, "param_display_name", lambda n: n)
    calls, gas = [0], engine.gradient_accumulation_steps()
    for name, param in engine.module.named_parameters():
        if rename(name) == TARGET:
            def hook(grad):
                calls[0] += 1
                return torch.full_like(grad, float("inf")) if rank == 1 and calls[0] >= at_step * gas else grad
            param.register_hook(hook)


def _run(rank, zero, pp):
    state = initialize_model_parallel(1, pp)
    model_parallel_seed(1234)
    ds = resolve_ds_config({**BASE_DS, "zero_optimization": {"stage": zero}}, data_parallel=state.data_parallel,
                           pipeline_parallel=pp, micro_batch_size=2)
    engine = build_engine(GPTConfig(**TINY), ds, state, init_seed=1234)
    has_target = any(getattr(engine, "param_display_name", lambda n: n)(n) == TARGET
                     for n, _ in engine.module.named_parameters())
    _poison(engine, rank, at_step=2)
    batches = lm_batches(GlobalBatchLoader(real_text_tokens(8 * 4), 8, 2, state.get_data_parallel_rank(),
                                           state.data_parallel))
    faults.configure(None, exit_signal_handler=False, max_bad_steps=1, fp16=False)
    try:
        train_loop(lambda: train_step(engine, batches), first=1, last=4, desc="t", hooks=[])
    except faults.NonFiniteLossError as e:
        return {"message": str(e), "has_target": has_target}
    return {"message": None, "has_target": has_target}


def _all_layouts(rank):
    torch.set_num_threads(1)
    return [_run(rank, zero, pp) for zero, pp in LAYOUTS]


def test_inf_gradient_with_a_finite_loss_is_named():
    results = run_distributed(_all_layouts, 2)
    for (zero, pp), rank0, rank1 in zip(LAYOUTS, *results):
        message = rank0["message"]
        assert message is not None, f"ZeRO {zero} PP {pp}: the Inf gradient went unnoticed"
        assert message.startswith("step 2: the loss is finite ("), message
        assert f"but a gradient is not, the first non-finite gradient: {TARGET} (inf)" in message, message
        assert rank1["message"] == message  # every rank stops with the same line
        if pp > 1:
            assert not rank0["has_target"] and rank1["has_target"]  # named from the other stage
