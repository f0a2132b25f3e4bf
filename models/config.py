"""Model configuration shared by the GPT variants; validated when it is built."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

VARIANTS = ("gpt2", "llama")
MOE_FIELDS = ("num_experts", "moe_top_k", "moe_layer_freq", "moe_dense_layers", "moe_ffn_hidden_size",
              "moe_aux_loss_coeff",
              "moe_z_loss_coeff", "moe_capacity_factor", "moe_min_capacity", "moe_norm_topk_prob",
              "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
              "moe_router_topk_scaling_factor", "moe_router_load_balancing_type", "moe_router_enable_expert_bias",
              "moe_router_bias_update_rate", "moe_router_bias_rate_schedule", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate", "moe_grouped_gemm")
# how a run lays the model out, not the model: the run's Layout (models/parallel/layout.py) holds them
LAYOUT_FIELDS = {"sequence_parallel": "--sequence-parallel", "tiled_mlp": "--tiled-mlp", "tiled_loss": "--tiled-loss",
                 "moe_expert_parallel": "--expert-parallel"}


class ConfigError(ValueError):
    user_error = True  # a command reports it in one line (pipeline.job.errors.is_user_error)


def read_json(path: str | Path, what: str, error: type[Exception]):
    """A JSON file's contents, or ``error`` naming ``what`` it is, the file (and line and column)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise error(f"{what} {path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def read_config_json(path: str | Path) -> dict:
    """A model config file's JSON, or a ConfigError naming the file (and line and column)."""
    return read_json(path, "model config file", ConfigError)


@dataclass
class GPTConfig:
    """``gpt2``: learned positions, LayerNorm, GELU MLP, biases, tied embeddings (Megatron-LM's model).
    ``llama``: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, tied or untied; with the options
    ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3) and ``sliding_window`` (Mistral).
    """
    variant: str = "gpt2"
    vocab_size: int = 50257
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int | None = None        # None: = num_heads (multi-head attention)
    head_dim: int | None = None            # None: hidden_size // num_heads
    ffn_hidden_size: int | None = None     # None: 4h (gpt2), or SwiGLU's 8h/3 rounded up to 256 (llama)
    max_position_embeddings: int = 1024
    seq_length: int | None = None          # training sequence length; None: max_position_embeddings
    tie_embeddings: bool | None = None     # None: True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    bias: bool | None = None               # None: True for gpt2, False for llama
    qkv_bias: bool = False                 # llama: biases on Q, K, V only (Qwen2); ``bias`` puts them everywhere
    qk_norm: bool = False                  # llama: RMSNorm over head_dim on each Q and K head before RoPE (Qwen3)
    sliding_window: int | None = None      # llama: Mistral's window; only as long as seq_length or longer (see below)
    hf_model_type: str | None = None       # the Hugging Face family exports write (None: by variant and options)
    # mixture of experts (models/moe/, docs/moe.md); num_experts 0: dense
    num_experts: int = 0                   # experts per MoE layer
    moe_top_k: int = 2                     # experts per token
    moe_layer_freq: int = 1                # every n-th layer is MoE (layers n-1, 2n-1, ...; 1: every layer)
    moe_dense_layers: list[int] = field(default_factory=list)  # layers kept dense (Qwen3-MoE's mlp_only_layers)
    moe_ffn_hidden_size: int | None = None  # each expert's intermediate size; None: ffn_hidden_size
    moe_aux_loss_coeff: float = 0.01       # load-balancing loss coefficient (Switch/GShard, Mixtral's formula)
    moe_z_loss_coeff: float = 0.0          # router z-loss coefficient (ST-MoE); 0: off
    moe_capacity_factor: float | None = None  # None: dropless; else slots per expert = ceil(k S / E x factor)
    moe_min_capacity: int = 4              # with a capacity factor: at least this many slots per expert
    moe_norm_topk_prob: bool = True        # renormalise the top-k weights (Mixtral; Qwen3-MoE's norm_topk_prob)
    # the router (models/moe/router.py) and the experts' compute; Megatron-Core's names, DeepSeek-V3's in brackets
    moe_router_score_function: str = "softmax"  # softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3)
    moe_router_num_groups: int | None = None    # experts in this many groups (n_group); None: no group limit
    moe_router_group_topk: int | None = None    # a token's experts come from its best groups only (topk_group)
    moe_router_topk_scaling_factor: float = 1.0  # the routed experts' weights times this (routed_scaling_factor)
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss (batch), seq_aux_loss (per sequence) or none
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias on the selection
    moe_router_bias_update_rate: float = 1e-3   # the bias's step per update (DeepSeek-V3's gamma)
    moe_router_bias_rate_schedule: str = "constant"  # constant, or lr: the rate decays as the LR does after warmup
    moe_shared_expert_intermediate_size: int | None = None  # an always-on MLP beside the experts (n_shared x f)
    moe_shared_expert_gate: bool = False        # Qwen2-MoE: the shared expert's output times sigmoid(x w)
    moe_grouped_gemm: bool = False              # the local experts as one grouped matrix product, not a loop
    # multi-head latent attention and multi-token prediction (models/deepseek.py): DeepSeek-V3's names
    multi_latent_attention: bool = False   # llama: MLA replaces the attention of every layer
    q_lora_rank: int | None = None         # MLA: the query's low-rank width; None: a full-rank query projection
    kv_lora_rank: int = 512                # MLA: the compressed key-value latent's width
    qk_nope_head_dim: int = 128            # MLA: each head's query/key part without RoPE
    qk_rope_head_dim: int = 64             # MLA: each head's query part with RoPE; the key's is one, shared
    v_head_dim: int = 128                  # MLA: each head's value width
    mtp_num_layers: int = 0                # multi-token prediction depths (num_nextn_predict_layers); 0: none
    mtp_loss_scaling_factor: float = 0.1   # the MTP losses' weight in training (DeepSeek-V3's lambda)
    extra: dict = field(default_factory=dict)  # free-form metadata (e.g. where an import came from)

    def __post_init__(self):
        err = self._problem()
        if err:
            raise ConfigError(f"invalid model config: {err}")

    def _problem(self) -> str | None:
        if self.variant not in VARIANTS:
            return f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}"
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings",
                     "make_vocab_size_divisible_by"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                return f"{name} must be a positive integer, got {getattr(self, name)!r}"
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                return (f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                        f"change one of them (or set head_dim explicitly for the llama variant)")
            self.head_dim = self.hidden_size // self.num_heads
        elif self.variant == "gpt2" and self.head_dim * self.num_heads != self.hidden_size:
            return f"gpt2 needs head_dim x num_heads == hidden_size, got {self.head_dim} x {self.num_heads}"
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            return f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}"
        if self.variant == "gpt2" and self.num_kv_heads != self.num_heads:
            return "grouped-query attention (num_kv_heads != num_heads) is only in the llama variant"
        if self.variant == "llama" and self.head_dim % 2:
            return f"RoPE needs an even head_dim, got {self.head_dim}"
        if self.ffn_hidden_size is None:
            if self.variant == "gpt2":
                self.ffn_hidden_size = 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 256 * -(-int(8 * self.hidden_size / 3) // 256)
        if self.seq_length is None:
            self.seq_length = self.max_position_embeddings
        if self.seq_length > self.max_position_embeddings:
            return (f"seq_length {self.seq_length} is longer than max_position_embeddings "
                    f"{self.max_position_embeddings}")
        if self.tie_embeddings is None:
            self.tie_embeddings = True
        if self.variant == "gpt2" and not self.tie_embeddings:
            return "the gpt2 variant ties its input and output embeddings (tie_embeddings must be true)"
        if self.bias is None:
            self.bias = self.variant == "gpt2"
        llama_only = self._llama_option_problem()
        if llama_only:
            return llama_only
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                return f"{name} must be in [0, 1), got {getattr(self, name)}"
        return self._moe_problem() or self._latent_problem()

    def _llama_option_problem(self) -> str | None:
        for name in ("qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be true or false, got {getattr(self, name)!r}"
            if getattr(self, name) and self.variant != "llama":
                return f"{name} is an option of the llama variant, not of {self.variant}"
        w = self.sliding_window
        if w is None:
            return None
        if self.variant != "llama" or not isinstance(w, int) or w < 1:
            return f"sliding_window must be a positive integer of a llama model, got {w!r} ({self.variant})"
        if w < self.seq_length:
            # The model computes full causal attention: equal to sliding-window attention only within the window.
            return (f"sliding_window {w} is shorter than seq_length {self.seq_length} (by default "
                    f"max_position_embeddings): sliding-window attention is not implemented, and full causal "
                    f"attention equals it only for sequences no longer than the window")
        return None

    def _moe_problem(self) -> str | None:
        """What is wrong with the MoE fields (None if the model is dense or they are right)."""
        c = self
        if not isinstance(c.num_experts, int) or c.num_experts < 0:
            return f"num_experts must be 0 (dense) or a positive integer, got {c.num_experts!r}"
        if c.num_experts == 0:
            return None
        dense = c.moe_dense_layers
        if not isinstance(dense, (list, tuple)) or any(not isinstance(i, int) or not 0 <= i < c.num_layers
                                                       for i in dense):
            return f"moe_dense_layers must be a list of layer indices in [0, {c.num_layers}), got {dense!r}"
        c.moe_dense_layers = sorted(set(dense))
        for name in ("moe_top_k", "moe_layer_freq"):
            if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
                return f"{name} must be a positive integer, got {getattr(c, name)!r}"
        if c.moe_top_k > c.num_experts:
            return f"moe_top_k {c.moe_top_k} is more than num_experts {c.num_experts}"
        f = c.moe_ffn_hidden_size
        if f is not None and (not isinstance(f, int) or f < 1):
            return f"moe_ffn_hidden_size must be a positive integer, got {c.moe_ffn_hidden_size!r}"
        if c.moe_capacity_factor is not None and not c.moe_capacity_factor > 0:
            return f"moe_capacity_factor must be positive (or null: dropless), got {c.moe_capacity_factor!r}"
        if c.moe_aux_loss_coeff < 0 or c.moe_z_loss_coeff < 0:
            return "moe_aux_loss_coeff and moe_z_loss_coeff must not be negative"
        return self._router_problem()

    def _router_problem(self) -> str | None:
        """What is wrong with the router and shared-expert fields of an MoE config."""
        c = self
        choices = {"moe_router_score_function": ("softmax", "sigmoid"),
                   "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "none"),
                   "moe_router_bias_rate_schedule": ("constant", "lr")}
        for name, allowed in choices.items():
            if getattr(c, name) not in allowed:
                return f"{name} must be one of {', '.join(allowed)}, got {getattr(c, name)!r}"
        groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            return "moe_router_num_groups and moe_router_group_topk go together; set both or neither"
        if groups is not None:
            if not all(isinstance(v, int) and v >= 1 for v in (groups, group_topk)) or group_topk > groups:
                return (f"moe_router_group_topk {group_topk} must be a positive integer at most "
                        f"moe_router_num_groups {groups}")
            if c.num_experts % groups or c.num_experts // groups * group_topk < c.moe_top_k:
                return (f"moe_router_num_groups {groups} must divide num_experts {c.num_experts}, and its best "
                        f"{group_topk} groups hold at least moe_top_k {c.moe_top_k} experts")
        if not c.moe_router_topk_scaling_factor > 0 or not c.moe_router_bias_update_rate >= 0:
            return "moe_router_topk_scaling_factor must be positive and moe_router_bias_update_rate not negative"
        for name in ("moe_router_enable_expert_bias", "moe_shared_expert_gate", "moe_grouped_gemm"):
            if not isinstance(getattr(c, name), bool):
                return f"{name} must be true or false, got {getattr(c, name)!r}"
        shared = c.moe_shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or shared < 1):
            return f"moe_shared_expert_intermediate_size must be a positive integer (or null: none), got {shared!r}"
        if c.moe_shared_expert_gate and shared is None:
            return "moe_shared_expert_gate needs a shared expert; set moe_shared_expert_intermediate_size"
        return None

    def _latent_problem(self) -> str | None:
        """What is wrong with the multi-head latent attention and multi-token prediction fields."""
        c = self
        if not isinstance(c.mtp_num_layers, int) or c.mtp_num_layers < 0 or c.mtp_loss_scaling_factor < 0:
            return "mtp_num_layers must be 0 or a positive integer and mtp_loss_scaling_factor not negative"
        if c.mtp_num_layers and c.variant != "llama":
            return "multi-token prediction (mtp_num_layers) is an option of the llama variant"
        if not c.multi_latent_attention:
            return None
        if c.variant != "llama" or c.qk_norm or c.qkv_bias or c.num_kv_heads != c.num_heads:
            return ("multi_latent_attention is an option of the llama variant, without qk_norm, qkv_bias or "
                    "grouped-query attention (num_kv_heads = num_heads)")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
                return f"{name} must be a positive integer, got {getattr(c, name)!r}"
        if c.qk_rope_head_dim % 2:
            return f"RoPE needs an even qk_rope_head_dim, got {c.qk_rope_head_dim}"
        if c.q_lora_rank is not None and (not isinstance(c.q_lora_rank, int) or c.q_lora_rank < 1):
            return f"q_lora_rank must be a positive integer (or null: a full-rank query), got {c.q_lora_rank!r}"
        return None

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has experts: every ``moe_layer_freq``-th layer (Qwen3-MoE's
        ``decoder_sparse_step``: layers freq-1, 2 freq-1, ...; freq 1 is every layer, as Mixtral) that is not
        among ``moe_dense_layers`` (Qwen3-MoE's ``mlp_only_layers``)."""
        return (self.num_experts > 0 and (index + 1) % self.moe_layer_freq == 0
                and index not in self.moe_dense_layers)

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence the model computes: its positions, and a sliding window if it has one."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    # -- what the variant builds, for code outside models/ that sizes, names or converts its parameters ----------
    @property
    def learned_positions(self) -> bool:
        """A learned position table beside the word embeddings (gpt2); else rotary positions, no parameters."""
        return self.variant == "gpt2"

    @property
    def norm_has_bias(self) -> bool:
        """Every norm is a LayerNorm, weight and bias (gpt2); else an RMSNorm, a weight only."""
        return self.variant == "gpt2"

    @property
    def gated_mlp(self) -> bool:
        """The MLP is SwiGLU (llama): silu(gate) * up, its fc_in the two fused as [gate; up]; else GELU."""
        return self.variant == "llama"

    @property
    def fc_in_parts(self) -> int:
        """The fused parts of an MLP's fc_in: [gate; up] when gated, else one."""
        return 2 if self.gated_mlp else 1

    def check_parallel(self, tensor_parallel: int, pipeline_parallel: int = 1, context_parallel: int = 1, *,
                       sequence_parallel: bool = False) -> None:
        """Raise ConfigError if the model cannot be split this way (``pipeline.job.layout.model_splits``)."""
        if context_parallel > 1:
            self.check_context_parallel(tensor_parallel, context_parallel, sequence_parallel=sequence_parallel)
        checks = [("num_heads", self.num_heads, tensor_parallel, "tensor-parallel size"),
                  ("num_kv_heads", self.num_kv_heads, tensor_parallel, "tensor-parallel size"),
                  ("ffn_hidden_size", self.ffn_hidden_size, tensor_parallel, "tensor-parallel size")]
        if self.num_experts:  # each expert's columns (and the shared expert's) are split as the dense MLP's
            checks.append(("moe_ffn_hidden_size", self.moe_ffn_hidden_size or self.ffn_hidden_size, tensor_parallel,
                           "tensor-parallel size"))
            if self.moe_shared_expert_intermediate_size:
                checks.append(("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size,
                               tensor_parallel, "tensor-parallel size"))
        for name, value, by, what in checks:
            if value % by:
                raise ConfigError(f"invalid model config for tensor_parallel={tensor_parallel}: {name} {value} "
                                  f"is not divisible by the {what} {by}; choose a --tensor-parallel that divides "
                                  f"{value}")
        if sequence_parallel and self.seq_length % tensor_parallel:
            raise ConfigError(f"invalid model config for tensor_parallel={tensor_parallel}: sequence parallelism "
                              f"splits the sequence into {tensor_parallel} equal chunks, and seq_length "
                              f"{self.seq_length} is not divisible by {tensor_parallel}; choose a seq_length "
                              f"that is a multiple of {tensor_parallel}")
        if pipeline_parallel > self.num_layers:
            raise ConfigError(f"pipeline_parallel={pipeline_parallel} is more than num_layers {self.num_layers}: "
                              f"every pipeline stage needs at least one transformer layer; use at most "
                              f"{self.num_layers} stages")

    def check_context_parallel(self, tensor_parallel: int, context_parallel: int, *,
                               sequence_parallel: bool = False) -> None:
        """Context parallelism (DeepSpeed-Ulysses) splits the sequence into ``context_parallel`` chunks (each split
        again by TP under sequence parallelism) and each TP rank's heads across the context group."""
        where = f"invalid model config for context_parallel={context_parallel}, tensor_parallel={tensor_parallel}"
        chunks = context_parallel * (tensor_parallel if sequence_parallel else 1)
        if self.seq_length % chunks:
            what = (f"context_parallel x tensor_parallel = {chunks} (sequence parallelism)"
                    if chunks != context_parallel else f"context_parallel {context_parallel}")
            raise ConfigError(f"{where}: seq_length {self.seq_length} is not divisible by {what}; choose a "
                              f"--seq-length that is a multiple of {chunks}")
        if self.num_heads % tensor_parallel == 0 and (self.num_heads // tensor_parallel) % context_parallel:
            raise ConfigError(f"{where}: the {self.num_heads // tensor_parallel} attention heads of each tensor-"
                              f"parallel rank are not divisible by context_parallel {context_parallel}; choose a "
                              f"context-parallel size that divides num_heads / tensor_parallel")

    # -- (de)serialisation ----------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.num_experts:  # a dense model's config lists no MoE field
            for name in MOE_FIELDS:
                d.pop(name, None)
        return {"model_type": "gpt", **d}

    @classmethod
    def from_dict(cls, d: dict, source: str = "model config") -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"model_type"})
        layout = [name for name in unknown if name in LAYOUT_FIELDS]
        if layout:
            raise ConfigError(f"{source}: {layout[0]} is how a run lays the model out, not part of the model; drop "
                              f"it from the config and pass {LAYOUT_FIELDS[layout[0]]} to the command")
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}; "
                              f"known fields: {', '.join(sorted(known))}")
        if d.get("model_type", "gpt") != "gpt":
            raise ConfigError(f"{source}: model_type is {d['model_type']!r}, expected 'gpt'")
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "GPTConfig":
        return cls.from_dict(read_config_json(path), source=str(path))

    # -- sizes ------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Every parameter of the model (all experts, the balancing biases, the MTP depths)."""
        h, V = self.hidden_size, self.vocab_size
        final_norm = (2 if self.variant == "gpt2" else 1) * h
        emb = V * h + (self.max_position_embeddings * h if self.variant == "gpt2" else 0)
        head = 0 if self.tie_embeddings else V * h
        layers = sum(self._layer_parameters(self.is_moe_layer(i)) for i in range(self.num_layers))
        # each depth: enorm, hnorm, final_norm, eh_proj [h, 2h] and a layer (an MoE layer where the model has experts)
        mtp = self.mtp_num_layers * (3 * h + 2 * h * h + self._layer_parameters(self.num_experts > 0))
        return emb + layers + final_norm + head + mtp

    def _attention_weights(self) -> int:
        """The attention's matrix entries (what multiplies activations)."""
        h, heads = self.hidden_size, self.num_heads
        if not self.multi_latent_attention:
            q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
            return h * (q + 2 * kv) + q * h
        qk, rank = self.qk_nope_head_dim + self.qk_rope_head_dim, self.kv_lora_rank
        query = h * heads * qk if self.q_lora_rank is None else self.q_lora_rank * (h + heads * qk)
        return (query + h * (rank + self.qk_rope_head_dim) + rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                + heads * self.v_head_dim * h)

    def _mlp_parameters(self, f: int) -> int:
        b = 1 if self.bias else 0
        if self.variant == "gpt2":
            return 2 * self.hidden_size * f + b * (f + self.hidden_size)
        return 3 * self.hidden_size * f + b * (2 * f + self.hidden_size)

    def _layer_parameters(self, moe: bool) -> int:
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.multi_latent_attention:  # + the latents' norms
            attn = self._attention_weights() + self.kv_lora_rank + (self.q_lora_rank or 0)
        else:
            qkv_b = 1 if self.bias or self.qkv_bias else 0
            attn = (self._attention_weights() + qkv_b * (q + 2 * kv) + (h if self.bias else 0)
                    + (2 * self.head_dim if self.qk_norm else 0))
        norms = (4 if self.variant == "gpt2" else 2) * h
        if not moe:
            return attn + self._mlp_parameters(self.ffn_hidden_size) + norms
        E, shared = self.num_experts, self.moe_shared_expert_intermediate_size
        experts = E * self._mlp_parameters(self.moe_ffn_hidden_size or self.ffn_hidden_size) + h * E
        experts += E if self.moe_router_enable_expert_bias else 0
        experts += (self._mlp_parameters(shared) if shared else 0) + (h if self.moe_shared_expert_gate else 0)
        return attn + experts + norms

    def flops_per_token(self, seq_length: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 per matmul weight plus attention.

        Counts every weight matrix that multiplies activations (the output layer
        included, positions excluded; of an MoE layer the router, the top-k experts and the shared expert; of
        latent attention its down and up projections; each MTP depth's projection, layer and output layer) and
        12 x L x (heads x head_dim) x seq for scores and values, as PaLM's MFU does (no discount for the
        causal mask; latent attention: 6 x L x heads x (nope + rope + v) x seq; the MTP depths as layers).
        """
        s = seq_length or self.seq_length
        h, L, depths = self.hidden_size, self.num_layers, self.mtp_num_layers
        per_ffn = (2 if self.variant == "gpt2" else 3) * h
        moe = sum(1 for i in range(L) if self.is_moe_layer(i)) + (depths if self.num_experts else 0)
        # an MoE layer's token meets its router, its top-k experts and the shared expert only (the active parameters)
        active = (self.moe_top_k * per_ffn * (self.moe_ffn_hidden_size or self.ffn_hidden_size) + h * self.num_experts
                  + per_ffn * (self.moe_shared_expert_intermediate_size or 0) + h * self.moe_shared_expert_gate)
        n_mlp = (L + depths - moe) * per_ffn * self.ffn_hidden_size + moe * active
        # each MTP depth: its eh_proj, its layer and the shared output layer once more
        matmul_params = ((L + depths) * self._attention_weights() + n_mlp + (1 + depths) * self.vocab_size * h
                         + depths * 2 * h * h)
        if self.multi_latent_attention:  # scores over nope + rope per head, values of v_head_dim
            attention = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        else:
            attention = 2 * self.num_heads * self.head_dim
        return 6.0 * matmul_params + 6.0 * (L + depths) * attention * s
