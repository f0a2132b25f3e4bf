"""The decoder of a model (``pipeline.families.<family>.parts``): the one its family spec
(``pipeline.job.families``) holds."""
from __future__ import annotations

from pipeline.families.gpt.parts import GPTDecoder
from pipeline.families.mlstm.parts import MLSTMDecoder
from pipeline.job.families import family_of

__all__ = ["GPTDecoder", "MLSTMDecoder", "decoder_for"]


def decoder_for(model, use_cache: bool = True):
    """The decoder the model's family registers."""
    return family_of(model.config).get("decoder")(model, use_cache=use_cache)
