"""The finetuning job's providers, as Megatron's ``pretrain(...)`` takes them: the base encoder (family,
config, weights, tokenizer), the splits as token ids, the head, and the DeepSpeed engine with its schedule.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from peft import LoraConfig

from finetune.batching import auto_micro_batch, encode_texts, label_prompt
from finetune.heads import MULTILABEL, HeadConfig
from finetune.job.args import FinetuneError
from finetune.job.inputs import (
    check_encoder_options,
    first_layers,
    holdout_split,
    label_subset,
    load_split,
    parse_pos_weight,
)
from finetune.lm.job.options import lora_from_args, lora_settings
from finetune.model import build_classifier
from finetune.normalize import TweetNormalizer
from finetune.saved import load_base_state
from models import GPTConfig
from models.lora import LoRAConfig, add_lora
from pipeline.data import load_tokenizer
from pipeline.hf.peft_adapter import LoRATarget, lora_targets, project_targets
from pipeline.engine.build import build_engine
from pipeline.engine.ds_config import precision, resolve_ds_config, zero_stage
from pipeline.engine.schedules import LRSchedule
from pipeline.job.families import ModelFamily, family_of
from pipeline.job.files import contents_digest
from pipeline.job.loop import Job, is_rank0
from pipeline.planning.memory import activations, model_states

# ------------------------------------------------------------------------------------------ providers

@dataclass
class Base:
    """The base model provider's result: the encoder's family, config and full weights, and its tokenizer."""
    family: ModelFamily
    config: object
    state: dict
    tokenizer: object
    max_length: int
    pad_id: int
    lora: LoraConfig | None = None            # --lora: adapters on the encoder's linears, the base frozen
    lora_targets: list[LoRATarget] | None = None


def provide_base(args) -> Base:
    """Inputs are read and checked before any process group exists: a bad file fails at once, on every rank."""
    config, base_state, tokenizer_dir = load_base_state(args.base)
    family = family_of(config)
    check_encoder_options(args, family)
    tokenizer = provide_tokenizer(args, config, tokenizer_dir)
    if args.encoder_dropout is not None:
        for name in ("hidden_dropout", "attention_dropout", "dropout"):  # the GPT's two, the mLSTM's one
            if hasattr(config, name):
                setattr(config, name, args.encoder_dropout)
    if args.encoder_layers is not None:
        config, base_state = first_layers(config, base_state, args.encoder_layers, args.base)
    family.check_layout(config, args.tensor_parallel, 1)
    lora, targets = provide_lora(args, config, family)
    max_length = min(args.max_length, getattr(config, "max_sequence_length", args.max_length))
    pad_id = tokenizer.backend.token_to_id(tokenizer.pad_token) if tokenizer.pad_token else None
    pad_id = tokenizer.eod_id if pad_id is None or pad_id >= config.vocab_size else pad_id
    return Base(family, config, base_state, tokenizer, max_length, pad_id, lora, targets)


def provide_tokenizer(args, config, tokenizer_dir):
    """The base's tokenizer, or --tokenizer: any whose ids fit the model's embedding (rows left over are unused,
    said in one line)."""
    if args.tokenizer is None and tokenizer_dir is None:
        raise FinetuneError(f"{args.base} holds no tokenizer (no tokenizer.json beside its config.json); pass "
                            f"--tokenizer DIR, the tokenizer it was trained with ({config.vocab_size} tokens at most)")
    try:
        tokenizer = load_tokenizer(args.tokenizer or str(tokenizer_dir))
    except ValueError as e:
        raise FinetuneError(f"tokenizer: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise FinetuneError(f"--tokenizer {args.tokenizer or tokenizer_dir}: {tokenizer.vocab_size} tokens, but the "
                            f"model in {args.base} has {config.vocab_size} embedding rows: it is not this model's "
                            f"tokenizer; pass the one it was trained with ({config.vocab_size} tokens at most)")
    if args.tokenizer is not None and tokenizer.vocab_size < config.vocab_size and is_rank0():
        print(f"note: --tokenizer {args.tokenizer} has {tokenizer.vocab_size} tokens for the {config.vocab_size} "
              f"embedding rows of {args.base}: rows {tokenizer.vocab_size}-{config.vocab_size - 1} are unused",
              flush=True)
    return tokenizer


def provide_lora(args, config, family: ModelFamily) -> tuple[LoraConfig | None, list[LoRATarget] | None]:
    """--lora's PEFT config and the encoder's linears it adapts (a name that matches none is refused)."""
    lora = lora_from_args(args, str(args.base))
    if lora is None:
        return None, None
    if not isinstance(config, GPTConfig):
        raise FinetuneError(f"--lora: {args.base} is an {family.name}; LoRA adapts the GPT's linears")
    return lora, lora_targets(config, lora, "--lora-target-modules")


@dataclass
class Splits:
    """The data provider's result: the splits, and their texts as token ids."""
    train: object
    dev: object
    tune_on: object  # where the thresholds are tuned: dev, or a held-out part of train
    test: object | None
    encoded: dict
    truncated: int
    normalizer: TweetNormalizer | None
    label_prompt: tuple[list[int], list[int]] = ([], [])  # pooling "labels": its token ids, label positions

    @property
    def multilabel(self) -> bool:
        return self.train.task == MULTILABEL


def provide_data(args, base: Base) -> Splits:
    subset = label_subset(args.labels)
    train, dev = load_split(args.train, args), load_split(args.dev, args)
    test = load_split(args.test, args, require_labels=False) if args.test else None
    if subset is not None:
        try:
            train, dev = train.select_labels(subset), dev.select_labels(subset)
            test = test.select_labels(subset) if test is not None and test.labels is not None else test
        except ValueError as e:
            raise FinetuneError(f"--labels: {e}") from None
    for name, split in (("dev", dev), ("test", test)):
        if split is not None and split.labels is not None and split.label_names != train.label_names:
            raise FinetuneError(f"{name} labels {list(split.label_names)} differ from train labels "
                                f"{list(train.label_names)} (choose a common subset with --labels)")
    normalizer = None if args.no_normalize else TweetNormalizer(lowercase=args.lowercase)
    norm = (lambda texts: [normalizer(t) for t in texts]) if normalizer else list
    tune_on = dev
    if args.holdout:
        keep, held = holdout_split(len(train), args.holdout, args.holdout_seed)
        train, tune_on = train.subset(keep), train.subset(held)
    prompt = label_prompt(base.tokenizer, train.label_names) if args.pooling == "labels" else ([], [])
    if len(prompt[0]) and base.max_length + len(prompt[0]) > getattr(base.config, "max_sequence_length", 1 << 30):
        raise FinetuneError(f"--max-length {base.max_length} and the label prompt's {len(prompt[0])} tokens exceed "
                            f"the model's {base.config.max_sequence_length} positions; use a smaller --max-length")
    encoded = {name: encode_texts(base.tokenizer, norm(split.texts), base.max_length, prompt[0])
               for name, split in (("train", train), ("dev", dev), ("tune", tune_on), ("test", test))
               if split is not None}
    truncated = sum(len(ids) - len(prompt[0]) == base.max_length for ids in encoded["train"])
    return Splits(train, dev, tune_on, test, encoded, truncated, normalizer, prompt)


@dataclass
class Head:
    config: HeadConfig
    pos_weight: torch.Tensor | None
    priors: np.ndarray


def provide_head(args, base: Base, data: Splits) -> Head:
    config = base.config
    # auto: a bias where the export can take it into the final norm's bias (an RMSNorm has none)
    head_bias = {"yes": True, "no": False, "auto": getattr(config, "norm_has_bias", True)}[args.head_bias]
    pooling = args.pooling or base.family.get("encoder").default_pooling
    try:
        head_config = HeadConfig(config.hidden_size, data.train.num_labels, pooling=pooling,
                                 mlp_hidden=args.mlp_hidden, dropout=args.dropout, problem_type=data.train.task,
                                 label_names=data.train.label_names, output_bias=head_bias,
                                 label_prompt=data.label_prompt[0], label_positions=data.label_prompt[1])
    except ValueError as e:
        raise FinetuneError(str(e)) from None
    if args.pos_weight != "none" and not data.multilabel:
        raise FinetuneError("--pos-weight is for multilabel data")
    if args.label_correlation and not data.multilabel:
        raise FinetuneError("--label-correlation is for multilabel data")
    pos_weight = parse_pos_weight(args.pos_weight, data.train.labels, args.pos_weight_max) if data.multilabel else None
    return Head(head_config, pos_weight, data.train.labels.mean(axis=0))


def free_memory_bytes(device: torch.device) -> float:
    """What the device can still give: CUDA's free memory, or the host's MemAvailable (Linux)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def fit_ds_config(args, base: Base, data: Splits, job: Job, device: torch.device) -> Job:
    """The DeepSpeed config fitted to the data and the layout, where the user left them to the job.

    Without ``--micro-batch-size`` the micro-batch is chosen from the data, not taken from the config: the
    largest that divides a rank's share of the global batch and whose activations at the longest training text
    (Korthikanti's count, ``pipeline.planning``) fit in half the memory left after the model states. Texts of a
    few dozen tokens make that the whole share: one micro-batch, no accumulation. Without ``--deepspeed_config``
    a single data-parallel rank runs ZeRO stage 0: there is nothing to partition, and stage 1's flat buffers
    and bucketed gradient copies cost a one-rank CPU step about half its time (bench/finetune_speed.py)."""
    state, ds = job.state, job.ds
    if args.deepspeed_config is None and state.data_parallel == 1 and zero_stage(ds) in (1, 2):
        ds = {**ds, "zero_optimization": {**ds["zero_optimization"], "stage": 0}}
    micro = args.micro_batch_size
    if micro is None:
        longest = max(len(ids) for ids in data.encoded["train"])
        shape = base.family.shape(base.config, "encoder", seq=longest)
        prec = precision(ds)
        sp = job.layout.sequence_parallel
        per_sequence = activations(shape, 1, state.tensor_parallel, 1, sp, "none", 1, prec)
        states = model_states(shape.params / state.tensor_parallel, zero_stage(ds), state.data_parallel, prec)
        sharing = 1 if device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # CPU ranks share RAM
        budget = (free_memory_bytes(device) / sharing - states.total) / 2
        micro = auto_micro_batch(job.global_batch // state.data_parallel, per_sequence, budget)
    ds = resolve_ds_config(ds, data_parallel=state.data_parallel, micro_batch_size=micro,
                           global_batch_size=job.global_batch, source=job.ds_source)
    return dataclasses.replace(job, ds=ds)


def provide_engine(args, base: Base, data: Splits, head: Head, job: Job):
    """(engine, LR schedule, steps per epoch, total steps)."""
    def builder(cfg, init_seed):
        return build_classifier(cfg, head.config, encoder_state=base.state, init_seed=init_seed,
                                aux_lm_weight=args.aux_lm_weight, pos_weight=head.pos_weight,
                                label_correlation=args.label_correlation,
                                freeze_encoder=args.freeze_encoder, freeze_embeddings=args.freeze_embeddings,
                                label_priors=head.priors, source=str(args.base))

    def builder_with_lora(cfg, init_seed):
        model = builder(cfg, init_seed)
        add_lora(model.encoder, project_targets(base.lora_targets),  # freezes the encoder, not the head
                 LoRAConfig(base.lora.r, base.lora.lora_alpha, base.lora.lora_dropout),
                 seed=args.seed)  # the adapters' A from --seed: the same at every layout
        return model

    def groups(model):
        return model.param_groups(weight_decay=args.weight_decay, layer_lr_decay=args.layer_lr_decay,
                                  head_lr_mult=args.head_lr_mult)

    steps_per_epoch = len(data.train) // job.global_batch
    if steps_per_epoch < 1:
        raise FinetuneError(f"{len(data.train)} training examples are fewer than one global batch "
                            f"({job.global_batch}); use a smaller --global-batch-size")
    total_steps = args.train_steps or max(1, math.ceil(args.epochs * steps_per_epoch))
    schedule = LRSchedule(args.lr, int(args.warmup * total_steps), total_steps, args.lr_decay_style, args.min_lr)
    engine = build_engine(base.config, job.ds, job.state, init_seed=args.seed, schedule=schedule,
                          model_builder=builder if base.lora is None else builder_with_lora, param_groups_fn=groups)
    base.state = None  # the engine holds the weights now
    return engine, schedule, steps_per_epoch, total_steps


def run_settings(args, base: Base, data: Splits, head: Head, job: Job, steps: tuple[int, int], cached: bool) -> dict:
    steps_per_epoch, total_steps = steps
    return {"base": str(args.base), "train": data.train.source, "dev": data.dev.source,
            "train_contents": contents_digest(data.train.source), "dev_contents": contents_digest(data.dev.source),
            "labels": list(data.train.label_names),
            "examples": {"train": len(data.train), "dev": len(data.dev), "threshold_tuning": len(data.tune_on)},
            "thresholds_tuned_on": "holdout" if args.holdout else "dev",
            "threshold_objective": args.threshold_objective, "threshold_bagging": args.threshold_bagging,
            "max_length": base.max_length,
            "truncated_train_texts": data.truncated, "global_batch": job.global_batch, "micro_batch": job.micro_batch,
            "micro_batch_from": "--micro-batch-size" if args.micro_batch_size else "the data (auto)",
            "zero_stage": zero_stage(job.ds),
            "group_by_length": args.group_by_length,
            "steps": total_steps, "steps_per_epoch": steps_per_epoch, "lr": args.lr,
            "layer_lr_decay": args.layer_lr_decay, "head_lr_mult": args.head_lr_mult,
            "pos_weight": None if head.pos_weight is None else head.pos_weight.tolist(),
            "aux_lm_weight": args.aux_lm_weight, "label_correlation": args.label_correlation,
            "freeze_encoder": args.freeze_encoder, "freeze_embeddings": args.freeze_embeddings,
            "features_computed_once": cached,
            "encoder": base.family.name, "encoder_layers": base.config.num_layers, "pooling": head.config.pooling,
            "mlp_hidden": list(args.mlp_hidden),
            "precision": precision(job.ds), "tensor_parallel": job.state.tensor_parallel,
            "sequence_parallel": job.layout.sequence_parallel,
            "data_parallel": job.state.data_parallel, "seed": args.seed,
            "holdout": args.holdout, "holdout_seed": args.holdout_seed,
            "lora": lora_settings(base.lora, base.lora_targets)}
