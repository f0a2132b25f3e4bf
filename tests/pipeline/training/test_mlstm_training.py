"""A tiny mLSTM learns real text with truncated BPTT, in fp32, with bf16 weights and under bf16 autocast."""
import contextlib
import math
from collections import Counter

import pytest
import torch

from conftest import shared_data
from models import MLSTM, MLSTMConfig

STREAMS, BPTT, STEPS = 16, 32, 50


def text_streams(n_bytes=STREAMS * BPTT * STEPS + STREAMS):
    data = shared_data("corpora", "shakespeare.txt").read_bytes()[:n_bytes]
    ids = torch.tensor(list(data))
    n = (ids.numel() - 1) // STREAMS
    return data, torch.stack([ids[j * n:(j + 1) * n + 1] for j in range(STREAMS)])


def unigram_entropy_nats(data: bytes) -> float:
    counts = Counter(data)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def train(streams, mode: str, steps=STEPS, lr=1e-2):
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(vocab_size=257, embed_dim=16, hidden_size=64))
    if mode == "bf16":
        model = model.bfloat16()
    model.carry_state = True                        # TBPTT: consecutive chunks of the same streams
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
    losses = []
    for k in range(steps):
        x, y = streams[:, k * BPTT:(k + 1) * BPTT], streams[:, k * BPTT + 1:(k + 1) * BPTT + 1]
        with amp():
            loss = model(x, labels=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: threads only add OpenMP synchronisation (and fight on a shared CI machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def fp32_run(one_thread):
    data, streams = text_streams()
    return data, streams, train(streams, "fp32")


def test_loss_falls_below_the_unigram_entropy_of_the_text(fp32_run):
    data, _, losses = fp32_run
    assert losses[0] == pytest.approx(math.log(257), abs=0.1)
    final = sum(losses[-5:]) / 5
    # Below the entropy of the text's byte frequencies: the model uses context, not just counts.
    assert final < unigram_entropy_nats(data) - 0.1, (losses[0], final, unigram_entropy_nats(data))


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_bf16_trains_like_fp32(fp32_run, mode):
    data, streams, ref = fp32_run
    losses = train(streams, mode)
    assert sum(losses[-5:]) / 5 < unigram_entropy_nats(data) - 0.1
    assert max(abs(a - b) for a, b in zip(losses, ref)) < 0.1, "bf16 run drifted away from fp32"
