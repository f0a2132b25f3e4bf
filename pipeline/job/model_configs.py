"""Model configs as a user names them: a JSON file or a preset of ``models/configs/``, resolved to the family's
config class, its vocabulary following the tokenizer."""
from __future__ import annotations

import argparse
from pathlib import Path

from models import ConfigError
from models.gpt import RECOMPUTE_MODULES
from models.parallel.layout import FP8_RECIPES
from pipeline.job.errors import UserError
from pipeline.job.families import family_named, family_of_dict
from pipeline.job.files import read_json_object
from pipeline.job.numbers import positive_int

PRESETS = Path(__file__).resolve().parents[2] / "models" / "configs"
_EMBEDDING_ROWS = "_vocab_size_of_the_weights"  # a raw config's mark: read from the --load directory


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def read_model_config(spec: str) -> dict:
    path = Path(spec)
    if not path.is_file() and (PRESETS / f"{spec}.json").is_file():
        path = PRESETS / f"{spec}.json"
    if not path.is_file():
        raise ConfigError(f"model config {spec!r} is neither a file nor a preset ({', '.join(presets())})")
    return {"_source": str(path), **read_json_object(path, "--model-config")}


def choose_model_config(spec: str | None, model_type: str | None, load_dir: Path | None):
    """(raw config, family) of ``--model-config`` (default: the loaded run's config, else the family's preset),
    checked against ``--model-type``."""
    if load_dir is not None and not (load_dir / "config.json").is_file():
        if not load_dir.exists():
            raise UserError(f"--load {load_dir}: no such directory; give the --save directory of an earlier run")
        raise UserError(f"--load {load_dir}: not a run directory (no config.json, latest or global_step*/ in it); "
                        f"give the --save directory of an earlier run, or a model directory (config.json + "
                        f"model.safetensors, e.g. from pipeline.import_hf)")
    weights_config = spec is None and load_dir is not None
    if spec is None:
        spec = (str(load_dir / "config.json") if load_dir is not None
                else family_named(model_type or "gpt").default_preset)
    raw = read_model_config(spec)
    if weights_config:  # the loaded weights' embedding fixes vocab_size: a tokenizer whose ids fit it will do
        raw[_EMBEDDING_ROWS] = True
    family = family_of_dict(raw, raw["_source"])
    if model_type is not None and model_type != family.name:
        raise UserError(f"--model-type {model_type} but {raw['_source']} is a {family.name} config; "
                        f"drop --model-type or choose another config")
    return raw, family


def make_model_config(raw: dict, vocab_size: int, seq_length: int | None):
    """The family's config class (by the config's model_type), its vocabulary following the tokenizer."""
    raw = dict(raw)
    source = raw.pop("_source", "model config")
    fixed_rows = raw.pop(_EMBEDDING_ROWS, False) and raw.get("vocab_size", 0) >= vocab_size
    family = family_of_dict(raw, source)
    if fixed_rows:  # the loaded model's embedding (tokenizer_for_bare_model said which rows go unused)
        vocab_size = raw["vocab_size"]
    if raw.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(f"{source}: vocab_size {raw['vocab_size']} differs from the tokenizer's {vocab_size}; "
                          f"drop vocab_size from the config (it follows the tokenizer) or use the matching tokenizer")
    raw["vocab_size"] = vocab_size
    if seq_length is not None:
        raw["seq_length"] = seq_length
    return family.config_class.from_dict(raw, source=source)


def preview_model_config(raw: dict, seq_length: int | None):
    """The model config as far as it is known before the tokenizer is (its own vocabulary, or the class
    default): what the layout rules read (heads, sequence, layers, experts) before any work starts."""
    source = raw.get("_source", "model config")
    raw = {k: v for k, v in raw.items() if k not in ("_source", _EMBEDDING_ROWS)}
    family = family_of_dict(raw, source)
    if seq_length is not None:
        raw["seq_length"] = seq_length
    return family.config_class.from_dict(raw, source=source)


def recompute_modules_arg(text: str) -> tuple[str, ...]:
    """argparse type of ``--recompute-modules``: a comma list of ``RECOMPUTE_MODULES``, each once (returned in
    that order)."""
    names = tuple(n.strip() for n in text.split(","))
    bad = [n for n in names if n not in RECOMPUTE_MODULES]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'repeated'}"
                                         f" module; give a comma list of {', '.join(RECOMPUTE_MODULES)}")
    if {"mlp", "mlp_act"} <= set(names):
        raise argparse.ArgumentTypeError(f"{text!r}: mlp recomputes the whole MLP, mlp_act included; name one of them")
    return tuple(n for n in RECOMPUTE_MODULES if n in names)


def check_recompute_args(args):
    """``args`` with ``recompute_modules`` resolved (default core_attn); ``--recompute-modules`` is refused without
    ``--recompute selective``, the only policy it shapes."""
    if args.recompute_modules is not None and args.recompute != "selective":
        raise UserError(f"--recompute-modules: applies to --recompute selective, not {args.recompute}; "
                        f"add --recompute selective or drop --recompute-modules")
    args.recompute_modules = args.recompute_modules or ("core_attn",)
    return args


def add_model_args(p) -> None:
    """The model arguments of the pretraining job (its "model" group)."""
    g = p.add_argument_group("model")
    g.add_argument("--model-type", choices=["gpt", "mlstm"], default=None,
                   help="gpt (default) or mlstm (the character-level multiplicative LSTM, trained by truncated "
                        "BPTT on contiguous byte streams; default: the model config's model_type)")
    g.add_argument("--model-config", default=None,
                   help=f"a JSON file, or a preset name from models/{PRESETS.name}/ ({', '.join(presets())}); default: "
                        f"the checkpoint's config with --load, else gpt2-tiny")
    g.add_argument("--seq-length", type=int, help="training sequence length (default: the config's seq_length)")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation: selective recomputes each layer's --recompute-modules, full every "
                        "layer (docs/performance.md has the measured memory)")
    g.add_argument("--recompute-modules", type=recompute_modules_arg, default=None,
                   help=f"what --recompute selective recomputes, a comma list of {', '.join(RECOMPUTE_MODULES)} "
                        f"(Megatron-Core's names; mlp_act: the dense MLP's GELU / SwiGLU; mlp: the whole dense MLP; "
                        f"moe_act: the experts' activation; layernorm: both norms, LayerNorm or RMSNorm; default "
                        f"core_attn)")
    g.add_argument("--activation-checkpointing", dest="recompute", action="store_const", const="full",
                   help="the same as --recompute full")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (models/compile.py: no graph break at TP 1-2, with "
                        "or without SP, without dropout); pipeline-parallel 1, ZeRO 0-2, dense models; "
                        "bench/train_step.py --systems deepspeed,deepspeed+compile measures what it gains")
    g.add_argument("--fp8", choices=FP8_RECIPES, default=None,
                   help="the column- and row-parallel linears' products in FP8 with torchao's float8 recipe "
                        "(models/parallel/fp8.py): the weights, checkpoints and exports stay in the run's precision, "
                        "so an FP8 run resumes without it and back; dense GPT models (docs/performance.md)")
    g.add_argument("--loss-chunk-tokens", type=positive_int, default=None, metavar="N",
                   help="the cross-entropy N tokens at a time: its fp32 work tensors are [N, V/TP], never [tokens, "
                        "V/TP], and a bf16 run keeps its bf16 logits for the backward instead of an fp32 softmax "
                        "(half the loss's memory); the same loss bit for bit, slower on a CPU (bench/chunked_loss.py)")
