"""``torch.compile`` per transformer block, torchtitan's way: each ``TransformerLayer`` is compiled on its own
(``nn.Module.compile``, in place, so parameter names and state dicts do not change), the embedding, the output
layer and the loss stay eager, and so does whatever wraps a block from outside (DeepSpeed's activation
checkpointing, its ZeRO and pipeline hooks; a pipeline stage's blocks are compiled where the ``PipelineModule`` holds
them, and its engine runs them as it runs eager ones). The blocks trace whole at TP 1 and 2, with or without sequence
parallelism, at CP 2 (DeepSpeed-Ulysses; RoPE at the chunk's offset, a host integer), FP8 or not,
with dropout or not, under full or selective recomputation: the TP collectives are custom ops
(models/parallel/mappings.py), and so are the draws from the model-parallel RNG streams
(models/parallel/random.py: DeepSpeed's tracker swaps the generator's state around a draw, which broke a block 10
times; where SDPA drops inside its fused kernel, a GPU, the compiled attention with dropout is recomputed in its
backward on the same mask). Full recomputation wraps the compiled block from outside (DeepSpeed's checkpoint);
selective recomputation inside a compiled block is torch's checkpoint, which Dynamo traces and the compiler's
partitioner plans (models/recompute.py: ``compiled_recompute``), where eager blocks use DeepSpeed's checkpoint and
output-discarding recomputation, which Dynamo cannot trace. An MoE block's routed experts (``MoEMLP._route``) and a
tiled MLP's tiles (DeepSpeed's ``TiledMLP``) run eagerly between the block's two graphs; ZeRO-3 is refused (its
hooks gather each module's parameters inside the block).
"""
from __future__ import annotations

from torch import nn

from .gpt import TransformerLayer


def compile_transformer_layers(model: nn.Module, *, backend="inductor", fullgraph: bool = False, **options) -> int:
    """Compile every ``TransformerLayer`` of ``model`` in place; the number compiled. ``fullgraph``: refuse a
    graph break (an error at the first call) instead of running its pieces (an MoE block has one:
    ``models.moe.MoEMLP._route``)."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile(backend=backend, fullgraph=fullgraph, **options)
    return len(layers)
