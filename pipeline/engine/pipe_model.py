"""The GPT as a DeepSpeed ``PipelineModule``: a list of layer specs (GPT-NeoX's GPT2ModelPipe idea).

The stages are the very modules of ``models.gpt`` (Embedding, TransformerLayer x L,
FinalNorm, LMHead), so a pipeline layer holds the parameters of the matching
GPT submodule under the same names. For a tied model the Embedding appears
twice through ``TiedLayerSpec``: DeepSpeed keeps one copy per owning stage and
all-reduces its gradient between the first and last stage.

Multi-token prediction (``mtp_num_layers``, models/deepseek.py) runs on the last stage, after the final norm: the
input ids travel with the activations from the first stage (an integer tensor beside the hidden states and the
auxiliary losses, which DeepSpeed's sends carry and give no gradient), the embedding is a tied layer of the first
and last stages (untied output layer or not), whose last-stage copy embeds each depth's shifted tokens; the depths
(``PipeMTP``, named ``mtp.*`` as the GPT's) give their hidden states to the one output layer, and the loss adds
lambda x the mean of the depths' cross-entropies (``MTPLoss``), as ``GPT.forward``.

Packed rows (``packed_rows``: SFT's conversations, ``models.documents``) enter as (input ids, document ids); the
document ids travel with the activations to the final norm, and each stage's layers rebuild from them the
per-document positions and block-diagonal causal mask, so a row's conversations attend only to themselves, as
``GPT.forward(documents=...)``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.runtime.utils import partition_balanced
from torch import nn

from models import GPTConfig
from models.deepseek import MultiTokenPrediction, depth_inputs, depths_loss
from models.documents import DocumentAttention
from models.lora import LoRAConfig, add_lora
from models.gpt import (Embedding, FinalNorm, LMHead, TransformerLayer, context_parallel_cross_entropy, mtp_arguments,
                        stage_seed)
from models.moe import MoEMLP, is_moe_layer
from models.parallel import Layout, ParallelState, scale_gradient, vocab_parallel_cross_entropy

TIED_KEY = "embed"


def _tied_logits(embedding: Embedding, hidden):
    return embedding.logits(hidden)


def _tied_logits_aux(embedding: Embedding, carried):
    """(hidden, aux, [each MTP depth's hidden]) -> their logits and aux."""
    hidden, aux, *depths = carried
    return embedding.logits(hidden), aux, *(embedding.logits(h) for h in depths)


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


class MTPLoss(VocabParallelLoss):
    """``loss_fn`` of a model with multi-token prediction: (logits, aux, each depth's logits) -> the cross-entropy +
    aux + ``scaling`` x the mean of the depths' cross-entropies (``GPT.forward``'s sum); under context parallelism
    each a whole-sequence mean from this rank's chunk, the gradient times C (as ``VocabParallelLoss``)."""

    def __init__(self, vocab_size: int, scaling: float, context_parallel: int = 1, chunk_tokens: int | None = None):
        super().__init__(vocab_size, context_parallel, chunk_tokens)
        self.scaling = scaling

    def __call__(self, outputs, labels):
        logits, aux, *depth_logits = outputs
        if self.context_parallel == 1:
            main = self._cross_entropy(logits, labels)
        else:
            main = context_parallel_cross_entropy(logits, labels, self.vocab_size, chunk_tokens=self.chunk_tokens)
        loss = main + aux.sum() + self.scaling * depths_loss(depth_logits, labels, self.vocab_size)
        return loss if self.context_parallel == 1 else scale_gradient(loss, self.context_parallel)


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


def _no_aux(device) -> torch.Tensor:
    return torch.zeros(1, device=device, requires_grad=True)


class MoETransformerLayer(TransformerLayer):
    """A layer of a mixture of experts' pipeline: the activations are (hidden, aux, ...), aux [1] the sum of the
    auxiliary losses of the layers before (fp32), so that every stage's reach the last stage's loss, and their
    gradient flows back through DeepSpeed's pipeline sends like the hidden states'; what follows (the input ids of
    a model with multi-token prediction) passes through. Not recomputed (as the GPT's MoE layers: its name is not
    among the checkpointable layers)."""

    def forward(self, x):
        hidden, aux, *rest = x if isinstance(x, tuple) else (x, _no_aux(x.device))
        hidden = super().forward(hidden)
        if isinstance(self.mlp, MoEMLP) and self.training:
            aux = aux + self.mlp.aux_loss.float().reshape(1)
        return hidden, aux, *rest


class MoEFinalNorm(FinalNorm):
    def forward(self, x):
        hidden, *rest = x
        return self.norm(hidden), *rest


class MoELMHead(LMHead):
    """The output layer of the carried activations: (hidden, aux, [each MTP depth's hidden]) -> their logits and
    aux."""

    def forward(self, x):
        hidden, aux, *depths = x
        head = super().forward
        return head(hidden), aux, *(head(h) for h in depths)


class IdsCarryingEmbedding(Embedding):
    """The first stage of a model with multi-token prediction: (hidden, aux, input ids), the ids for the last
    stage's depths (the whole sequence, as ``GPT.mtp_loss`` reads it)."""

    def forward(self, input_ids):
        hidden = super().forward(input_ids)
        return hidden, _no_aux(hidden.device), input_ids


def _mtp_embedded(embedding: Embedding, carried):
    """The last stage's copy of the tied embedding: (hidden, aux, ids) -> (hidden, aux, each depth's embedded
    input tokens)."""
    hidden, aux, input_ids = carried
    return hidden, aux, *depth_inputs(input_ids, embedding.config.mtp_num_layers, embedding.word_embeddings)


class PipeMTP(MultiTokenPrediction):
    """The depths as a layer of the last stage: (hidden, aux, each depth's embedded tokens) -> (hidden, aux + the
    depths' MoE auxiliary losses, each depth's hidden states); the GPT's modules, seeds and names (``mtp.*``)."""

    def __init__(self, config: GPTConfig, layout: Layout, init_seed: int):
        super().__init__(*mtp_arguments(config, layout, init_seed))

    def forward(self, carried):
        hidden, aux, *embedded = carried
        depths = self.depths(hidden, embedded)
        extra = self.moe_aux_loss() if self.training else 0.0
        if torch.is_tensor(extra):
            aux = aux + extra.float().reshape(1)
        return hidden, aux, *depths


class PackedRowsEmbedding(Embedding):
    """The first stage of packed rows: (input ids, document ids) -> (hidden, [aux,] document ids), the tokens
    embedded at their documents' positions (aux for a model with experts, as ``MoETransformerLayer`` carries it)."""

    def forward(self, inputs):
        input_ids, document_ids = inputs
        documents = DocumentAttention.of_ids(document_ids).chunk()
        hidden = super().forward(*documents.embedding_inputs(input_ids, self.sequence_parallel))
        carried = (_no_aux(hidden.device),) if self.config.num_experts else ()
        return hidden, *carried, document_ids


class PackedRowsTransformerLayer(TransformerLayer):
    """A layer over packed rows: (hidden, [aux,] document ids), its attention within each document; a mixture of
    experts' auxiliary loss added to aux (``MoETransformerLayer``). Recomputed under --recompute full, as the
    GPT's dense layers on this path (``models.documents``); its document ids need no gradient."""

    def forward(self, x):
        hidden, *aux, document_ids = x
        hidden = super().forward(hidden, DocumentAttention.of_ids(document_ids).chunk())
        if aux and isinstance(self.mlp, MoEMLP) and self.training:
            aux = [aux[0] + self.mlp.aux_loss.float().reshape(1)]
        return hidden, *aux, document_ids


class PackedRowsFinalNorm(FinalNorm):
    """(hidden, [aux,] document ids) -> the normed hidden states (with aux): the boundaries end here."""

    def forward(self, x):
        hidden, *aux, _ = x
        return (self.norm(hidden), *aux) if aux else self.norm(hidden)


def carries_several(config) -> bool:
    """Whether the stages pass (hidden, aux, ...) between them: a model with experts (their auxiliary losses) or
    multi-token prediction (the input ids, for the last stage's depths)."""
    return bool(getattr(config, "num_experts", 0)) or bool(getattr(config, "mtp_num_layers", 0))


def layer_specs(config: GPTConfig, layout: Layout, init_seed: int, packed_rows: bool = False) -> list:
    """The stages in order; each draws its initial weights from the seed ``models.gpt.GPT`` gives it. A model with
    experts or multi-token prediction carries (hidden, aux, ...) between its layers; ``packed_rows``: the
    document ids too (``PackedRowsTransformerLayer``)."""
    L, mtp = config.num_layers, bool(config.mtp_num_layers)
    if packed_rows and mtp:
        raise ValueError("packed rows on pipeline stages: multi-token prediction reads whole rows across documents")
    carried = carries_several(config)
    embedding = PackedRowsEmbedding if packed_rows else IdsCarryingEmbedding if mtp else Embedding

    def tied(**kwargs):
        return TiedLayerSpec(TIED_KEY, embedding, config, layout, stage_seed(init_seed, 0),
                             tied_weight_attr=["word_embeddings.weight"], **kwargs)

    first = (tied() if config.tie_embeddings or mtp else
             LayerSpec(embedding, config, layout, stage_seed(init_seed, 0)))
    if config.tie_embeddings:
        head = tied(forward_fn=_tied_logits_aux if carried else _tied_logits)
    else:
        head = LayerSpec(MoELMHead if carried else LMHead, config, layout, stage_seed(init_seed, L + 2))
    layer = PackedRowsTransformerLayer if packed_rows else MoETransformerLayer if carried else TransformerLayer
    final_norm = PackedRowsFinalNorm if packed_rows else MoEFinalNorm if carried else FinalNorm
    specs = [first, *(LayerSpec(layer, config, layout, stage_seed(init_seed, i + 1), is_moe_layer(config, i))
                      for i in range(L)),
             LayerSpec(final_norm, config, layout)]
    if mtp:  # the depths' embedded tokens (L + 2, the tied embedding's last-stage copy), the depths (L + 3)
        specs += [tied(forward_fn=_mtp_embedded), LayerSpec(PipeMTP, config, layout, init_seed)]
    return [*specs, head]


def stage_layers(config: GPTConfig, pipeline: int) -> list[range]:
    """The transformer layers (0-based) each stage holds: DeepSpeed's partition "type:TransformerLayer" of
    ``layer_specs`` (the embedding, the layers, then the final norm and head, with MTP its two specs more)."""
    L = config.num_layers
    after = 4 if getattr(config, "mtp_num_layers", 0) else 2
    parts = partition_balanced(weights=[0] + [1] * L + [0] * after, num_parts=pipeline)
    return [range(min(max(start - 1, 0), L), min(max(stop - 1, 0), L)) for start, stop in zip(parts, parts[1:])]


def gpt_pipeline(config: GPTConfig, state: ParallelState, init_seed: int, *, activation_checkpointing: bool = False,
                 checkpoint_fn=None, packed_rows: bool = False) -> PipelineModule:
    """The GPT's stages at ``state``'s layout; ``packed_rows``: its inputs are (input ids, document ids)."""
    layout = state.layout
    config.check_parallel(layout.tensor, layout.pipeline, layout.context, sequence_parallel=layout.sequence_parallel)
    kwargs = {}
    if activation_checkpointing:  # (the MoE layers are not: their auxiliary loss keeps its forward's graph)
        recomputed = ["TransformerLayer"] + ([] if config.num_experts else ["PackedRowsTransformerLayer"])
        kwargs.update(activation_checkpoint_interval=1, checkpointable_layers=recomputed)
        if checkpoint_fn is not None:
            kwargs["activation_checkpoint_func"] = checkpoint_fn
    chunk = layout.loss_chunk_tokens or None
    loss_fn = (MTPLoss(config.vocab_size, config.mtp_loss_scaling_factor, state.context_parallel, chunk)
               if config.mtp_num_layers else VocabParallelLoss(config.vocab_size, state.context_parallel, chunk))
    return PipelineModule(layers=layer_specs(config, layout, init_seed, packed_rows), loss_fn=loss_fn,
                          topology=pipe_topology(state), partition_method="type:TransformerLayer", **kwargs)


def pipe_to_gpt_name(name: str, config: GPTConfig) -> str:
    """Map a PipelineModule parameter name to the matching ``GPT`` parameter name.

    ``tied_modules.embed.word_embeddings.weight`` -> ``embedding.word_embeddings.weight``;
    ``<i>.<rest>``: layer 0 is the embedding, 1..L the transformer layers, L+1 the
    final norm, L+2 the untied LM head; with multi-token prediction L+3 the depths (``mtp.*``), L+4 the head.
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
    if config.mtp_num_layers and idx == L + 3:
        return f"mtp.{rest}"
    return f"lm_head.{rest}"


def stage_module_name(stage: PipelineModule, config: GPTConfig):
    """A ``GPT`` module path -> this stage's name for it, None where another stage holds it (``add_lora``'s
    ``module_name``)."""
    here = {name for name, _ in stage.named_modules()}

    def name(gpt_name: str) -> str | None:
        piped = gpt_to_pipe_name(f"{gpt_name}.weight", config).removesuffix(".weight")
        return piped if piped in here else None
    return name


def lora_adder(config: GPTConfig, targets: Mapping, lora: LoRAConfig, seed: int) -> Callable[[nn.Module], None]:
    """``build_engine``'s ``adapt``: LoRA's adapters on ``targets`` (``add_lora``'s, named as the GPT names its
    modules) added to a GPT, or to those of a pipeline stage's layers, each drawn from ``seed`` and its name; the
    frozen embedding's output asks for a gradient."""
    def adapt(model: nn.Module) -> None:
        name = stage_module_name(model, config) if isinstance(model, PipelineModule) else lambda n: n
        add_lora(model, targets, lora, seed=seed, module_name=name)
        for embedding in (m for m in model.modules() if isinstance(m, Embedding)):
            embedding.register_forward_hook(_output_requires_grad)
    return adapt


def _output_requires_grad(module, inputs, output) -> None:
    """DeepSpeed's (reentrant) checkpoint around each layer trains the adapters inside it only if its input has a
    gradient (transformers' ``enable_input_require_grads``), and a first pipeline stage sends back its hidden states'
    gradient only if they have one."""
    if torch.is_grad_enabled():
        (output[0] if isinstance(output, tuple) else output).requires_grad_()


def gpt_to_pipe_layer(name: str, config: GPTConfig) -> int:
    """Index of the pipeline layer that owns the ``GPT`` parameter ``name``."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("layers."):
        return int(name.split(".")[1]) + 1
    if name.startswith("final_norm."):
        return config.num_layers + 1
    if name.startswith("mtp."):
        return config.num_layers + 3
    return config.num_layers + (4 if config.mtp_num_layers else 2)


def gpt_to_pipe_name(name: str, config: GPTConfig) -> str:
    """The inverse of ``pipe_to_gpt_name``: a ``GPT`` parameter name as the PipelineModule names it."""
    idx = gpt_to_pipe_layer(name, config)
    rest = name.split(".", 2)[2] if name.startswith("layers.") else name.partition(".")[2]
    if idx == 0 and (config.tie_embeddings or config.mtp_num_layers):
        return f"tied_modules.{TIED_KEY}.{rest}"
    return f"{idx}.{rest}"
