"""Megatron-LM tensor-parallel primitives (2019), sequence parallelism (2022) and context parallelism
(DeepSpeed-Ulysses, 2023). Nothing here knows about any model."""
from .context import (UlyssesAttention, chunk_start, context_chunk, gather_from_context_parallel_region, global_count,
                      reduce_from_context_parallel_region, scale_gradient)
from .cross_entropy import vocab_parallel_cross_entropy
from .layout import Layout
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, normal_init,
                     sequence_gather_linear, sharded_parameter, vocab_parallel_parameter)
from .mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_parallel_region, sequence_parallel_parameter)
from .norms import HeadRMSNorm, SequenceParallelLayerNorm, SequenceParallelRMSNorm
from .random import (CONTEXT_PARALLEL_RNG, MODEL_PARALLEL_RNG, causal_attention_from, dropout_from, get_rng_tracker,
                     model_parallel_seed, sequence_chunk_rng, sequence_chunk_stream, tensor_parallel_rng,
                     tensor_parallel_stream)
from .sharding import (ShardSpec, divide, full_state_dict, gather_full, get_shard_spec, is_sequence_parallel,
                       mark_sequence_parallel, padded_size)
from .state import (ParallelConfigError, ParallelState, destroy_model_parallel, get_parallel_state,
                    cp_group, cp_rank, cp_world_size, initialize_model_parallel, tp_group, tp_rank, tp_world_size)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "normal_init", "sharded_parameter",
    "vocab_parallel_parameter", "sequence_gather_linear",
    "vocab_parallel_cross_entropy",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "sequence_parallel_parameter",
    "HeadRMSNorm", "SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "mark_sequence_parallel",
    "is_sequence_parallel",
    "MODEL_PARALLEL_RNG", "CONTEXT_PARALLEL_RNG", "get_rng_tracker", "model_parallel_seed", "tensor_parallel_rng",
    "sequence_chunk_rng", "tensor_parallel_stream", "sequence_chunk_stream", "dropout_from", "causal_attention_from",
    "ShardSpec", "divide", "full_state_dict", "gather_full", "get_shard_spec", "padded_size",
    "Layout", "ParallelConfigError", "ParallelState", "initialize_model_parallel", "get_parallel_state",
    "destroy_model_parallel", "tp_group", "tp_rank", "tp_world_size",
    "UlyssesAttention", "chunk_start", "context_chunk", "gather_from_context_parallel_region", "global_count",
    "reduce_from_context_parallel_region", "scale_gradient", "cp_group", "cp_rank", "cp_world_size",
]
