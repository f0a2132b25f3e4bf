"""The multiplicative LSTM family (``models.MLSTM``, character level, truncated BPTT over streams): its entry, its
model-side parts (``parts``) and its Hugging Face exporter and verifier (``hf``)."""
from __future__ import annotations

import torch

from models import MLSTM, MLSTMConfig
from models.parallel import Layout
from pipeline.families.mlstm.hf import export_mlstm, mlstm_logits
from pipeline.families.mlstm.parts import MLSTMDecoder, MLSTMEncoder, MLSTMScorer
from pipeline.families.mlstm.shape import mlstm_shape
from pipeline.families.spec import ModelFamily


def build_mlstm(config: MLSTMConfig, init_seed: int | None, layout: Layout | None = None) -> MLSTM:
    """The same initial weights on every data-parallel rank, without touching the global RNG streams."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed or 0)
        return MLSTM(config)


FAMILY = ModelFamily(
    name="mlstm", config_class=MLSTMConfig, default_preset="mlstm-tiny", default_tokenizer="bytes",
    layouts="data parallelism (and ZeRO)", build_module=build_mlstm, stream_data=True,
    pipeline_parallel_capable=False, tensor_parallel_capable=False,
    hf_exporter=export_mlstm, hf_verifier=mlstm_logits, scorer=MLSTMScorer, encoder=MLSTMEncoder,
    decoder=MLSTMDecoder, shape=mlstm_shape)
