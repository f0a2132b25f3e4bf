"""The mLSTM through a real DeepSpeed engine on gloo CPU ranks: DP=2 equals one process, fp16 trains.

The engine's forward returns only the loss; the model carries each rank's TBPTT state
itself (``carry_state``), so every data-parallel rank follows its own streams.
"""
import deepspeed
import pytest
import torch
import torch.distributed as dist
from conftest import shared_data
from dist import run_distributed

from models import MLSTM, MLSTMConfig

GLOBAL_BATCH, BPTT, STEPS, LR = 8, 16, 8, 3e-2


def _streams(path):
    data = open(path, "rb").read()[:GLOBAL_BATCH * BPTT * STEPS + GLOBAL_BATCH]
    ids = torch.tensor(list(data))
    n = (ids.numel() - 1) // GLOBAL_BATCH
    return torch.stack([ids[j * n:(j + 1) * n + 1] for j in range(GLOBAL_BATCH)])


def _tiny_model():
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(vocab_size=257, embed_dim=8, hidden_size=32))
    model.carry_state = True
    return model


def _train(rank, path, precision, zero_stage):

    if precision == "fp16":
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True   # CPU: let DeepSpeed run its fp16 path
    world = dist.get_world_size()
    micro = GLOBAL_BATCH // world
    model = _tiny_model()
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": zero_stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    mine = _streams(path)[rank * micro:(rank + 1) * micro]       # this rank's own streams
    losses = []
    for k in range(STEPS):
        x, y = mine[:, k * BPTT:(k + 1) * BPTT], mine[:, k * BPTT + 1:(k + 1) * BPTT + 1]
        loss = engine(x, labels=y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "param_dtype": str(next(model.parameters()).dtype), "fp16": bool(engine.fp16_enabled())}


def _both(rank, path):
    # One spawn for both runs: starting ranks and importing DeepSpeed is most of the cost.
    return {"fp32_zero1": _train(rank, path, "fp32", 1), "fp16_zero2": _train(rank, path, "fp16", 2)}


@pytest.fixture(scope="module")
def dp2_runs():
    path = str(shared_data("corpora", "shakespeare.txt"))
    return path, run_distributed(_both, 2, path)


def _single_process(path):
    """DP=1 reference: the plain PyTorch loop over the whole global batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny matrices: threads only add synchronisation
    model = _tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    streams, losses = _streams(path), []
    for k in range(STEPS):
        x, y = streams[:, k * BPTT:(k + 1) * BPTT], streams[:, k * BPTT + 1:(k + 1) * BPTT + 1]
        loss = model(x, labels=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.set_num_threads(threads)
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_dp2_zero1_equals_one_process_with_the_same_global_batch(dp2_runs):
    path, runs = dp2_runs
    two = [r["fp32_zero1"] for r in runs]
    one = _single_process(path)
    assert one["losses"][-1] < one["losses"][0] - 0.5
    for r in range(2):
        assert two[r]["losses"] == pytest.approx(one["losses"], rel=1e-5)
        for name, w in one["weights"].items():
            torch.testing.assert_close(two[r]["weights"][name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_fp16_zero2_with_dynamic_loss_scaling_trains(dp2_runs):
    run = dp2_runs[1][0]["fp16_zero2"]
    assert run["fp16"] and run["param_dtype"] == "torch.float16"
    losses = run["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
