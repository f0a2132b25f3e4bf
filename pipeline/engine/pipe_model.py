"""The GPT as a DeepSpeed ``PipelineModule``: a list of layer specs (GPT-NeoX's GPT2ModelPipe idea).

The stages are the very modules of ``models.gpt`` (Embedding, TransformerLayer x L,
FinalNorm, LMHead), so a pipeline layer holds the parameters of the matching
GPT submodule under the same names. For a tied model the Embedding appears
twice through ``TiedLayerSpec``: DeepSpeed keeps one copy per owning stage and
all-reduces its gradient between the first and last stage.
"""
from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from models import GPTConfig
from models.gpt import Embedding, FinalNorm, LMHead, TransformerLayer, context_parallel_cross_entropy, stage_seed
from models.moe import MoEMLP, is_moe_layer
from models.parallel import Layout, ParallelState, scale_gradient, vocab_parallel_cross_entropy

TIED_KEY = "embed"


def _tied_logits(embedding: Embedding, hidden):
    return embedding.logits(hidden)


def _tied_logits_aux(embedding: Embedding, carried):
    hidden, aux = carried
    return embedding.logits(hidden), aux


class VocabParallelLoss:
    """``loss_fn`` of the last stage: mean cross-entropy over vocab-parallel logits (plus, for a mixture of
    experts, the auxiliary losses the activations carried: ``MoETransformerLayer``; under context parallelism
    over the whole sequence, from this rank's chunk of the logits, its gradient times C: see ``pipe_topology``)."""

    def __init__(self, vocab_size: int, context_parallel: int = 1, chunk_tokens: int | None = None):
        self.vocab_size = vocab_size
        self.context_parallel = context_parallel
        self.chunk_tokens = chunk_tokens

    def __call__(self, logits, labels):
        if isinstance(logits, tuple):
            logits, aux = logits
            return self._cross_entropy(logits, labels) + aux.sum()
        if self.context_parallel == 1:
            return self._cross_entropy(logits, labels)
        loss = context_parallel_cross_entropy(logits, labels, self.vocab_size, chunk_tokens=self.chunk_tokens)
        return scale_gradient(loss, self.context_parallel)

    def _cross_entropy(self, logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, vocab_size=self.vocab_size, chunk_tokens=self.chunk_tokens)


def pipe_topology(state: ParallelState):
    """The topology of the ``PipelineModule``, from which DeepSpeed's ``PipelineEngine`` builds its grid (it takes
    no mpu, so no sequence-parallel group). Under context parallelism its data axis is data x context (state's
    (pipe, data, context, model) ranks in the same order): the grid's data-parallel group, over which the engine and
    ZeRO-1 reduce and partition a stage's gradients, is its data x context group; each stage's
    model-parallel group (gradient norm, overflow) stays pipe x model; the tied-weight groups are built per
    (data, context) rank. The engine averages the gradients over D x C ranks and every CP rank holds the whole
    sequence's loss, so the loss's gradient is multiplied by C (``VocabParallelLoss``): the chunks' gradients
    are summed, the data-parallel ones averaged, and the logged loss, a mean over D x C equal copies, is unchanged."""
    if state.context_parallel == 1:
        return state.topology
    return PipeModelDataParallelTopology(num_pp=state.pipeline_parallel, num_mp=state.tensor_parallel,
                                         num_dp=state.data_parallel * state.context_parallel)


class MoETransformerLayer(TransformerLayer):
    """A layer of a mixture of experts' pipeline: the activations are (hidden, aux), aux [1] the sum of the
    auxiliary losses of the layers before (fp32), so that every stage's reach the last stage's loss, and their
    gradient flows back through DeepSpeed's pipeline sends like the hidden states'. Not recomputed (as the GPT's
    MoE layers: its name is not among the checkpointable layers)."""

    def forward(self, x):
        hidden, aux = x if isinstance(x, tuple) else (x, torch.zeros(1, device=x.device, requires_grad=True))
        hidden = super().forward(hidden)
        if isinstance(self.mlp, MoEMLP) and self.training:
            aux = aux + self.mlp.aux_loss.float().reshape(1)
        return hidden, aux


class MoEFinalNorm(FinalNorm):
    def forward(self, x):
        hidden, aux = x
        return self.norm(hidden), aux


class MoELMHead(LMHead):
    def forward(self, x):
        hidden, aux = x
        return super().forward(hidden), aux


def layer_specs(config: GPTConfig, layout: Layout, init_seed: int) -> list:
    """The stages in order; each draws its initial weights from the seed ``models.gpt.GPT`` gives it."""
    L, moe = config.num_layers, bool(config.num_experts)
    if config.tie_embeddings:
        first = TiedLayerSpec(TIED_KEY, Embedding, config, layout, stage_seed(init_seed, 0),
                              tied_weight_attr=["word_embeddings.weight"])
        last = TiedLayerSpec(TIED_KEY, Embedding, config, layout, stage_seed(init_seed, 0),
                             forward_fn=_tied_logits_aux if moe else _tied_logits,
                             tied_weight_attr=["word_embeddings.weight"])
    else:
        first = LayerSpec(Embedding, config, layout, stage_seed(init_seed, 0))
        last = LayerSpec(MoELMHead if moe else LMHead, config, layout, stage_seed(init_seed, L + 2))
    layer = MoETransformerLayer if moe else TransformerLayer
    return [first, *(LayerSpec(layer, config, layout, stage_seed(init_seed, i + 1), is_moe_layer(config, i))
                     for i in range(L)),
            LayerSpec(MoEFinalNorm if moe else FinalNorm, config, layout), last]


def gpt_pipeline(config: GPTConfig, state: ParallelState, init_seed: int, *, activation_checkpointing: bool = False,
                 checkpoint_fn=None) -> PipelineModule:
    layout = state.layout
    config.check_parallel(layout.tensor, layout.pipeline, layout.context, sequence_parallel=layout.sequence_parallel)
    kwargs = {}
    if activation_checkpointing:
        kwargs.update(activation_checkpoint_interval=1, checkpointable_layers=["TransformerLayer"])
        if checkpoint_fn is not None:
            kwargs["activation_checkpoint_func"] = checkpoint_fn
    return PipelineModule(layers=layer_specs(config, layout, init_seed),
                          loss_fn=VocabParallelLoss(config.vocab_size, state.context_parallel,
                                                    layout.loss_chunk_tokens or None),
                          topology=pipe_topology(state), partition_method="type:TransformerLayer", **kwargs)


def pipe_to_gpt_name(name: str, config: GPTConfig) -> str:
    """Map a PipelineModule parameter name to the matching ``GPT`` parameter name.

    ``tied_modules.embed.word_embeddings.weight`` -> ``embedding.word_embeddings.weight``;
    ``<i>.<rest>``: layer 0 is the embedding, 1..L the transformer layers, L+1 the
    final norm, L+2 the untied LM head.
    """
    head, _, rest = name.partition(".")
    if head == "tied_modules":
        key, _, rest = rest.partition(".")
        return f"embedding.{rest}"
    idx, L = int(head), config.num_layers
    if idx == 0:
        return f"embedding.{rest}"
    if idx <= L:
        return f"layers.{idx - 1}.{rest}"
    if idx == L + 1:
        return f"final_norm.{rest}"
    return f"lm_head.{rest}"


def gpt_to_pipe_layer(name: str, config: GPTConfig) -> int:
    """Index of the pipeline layer that owns the ``GPT`` parameter ``name``."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("layers."):
        return int(name.split(".")[1]) + 1
    if name.startswith("final_norm."):
        return config.num_layers + 1
    return config.num_layers + 2


def gpt_to_pipe_name(name: str, config: GPTConfig) -> str:
    """The inverse of ``pipe_to_gpt_name``: a ``GPT`` parameter name as the PipelineModule names it."""
    idx = gpt_to_pipe_layer(name, config)
    rest = name.split(".", 2)[2] if name.startswith("layers.") else name.partition(".")[2]
    if idx == 0 and config.tie_embeddings:
        return f"tied_modules.{TIED_KEY}.{rest}"
    return f"{idx}.{rest}"
