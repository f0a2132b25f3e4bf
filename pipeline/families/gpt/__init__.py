"""The GPT family (gpt2 and llama variants, dense or MoE; ``models.GPT``): its entry, its model-side parts
(``parts``) and its Hugging Face exporter and verifier (``hf``)."""
from __future__ import annotations

from models import GPT, GPTConfig
from models.parallel import Layout
from pipeline.engine.pipe_model import TIED_KEY, gpt_to_pipe_name, pipe_to_gpt_name
from pipeline.families.gpt.hf import export_gpt, gpt_logits
from pipeline.families.gpt.parts import GPTDecoder, GPTEncoder, GPTScorer
from pipeline.families.gpt.shape import gpt_shape
from pipeline.families.spec import ModelFamily, PipelineNames


def build_gpt(config: GPTConfig, init_seed: int | None, layout: Layout | None = None) -> GPT:
    return GPT(config, init_seed=init_seed, layout=layout)


FAMILY = ModelFamily(
    name="gpt", config_class=GPTConfig, default_preset="gpt2-tiny", default_tokenizer="train-bpe",
    layouts="tensor, pipeline and data parallelism", build_module=build_gpt, stream_data=False,
    pipeline_parallel_capable=True, tensor_parallel_capable=True,
    hf_exporter=export_gpt, hf_verifier=gpt_logits, scorer=GPTScorer, encoder=GPTEncoder, decoder=GPTDecoder,
    shape=gpt_shape, hf_sequence_classification=True,
    pipeline_names=PipelineNames(gpt_to_pipe_name, pipe_to_gpt_name, (f"^tied_modules\\.{TIED_KEY}\\.",)))
