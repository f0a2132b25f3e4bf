"""Classification head: pooling shapes and positions, padding ignored, pooled-input path, losses, and a
head trained a few steps on fixed features lowers its BCE."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from finetune.heads import (POOLINGS, ClassificationHead, HeadConfig, last_token_index, multilabel_bce_loss,
                            pos_weight_from_counts, pos_weight_from_labels, single_label_ce_loss)
from finetune.model import label_correlation_loss

B, S, H, K = 3, 6, 8, 4


@pytest.fixture(autouse=True)
def one_thread():
    # tiny tensors: extra intra-op threads only contend on a shared CPU
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

LENGTHS = [6, 2, 4]


def _mask(lengths, s=S, left=False):
    m = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            m[i, s - n:] = 1
        else:
            m[i, :n] = 1
    return m


@pytest.mark.parametrize("pooling", [p for p in POOLINGS if p not in ("none", "labels")])
def test_shapes_and_padding_ignored(pooling):
    torch.manual_seed(0)
    head = ClassificationHead(HeadConfig(H, K, pooling=pooling, mlp_hidden=(16, 12), dropout=0.1,
                                         attention_hidden=5 if pooling == "attention" else None)).eval()
    h = torch.randn(B, S, H)
    logits = head(h, lengths=LENGTHS)
    assert logits.shape == (B, K) and logits.dtype == torch.float32
    assert torch.equal(logits, head(h, attention_mask=_mask(LENGTHS)))
    garbage = h.clone()
    garbage[~_mask(LENGTHS).bool()] = 1e4  # whatever sits in the padding must not change the result
    assert torch.allclose(head(garbage, lengths=LENGTHS), logits)
    # each row alone, unpadded, gives the same logits as in the padded batch
    for i, n in enumerate(LENGTHS):
        assert torch.allclose(head(h[i:i + 1, :n]), logits[i:i + 1], atol=1e-6)


def test_last_token_pooling_picks_last_real_token():
    head = ClassificationHead(HeadConfig(H, K, pooling="last"))
    h = torch.arange(S, dtype=torch.float32).view(1, S, 1).expand(B, S, H).clone()  # value = position
    assert head.pool(h, lengths=LENGTHS)[:, 0].tolist() == [5.0, 1.0, 3.0]  # right padding
    assert head.pool(h, attention_mask=_mask(LENGTHS))[:, 0].tolist() == [5.0, 1.0, 3.0]
    assert head.pool(h, attention_mask=_mask(LENGTHS, left=True))[:, 0].tolist() == [5.0, 5.0, 5.0]  # left padding
    assert head.pool(h)[:, 0].tolist() == [5.0, 5.0, 5.0]  # no mask: every token is real
    assert last_token_index(_mask([1, 3, 6]).bool()).tolist() == [0, 2, 5]


def test_mean_max_attention_values():
    h = torch.tensor([[[1.0, -2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert ClassificationHead(HeadConfig(2, 1, pooling="mean")).pool(h, mask).tolist() == [[2.0, 1.0]]
    assert ClassificationHead(HeadConfig(2, 1, pooling="max")).pool(h, mask).tolist() == [[3.0, 4.0]]
    att = ClassificationHead(HeadConfig(2, 1, pooling="attention"))
    same = torch.tensor([[[1.5, -1.0], [1.5, -1.0], [9.0, 9.0]]])  # equal real tokens: any softmax gives them back
    assert torch.allclose(att.pool(same, mask), torch.tensor([[1.5, -1.0]]))


def test_pooled_input_path_and_errors():
    head = ClassificationHead(HeadConfig(H, K, pooling="none"))
    assert head(torch.randn(5, H)).shape == (5, K)  # e.g. the mLSTM's final cell state [b, h]
    with pytest.raises(ValueError, match="pooling='none' takes pooled inputs"):
        head(torch.randn(5, S, H))
    with pytest.raises(ValueError, match="need pooling='none'"):
        ClassificationHead(HeadConfig(H, K, pooling="mean"))(torch.randn(5, H))
    with pytest.raises(ValueError, match="a row has no real token"):
        ClassificationHead(HeadConfig(H, K))(torch.randn(2, S, H), lengths=[3, 0])
    with pytest.raises(ValueError, match="pooling must be one of"):
        HeadConfig(H, K, pooling="cls")
    with pytest.raises(ValueError, match="single-label head needs num_labels >= 2"):
        HeadConfig(H, 1, problem_type="single_label")
    config = HeadConfig(H, 2, pooling="attention", mlp_hidden=(4,), label_names=("neg", "pos"))
    assert HeadConfig.from_dict(config.to_dict()) == config


def test_bf16_hidden_states():
    head = ClassificationHead(HeadConfig(H, K, pooling="mean")).to(torch.bfloat16)
    logits = head(torch.randn(B, S, H, dtype=torch.bfloat16), lengths=LENGTHS)
    assert logits.dtype == torch.bfloat16
    assert head.loss(logits, torch.ones(B, K)).dtype == torch.float32  # the loss is computed in fp32


def test_losses_and_pos_weight():
    assert pos_weight_from_counts([10, 0, 50], 100).tolist() == [9.0, 1.0, 1.0]
    assert pos_weight_from_counts([10, 0, 50], 100, max_weight=4).tolist() == [4.0, 1.0, 1.0]
    labels = np.array([[1, 0], [0, 0], [0, 1], [0, 1]])
    assert pos_weight_from_labels(labels).tolist() == [3.0, 1.0]
    logits, targets = torch.randn(4, 2), torch.tensor(labels, dtype=torch.float32)
    w = torch.tensor([3.0, 1.0])
    manual = -(w * targets * F.logsigmoid(logits) + (1 - targets) * F.logsigmoid(-logits)).mean()
    assert torch.allclose(multilabel_bce_loss(logits, targets, pos_weight=w), manual)
    ce_logits = torch.randn(4, 3)
    assert torch.allclose(single_label_ce_loss(ce_logits, torch.tensor([0, 2, 1, 0])),
                          F.cross_entropy(ce_logits, torch.tensor([0, 2, 1, 0])))
    head = ClassificationHead(HeadConfig(H, 3))
    head.set_output_bias_from_priors([0.5, 0.1, 0.02])
    assert torch.allclose(torch.sigmoid(head.output.bias), torch.tensor([0.5, 0.1, 0.02]))


@pytest.mark.parametrize("pooling", ["last", "attention"])
def test_training_on_fixed_features_lowers_bce(pooling):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, S, H, generator=g)
    lengths = torch.randint(1, S + 1, (64,), generator=g)
    pooled = h[torch.arange(64), lengths - 1] if pooling == "last" else h.mean(1)
    targets = (pooled @ torch.randn(H, K, generator=g) > 0).float()  # learnable from the features
    head = ClassificationHead(HeadConfig(H, K, pooling=pooling, mlp_hidden=(16,), dropout=0.0))
    pos_weight = pos_weight_from_labels(targets.numpy())
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = head.loss(head(h, lengths=lengths), targets, pos_weight=pos_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_label_pooling_reads_each_label_at_its_own_name():
    # a prompt of 3 tokens ends each text; the 4 labels end at prompt tokens 0, 1, 1 and 2
    config = HeadConfig(H, K, pooling="labels", label_prompt=(50, 51, 52), label_positions=(0, 1, 1, 2),
                        dropout=0.0)
    head = ClassificationHead(config)
    h = torch.arange(S, dtype=torch.float32).view(1, S, 1).expand(B, S, H).clone()  # value = position
    lengths = [6, 3, 5]
    pooled = head.pool(h, lengths=lengths)
    assert pooled.shape == (B, K, H)
    starts = [n - 3 for n in lengths]  # where each row's prompt begins
    assert pooled[:, :, 0].tolist() == [[s + 0, s + 1, s + 1, s + 2] for s in starts]
    x = torch.randn(B, S, H)
    logits = head(x, lengths=lengths)
    vectors = head.pool(x, lengths=lengths)
    by_hand = torch.stack([vectors[:, k] @ head.output.weight[k] + head.output.bias[k] for k in range(K)], dim=1)
    assert torch.allclose(logits, by_hand, atol=1e-6)
    with pytest.raises(ValueError, match="shorter than the label prompt"):
        head.pool(h, lengths=[6, 2, 5])
    for bad in (dict(label_positions=(0, 1, 2)), dict(label_positions=(0, 1, 2, 3)), dict(mlp_hidden=(8,))):
        with pytest.raises(ValueError):
            HeadConfig(H, K, pooling="labels", **{"label_prompt": (50, 51, 52), "label_positions": (0, 1, 1, 2),
                                                  **bad})
    with pytest.raises(ValueError, match="for pooling='labels'"):
        HeadConfig(H, K, pooling="last", label_prompt=(1,), label_positions=(0,) * K)
    assert HeadConfig.from_dict(config.to_dict()) == config


def test_label_correlation_loss_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 1.0, -2.0], [1.0, 1.0, 1.0]])
    labels = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1]])  # the third has no absent label: it adds nothing
    p = torch.sigmoid(logits)
    first = (torch.exp(p[0, 1] - p[0, 0]) + torch.exp(p[0, 1] - p[0, 2])) / 2
    second = (torch.exp(p[1, 0] - p[1, 1]) + torch.exp(p[1, 2] - p[1, 1])) / 2
    assert torch.allclose(label_correlation_loss(logits, labels), (first + second) / 2)
    # ranking every present label above every absent one lowers it
    assert label_correlation_loss(torch.tensor([[5.0, -5.0]]), torch.tensor([[1, 0]])) < \
        label_correlation_loss(torch.tensor([[-5.0, 5.0]]), torch.tensor([[1, 0]]))
