"""Weight and config mapping between the project's GPT and Hugging Face's GPT-2, Llama, Qwen2, Qwen3, Mistral,
Mixtral, Qwen3-MoE, Qwen2-MoE and DeepSeek-V3.

Pure functions on *full* (TP=1) state dicts: ``to_hf`` and ``from_hf`` never see a
process group. Sharding to a tensor-parallel size happens afterwards, with
``pipeline.checkpoints.state_dicts.load_full_state_dict``.

One table (``weight_map``) lists, for a given config, every project tensor, its full
shape and the Hugging Face tensor(s) it is made of; both directions read it, so an
export and an import cannot disagree. The two conventions differ in only four ways:

* fused tensors: the project keeps Q, K, V (and llama's gate, up) as row blocks of
  one matrix, in Hugging Face's head order; Llama stores them as separate matrices,
  GPT-2 stores QKV fused too (``c_attn``);
* GPT-2's ``Conv1D`` stores a linear weight as [in, out], the transpose of ``nn.Linear``;
* a tied output layer has no tensor of its own in the project's state dict;
* DeepSeek-V3 (``rope_interleave``, its default) rotates interleaved pairs of the RoPE rows of the query and
  ``kv_a_proj_with_mqa``; the project's latent attention rotates halves: those rows are reordered [even; odd] on
  import and back on export (``models.deepseek.deinterleave_rope_rows``), the same function bit for bit.

DeepSeek-V3's multi-token prediction modules are where its checkpoints keep them, ``model.layers.{L + d}.*``
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and one decoder layer, L = ``num_hidden_layers``), which
``DeepseekV3ForCausalLM`` does not load and transformers' ``MtpModel.from_pretrained`` does: an import keeps the
depths the files hold (``mtp_num_layers``; none in what ``save_pretrained`` writes), an export writes the model's.
The copies of the embedding and output layer some checkpoints give each depth (``embed_tokens``,
``shared_head.head``) are checked equal to the model's on import and not written on export (the project shares
them, as ``MtpModel`` does).

The Hugging Face families are one module each in ``pipeline.hf.architectures``, registered by one line in its
``HF_FAMILIES``: each names its classes, reads its config into the project's (Qwen2, Qwen3 and Mistral are options
of the llama variant: ``qkv_bias``, ``qk_norm``, ``sliding_window``; Mixtral and Qwen3-MoE add the MoE fields, and
name their experts' tensors with ``pipeline.hf.experts``) and writes it back; each GPT variant's tensor names are
its ``WeightLayout`` (``VARIANT_WEIGHTS``), so nothing here branches on a variant or a family.
``GPTConfig.hf_model_type`` records the family an import came from, so that it exports as that family again.

What a Hugging Face config can express and the project's model cannot (RoPE scaling,
other activations, partial rotary, ...) is refused with the field named, never
silently approximated: a conversion that "works" but changes the function is the bug
this module exists to prevent.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from models.config import ConfigError, GPTConfig
from models.deepseek import deinterleave_rope_rows, interleave_rope_rows
from pipeline.job.arguments import DTYPE_CHOICES, add_dtype_arg  # noqa: F401 (re-exported)
from pipeline.hf.architectures import HF_FAMILIES, VARIANT_WEIGHTS
from pipeline.hf.architectures.base import ConversionError, HFFamily, WeightRule, later_generation
from pipeline.hf.experts import is_fused, unfuse_experts
from pipeline.hf.safetensors_io import (PlannedTensor, SafetensorsFiles, dtype_of, hf_weight_files, materialize,
                                       read_header, shape_of)

_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Training settings a Hugging Face config has no field for (Llama has no hidden dropout, neither has a
# vocabulary padding): kept under this key of config.json so that project -> HF -> project is lossless.
TRAINING_KEY = "megatron_ds_training"
_TRAINING_FIELDS = ("hidden_dropout", "attention_dropout", "seq_length", "make_vocab_size_divisible_by")
# an MoE model's training-only routing settings (evaluation is dropless, the z-loss only trains the router)
_MOE_TRAINING_FIELDS = ("moe_z_loss_coeff", "moe_capacity_factor", "moe_min_capacity", "moe_aux_loss_coeff",
                        "moe_router_load_balancing_type", "moe_router_bias_update_rate",
                        "moe_router_bias_rate_schedule", "moe_grouped_gemm", "mtp_loss_scaling_factor")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def short_dtype_name(name: str) -> str:
    """'fp32', 'bf16' or 'fp16' for any of the ``DTYPE_CHOICES``."""
    return SHORT_DTYPE_NAMES[DTYPES[name]]


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ConversionError(f"unknown dtype {name!r}; choose one of float32, float16, bfloat16") from None


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 (or for the string transformers keeps in a config)."""
    return str(dtype).removeprefix("torch.")


# -- the weight table --------------------------------------------------------------------------------------------

def weight_map(config: GPTConfig) -> list[WeightRule]:
    """Every tensor of the project's full state dict for ``config`` and where it lives in Hugging Face's."""
    return VARIANT_WEIGHTS[config.variant].rules(config, lambda: hf_family(config).experts)


# -- project -> Hugging Face ----------------------------------------------------------------------------------------

def hf_config(config: GPTConfig, dtype: torch.dtype | None = None, special_tokens: Mapping | None = None):
    """The ``transformers`` config of the Hugging Face model computing the same function as ``config``, in the
    family ``hf_family(config)`` (a config that family cannot hold is refused).

    ``special_tokens`` (bos/eos/pad ids) override those an import recorded in ``config.extra["hf"]``.
    """
    recorded = dict(config.extra.get("hf", {})) if isinstance(config.extra, dict) else {}
    tokens = {k: recorded.get(k) for k in _SPECIAL_TOKENS}
    tokens.update({k: v for k, v in (special_tokens or {}).items() if k in _SPECIAL_TOKENS})
    # here, not at the top: the dtype helpers of this module serve commands without transformers
    import transformers  # noqa: PLC0415
    family = hf_family(config)
    cfg = getattr(transformers, family.config_class)(**family.write(config), **tokens)
    cfg.architectures = [family.architecture]
    record = {k: getattr(config, k) for k in _TRAINING_FIELDS + (_MOE_TRAINING_FIELDS if config.num_experts else ())}
    if VARIANT_WEIGHTS[config.variant].always_biased and not config.bias:
        record["bias"] = False  # GPT-2 in transformers always has biases: these are exported as zeros
    setattr(cfg, TRAINING_KEY, record)
    if dtype is not None:
        cfg.dtype = dtype
    return cfg


def to_hf(full_state_dict: Mapping[str, torch.Tensor], config: GPTConfig, dtype: torch.dtype | str | None = None,
          special_tokens: Mapping | None = None, *, lazy: bool = False):
    """(Hugging Face config, Hugging Face state dict) of the project model ``(config, full_state_dict)``.

    ``dtype`` casts every tensor (None keeps them as they are); a cast that overflows (fp16) is refused.
    A tied model's state dict has no ``lm_head.weight``: transformers ties it on load. ``lazy``: the values
    are ``PlannedTensor``s, each made (read, cut, cast) only when ``pipeline.hf.safetensors_io`` writes it, so an
    export holds the source and one tensor, not a second model.
    """
    dtype = parse_dtype(dtype)
    hf_family(config)  # a model no transformers class holds (GPT-2 with MoE layers): said so, not as missing keys
    rules = weight_map(config)
    _check_keys(full_state_dict, rules, "project state dict")
    source_dtypes = set()
    out: dict[str, PlannedTensor] = {}
    for rule in rules:
        got = shape_of(full_state_dict, rule.ours)
        if got != rule.shape:
            raise ConversionError(f"project state dict: {rule.ours} has shape {got}, the config expects {rule.shape}")
        src_dtype = dtype_of(full_state_dict, rule.ours)
        source_dtypes.add(src_dtype)
        rows = list(rule.split) if rule.split else [rule.shape[0]]
        start = 0
        for name, n in zip(rule.theirs, rows):
            shape = (n, *rule.shape[1:])
            shape = tuple(reversed(shape)) if rule.transpose else shape
            out[name] = PlannedTensor(shape, dtype or src_dtype,
                                      _piece_maker(full_state_dict, rule, start, n, dtype))
            start += n
    always_biased = VARIANT_WEIGHTS[config.variant].always_biased
    if always_biased and not config.bias:
        like = dtype or dtype_of(full_state_dict, "embedding.word_embeddings.weight")
        out.update({name: PlannedTensor((n,), like, lambda n=n, like=like: torch.zeros(n, dtype=like))
                    for name, n in always_biased(config).items()})
    common = dtype if dtype is not None else (source_dtypes.pop() if len(source_dtypes) == 1 else torch.float32)
    cfg = hf_config(config, common, special_tokens)
    return cfg, (out if lazy else {name: planned.make() for name, planned in out.items()})


def _piece_maker(full_state_dict: Mapping, rule: WeightRule, start: int, rows: int, dtype):
    def make() -> torch.Tensor:
        piece = materialize(full_state_dict[rule.ours]).narrow(0, start, rows)
        piece = piece.t() if rule.transpose else piece
        piece = interleave_rope_rows(piece, *rule.rope) if rule.rope else piece
        # a block of a fused tensor gets its own storage: safetensors' own writer refuses tensors sharing one
        piece = piece.clone(memory_format=torch.contiguous_format) if rule.split else piece.contiguous()
        return _cast(piece, dtype, rule.ours)
    return make


def _cast(t: torch.Tensor, dtype: torch.dtype | None, name: str) -> torch.Tensor:
    if dtype is None or t.dtype == dtype:
        return t
    cast = t.to(dtype)
    if dtype.is_floating_point and not torch.isfinite(cast).all() and torch.isfinite(t).all():
        worst = t.abs().max().item()
        raise ConversionError(f"{name} has values up to {worst:.3g}, out of range for {dtype_name(dtype)}; "
                              f"export in bfloat16 or float32 instead")
    return cast


def _check_keys(sd: Mapping, rules: list[WeightRule], source: str) -> None:
    want = {r.ours for r in rules}
    missing = sorted(want - set(sd), key=_natural)
    unexpected = sorted(set(sd) - want, key=_natural)
    if missing or unexpected:
        parts = [f"{source} does not match its config"]
        if missing:
            parts.append(f"missing: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
        raise ConversionError("; ".join(parts))


def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in name.split(".")]


# -- Hugging Face -> project ----------------------------------------------------------------------------------------

def config_from_hf(cfg, source: str = "Hugging Face config") -> GPTConfig:
    """The project config computing the same function as a Hugging Face config of one of ``HF_FAMILIES``,
    or a clear refusal."""
    model_type = getattr(cfg, "model_type", None)
    family = HF_FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(f"{f.architecture} (model_type {f.model_type!r})" for f in HF_FAMILIES.values())
        raise ConversionError(
            f"{source}: model_type {model_type!r} "
            f"({', '.join(getattr(cfg, 'architectures', None) or []) or 'no architecture'}) "
            f"is not supported; supported: {supported}")
    archs = getattr(cfg, "architectures", None) or []
    unknown = [a for a in archs if a not in family.accepted]
    if unknown:
        raise ConversionError(f"{source}: architecture {', '.join(unknown)} is not supported; "
                              f"supported for model_type {model_type!r}: {family.architecture}")
    hf_meta = {"architecture": family.architecture, "source": source}
    hf_meta.update({k: getattr(cfg, k, None) for k in _SPECIAL_TOKENS})
    try:
        training = getattr(cfg, TRAINING_KEY, None) or {}
        out = family.read(cfg, source)
        out.update(family.imported(cfg, training) if family.imported else {})
        hf_meta.update(family.recorded(cfg) if family.recorded else {})
        out.update({k: training[k] for k in _TRAINING_FIELDS + _MOE_TRAINING_FIELDS if k in training})
        return GPTConfig(**out, hf_model_type=model_type, extra={"hf": hf_meta})
    except ConfigError as e:
        raise ConversionError(f"{source}: {e}") from None


def hf_family(config: GPTConfig) -> HFFamily:
    """The family ``config`` exports as: the one it was imported from (``hf_model_type``), else the first of
    its variant's families that holds it (so a model trained here with ``qk_norm`` exports as Qwen3)."""
    if config.hf_model_type is not None:
        family = HF_FAMILIES.get(config.hf_model_type)
        if family is None or family.variant != config.variant:
            known = ", ".join(n for n, f in HF_FAMILIES.items() if f.variant == config.variant)
            raise ConversionError(f"hf_model_type {config.hf_model_type!r} is not a Hugging Face family of the "
                                  f"{config.variant} variant; choose one of {known}")
        problem = family.holds(config)
        if problem:
            raise ConversionError(f"the model cannot be exported as {family.architecture} (hf_model_type "
                                  f"{family.model_type!r}), which cannot hold {problem}")
        return family
    for family in HF_FAMILIES.values():
        if family.variant == config.variant and family.holds(config) is None:
            return family
    later = ", ".join(later_generation(config))
    raise ConversionError(f"no Hugging Face family holds this {config.variant} model "
                          f"(qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm}, bias={config.bias}, "
                          f"sliding_window={config.sliding_window}, num_experts={config.num_experts}"
                          f"{', ' + later if later else ''}); no "
                          f"transformers class computes it (docs/huggingface.md lists the families and what they "
                          f"hold)")


def state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], config: GPTConfig, dtype: torch.dtype | None = None,
                       source: str = "Hugging Face state dict", *, lazy: bool = False) -> dict:
    """The project's full state dict from a Hugging Face one (strict: every tensor used, every shape checked).

    ``lazy``: the values are ``PlannedTensor``s, each made (read, joined, cast) only when it is written, so an
    import from a ``SafetensorsFiles`` mapping holds one tensor at a time.
    """
    rules = weight_map(config)
    out, used = {}, set()
    for rule in rules:
        missing = [n for n in rule.theirs if n not in hf_sd]
        if missing:
            raise ConversionError(f"{source}: missing tensor(s) {', '.join(missing)} (for the project's {rule.ours})")
        shapes = [shape_of(hf_sd, n) for n in rule.theirs]
        shapes = [tuple(reversed(sh)) if rule.transpose else sh for sh in shapes]
        full = (sum(sh[0] for sh in shapes), *shapes[0][1:]) if shapes[0] else ()
        if (full != rule.shape or any(sh[1:] != shapes[0][1:] for sh in shapes)
                or (rule.split and [sh[0] for sh in shapes] != list(rule.split))):
            listed = ", ".join(f"{n} {shape_of(hf_sd, n)}" for n in rule.theirs)
            raise ConversionError(f"{source}: {listed} do(es) not fit the config (the project's {rule.ours} "
                                  f"must be {rule.shape})")
        out[rule.ours] = PlannedTensor(rule.shape, dtype or dtype_of(hf_sd, rule.theirs[0]),
                                       _joiner(hf_sd, rule, dtype))
        used.update(rule.theirs)
    weights = VARIANT_WEIGHTS[config.variant]
    if weights.always_biased and not config.bias:
        nonzero = [n for n in weights.always_biased(config) if n in hf_sd and hf_sd[n].any()]
        if nonzero:
            raise ConversionError(f"{source}: the config has no biases but {nonzero[0]} is not zero")
        used.update(weights.always_biased(config))
    tied_head = "lm_head.weight"
    if config.tie_embeddings and tied_head in hf_sd:
        # A tied model's state_dict() lists the shared tensor twice; a different one would be a different model.
        head, emb = hf_sd[tied_head], hf_sd[weights.embedding]
        if head.data_ptr() != emb.data_ptr() and not torch.equal(head, emb):
            raise ConversionError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from the "
                                  f"input embedding")
        del head, emb
        used.add(tied_head)
    used.update(_mtp_copies(hf_sd, config, source))
    unexpected = sorted((k for k in hf_sd if k not in used and not _ignorable(k)), key=_natural)
    if unexpected:
        raise ConversionError(f"{source}: tensor(s) the project's model has no place for: "
                              f"{', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    return out if lazy else {name: planned.make() for name, planned in out.items()}


def _mtp_copies(hf_sd: Mapping, config: GPTConfig, source: str) -> list[str]:
    """The embedding and output layer a DeepSeek-V3 checkpoint repeats in each prediction depth: equal to the
    model's (the project's depths share them), or refused."""
    head = "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
    found = []
    for d in range(config.mtp_num_layers):
        for leaf, main in (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", head)):
            name = f"model.layers.{config.num_layers + d}.{leaf}"
            if name not in hf_sd:
                continue
            if not torch.equal(materialize(hf_sd[name]), materialize(hf_sd[main])):
                raise ConversionError(f"{source}: {name} differs from {main}; the project's multi-token prediction "
                                      f"shares the model's embedding and output layer")
            found.append(name)
    return found


def mtp_depths_found(config: GPTConfig, hf_sd: Mapping) -> GPTConfig:
    """``config`` with the prediction depths whose weights ``hf_sd`` holds: DeepSeek-V3's config names
    ``num_mtp_layers`` whether or not its files hold them (``save_pretrained`` writes none)."""
    depths = 0
    while depths < config.mtp_num_layers and f"model.layers.{config.num_layers + depths}.eh_proj.weight" in hf_sd:
        depths += 1
    return config if depths == config.mtp_num_layers else dataclasses.replace(config, mtp_num_layers=depths)


def _joiner(hf_sd: Mapping, rule: WeightRule, dtype):
    def make() -> torch.Tensor:
        pieces = [materialize(hf_sd[n]) for n in rule.theirs]
        pieces = [p.t() if rule.transpose else p for p in pieces]
        full = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        full = deinterleave_rope_rows(full.contiguous(), *rule.rope) if rule.rope else full
        return _cast(full.detach().contiguous(), dtype, rule.theirs[0])
    return make


def _ignorable(name: str) -> bool:
    # Buffers old checkpoints saved: GPT-2's causal-mask constants, Llama's RoPE frequencies.
    return name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))


# -- loading Hugging Face models from disk -----------------------------------------------------------------------------

@dataclass(frozen=True)
class HFSource:
    """Where a Hugging Face model lives: a directory, and optionally a GGUF file in it."""
    directory: Path
    gguf_file: str | None = None

    def __str__(self):
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


GGUF_MIN_TENSOR_INFO = 24  # name length u64, n_dims u32, type u32, offset u64 (an empty name, no dims)
GGUF_MIN_KV = 13  # key length u64, value type u32, a value of one byte


def check_gguf(path: Path) -> Path:
    """The fixed header of a GGUF file (magic, version, tensor and key counts), refused in one line when cut or
    when its counts cannot fit the file: the gguf reader would raise from deep inside, or loop over 2^40
    entries."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        what = "not a GGUF file (no GGUF magic)" if head[:4] != b"GGUF" else f"cut inside its header ({size} bytes)"
        raise ConversionError(f"{path}: {what}; give a complete .gguf file")
    version, tensors, keys = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise ConversionError(f"{path}: GGUF version {version}, not 2 or 3; give a file of a current llama.cpp")
    if tensors * GGUF_MIN_TENSOR_INFO + keys * GGUF_MIN_KV > size - 24:
        raise ConversionError(f"{path}: its header declares {tensors} tensors and {keys} keys, more than its "
                              f"{size} bytes can hold (damaged or cut); give a complete .gguf file")
    return path


def check_weight_headers(directory: Path) -> None:
    """Every safetensors header of a model directory read and checked (offsets past the end of the file, shapes
    whose bytes overflow): one line naming the file, before a loader that would panic or map garbage."""
    for path in hf_weight_files(directory) or []:
        read_header(path)


def resolve_hf_source(path: str | Path, gguf_file: str | None = None) -> HFSource:
    """A model directory, a ``.gguf`` file, or a directory holding one ``.gguf`` file and no config.json (a GGUF
    file's header checked: ``check_gguf``)."""
    source = _resolve_hf_source(path, gguf_file)
    if source.gguf_file and (source.directory / source.gguf_file).is_file():
        check_gguf(source.directory / source.gguf_file)
    return source


def _resolve_hf_source(path: str | Path, gguf_file: str | None = None) -> HFSource:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Hugging Face model {path} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConversionError(f"{path} is a file but not a .gguf file; give a model directory or a .gguf file")
        return HFSource(path.parent, path.name)
    if gguf_file:
        return HFSource(path, gguf_file)
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return HFSource(path, ggufs[0])
        raise ConversionError(f"{path} has no config.json" + (f" and several .gguf files ({', '.join(ggufs)}): "
                                                               f"name one" if ggufs else ""))
    return HFSource(path)


def load_hf_config(source: HFSource):
    # transformers only where a Hugging Face object is built (see hf_config)
    from transformers import AutoConfig  # noqa: PLC0415
    try:
        return AutoConfig.from_pretrained(str(source.directory), trust_remote_code=False, **source.kwargs())
    except (OSError, ValueError, KeyError) as e:
        raise ConversionError(f"{source}: not a loadable Hugging Face model config: {e}") from None


def load_hf_model(source: HFSource, dtype: torch.dtype = torch.float32):
    """The Hugging Face causal LM at ``source`` (GGUF tensors are dequantised by transformers' loader)."""
    # transformers only where a Hugging Face object is built (see hf_config)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    config_from_hf(load_hf_config(source), str(source))  # refuse before reading gigabytes of weights
    if not source.gguf_file:
        check_weight_headers(source.directory)
    model, info = AutoModelForCausalLM.from_pretrained(str(source.directory), dtype=dtype, trust_remote_code=False,
                                                       output_loading_info=True, **source.kwargs())
    missing = [k for k in info.get("missing_keys", [])
               if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ConversionError(f"{source}: the checkpoint lacks weight(s) {', '.join(sorted(missing)[:8])}; "
                              f"transformers would initialise them randomly")
    return model.eval()


def from_hf(hf_model_or_dir, *, gguf_file: str | None = None, dtype: torch.dtype | str | None = torch.float32,
            source: str | None = None, lazy: bool = False):
    """(GPTConfig, full state dict) of a Hugging Face causal LM of one of ``HF_FAMILIES``.

    ``hf_model_or_dir`` is a loaded model, a model directory, or a ``.gguf`` file. ``dtype`` is the
    dtype of the returned tensors (None keeps a loaded model's; a directory's are read as float32). ``source``
    names the model in messages and in ``config.extra["hf"]["source"]``. A directory of safetensors files is
    read tensor by tensor, without building the Hugging Face model (with ``lazy``, the values are
    ``PlannedTensor``s made one at a time as they are written: an import never holds two copies of the model);
    GGUF files and torch ``.bin`` weights go through transformers' loader.
    """
    dtype = parse_dtype(dtype)
    if isinstance(hf_model_or_dir, (str, Path)):
        resolved = resolve_hf_source(hf_model_or_dir, gguf_file)
        name = source or str(resolved)
        files = None if resolved.gguf_file else hf_weight_files(resolved.directory)
        if files is not None:
            config = config_from_hf(load_hf_config(resolved), name)
            hf_sd = _with_base_prefix(SafetensorsFiles(files), config)
            dtype = dtype or torch.float32
        else:
            model = load_hf_model(resolved, dtype or torch.float32)
            config, hf_sd = config_from_hf(model.config, name), model.state_dict()
    else:
        model = hf_model_or_dir
        name = source or getattr(model.config, "_name_or_path", None) or type(model).__name__
        config, hf_sd = config_from_hf(model.config, name), model.state_dict()
    if config.num_experts and is_fused(hf_sd):  # a loaded transformers 5 MoE
        hf_sd = unfuse_experts(hf_sd, hf_family(config).experts)
    config = mtp_depths_found(config, hf_sd)
    always_biased = VARIANT_WEIGHTS[config.variant].always_biased
    if always_biased and not config.bias and any(hf_sd[n].any() for n in always_biased(config) if n in hf_sd):
        config = dataclasses.replace(config, bias=True)  # exported bias-free, then trained with biases
    return config, state_dict_from_hf(hf_sd, config, dtype, source=name, lazy=lazy)


class _Prefixed(Mapping):
    """A base model's file (``wte.weight``, ``embed_tokens.weight``) seen with the causal LM's names
    (``transformer.wte.weight``, ``model.embed_tokens.weight``), as transformers' loader sees it."""

    def __init__(self, files: SafetensorsFiles, prefix: str):
        self.files, self.prefix = files, prefix
        self.names = {(k if k.startswith("lm_head.") else prefix + k): k for k in files}

    def __getitem__(self, name):
        return self.files[self.names[name]]

    def shape_of(self, name):
        return self.files.shape_of(self.names[name])

    def dtype_of(self, name):
        return self.files.dtype_of(self.names[name])

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def _with_base_prefix(files: SafetensorsFiles, config: GPTConfig) -> Mapping:
    prefix = VARIANT_WEIGHTS[config.variant].prefix
    if any(k.startswith(prefix) for k in files):
        return files
    return _Prefixed(files, prefix)


def num_parameters_message(config: GPTConfig) -> str:
    n = config.num_parameters()
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit} parameters"
    return f"{n} parameters"


def parallel_sizes(config: GPTConfig) -> list[int]:
    """Tensor-parallel sizes that divide the model (every head count and the MLP width)."""
    g = math.gcd(math.gcd(config.num_heads, config.num_kv_heads), config.ffn_hidden_size)
    return [d for d in range(1, g + 1) if g % d == 0]
