"""The Hugging Face architectures the project converts to and from, one module each: its transformers classes, its
config's reader (refusing what the project's model cannot compute) and writer, and what of a project config it
cannot hold (``base.HFFamily``). Adding an architecture is one module here and one line below; the streaming
safetensors I/O and the conversion itself (``pipeline.hf.convert``) are shared.
"""
from pipeline.hf.architectures import (decoder, deepseek_v3, gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
                                       qwen3_moe)
from pipeline.hf.architectures.base import HFFamily, WeightLayout

# in the order an export tries them: a project config exports as the first family of its variant that holds it
HF_FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (
    gpt2.FAMILY,
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    deepseek_v3.FAMILY,
)}

# each GPT variant's tensor names, which all its families share
VARIANT_WEIGHTS: dict[str, WeightLayout] = {"gpt2": gpt2.WEIGHTS, "llama": decoder.WEIGHTS}
