"""ALST's tiled MLP and tiled output layer + loss (DeepSpeed's TiledMLP and sequence_tiled_compute) equal the untiled
GPT in fp32: loss and every gradient within 1e-6 relative, both variants, even and uneven tiles, label smoothing,
ignored labels and each row's sum (DPO's, ``reduction="row_sum"``); under TP, sequence parallelism and context parallelism in tests/models/test_context_parallel.py."""
import pytest
import torch
from test_tensor_parallel import CONFIGS, _batch, _max_rel

from models import GPT, GPTConfig
from models.config import ConfigError
from models.parallel import Layout


ROW_WEIGHTS = torch.tensor([1.0, -2.0, 0.5])  # each row's sum weighted apart: the rows' gradients are told apart


def _loss_and_grads(config: dict, layout: Layout = Layout(), **kwargs):
    model = GPT(GPTConfig(**config), init_seed=7, layout=layout)
    ids, labels = _batch()
    loss = model(ids, labels, **kwargs)
    (loss if loss.dim() == 0 else loss @ ROW_WEIGHTS).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("tiles", [(4, 3), (5, 5)])  # 12 positions: even tiles, and tiles of 3, 3, 3, 3, 0
def test_tiled_equals_untiled(variant, tiles):
    mlp, loss_tiles = tiles
    for kwargs in ({}, {"label_smoothing": 0.1, "reduction": "sum"}, {"reduction": "row_sum"}):
        ref_loss, ref_grads = _loss_and_grads(CONFIGS[variant], **kwargs)
        loss, grads = _loss_and_grads(CONFIGS[variant], Layout(tiled_mlp=mlp, tiled_loss=loss_tiles), **kwargs)
        diffs = {"loss": _max_rel(loss, ref_loss), **{n: _max_rel(grads[n], ref_grads[n]) for n in ref_grads}}
        worst = max(diffs, key=diffs.get)
        print(f"{variant} tiled MLP {mlp} / loss {loss_tiles} {kwargs}: max relative difference {diffs[worst]:.2e} "
              f"({worst})")
        assert diffs[worst] < 1e-6, (worst, diffs[worst])


def test_tiling_settings():
    with pytest.raises(ConfigError, match="tiled_mlp is how a run lays the model out.*pass --tiled-mlp"):
        GPTConfig.from_dict({**CONFIGS["gpt2"], "tiled_mlp": 2})  # a layout setting, not the model's
    model = GPT(GPTConfig(**CONFIGS["llama"]), init_seed=0, layout=Layout(tiled_mlp=2, tiled_loss=4))
    ids, labels = _batch()
    with pytest.raises(ValueError, match="the tiled loss reduces to a mean, a sum or each row's sum"):
        model(ids, labels, reduction="none")
