"""A finetuned classifier as transformers' ``GPT2ForSequenceClassification`` /
``LlamaForSequenceClassification`` (and the Qwen2/Qwen3/Mistral ones), with the same probabilities: the library
of ``python -m finetune.export_hf``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune.scoring.thresholds import load_thresholds
from pipeline.checkpoints.model_dir import copy_tokenizer_files
from pipeline.hf.convert import ConversionError, hf_family, parse_dtype, to_hf, weight_map
from pipeline.hf.safetensors_io import write_hf_weights
from pipeline.job.errors import UserError
from pipeline.job.families import family_named
from pipeline.job.files import atomic_dir, refuse_overlap

from .heads import MULTILABEL
from .saved import load_classifier, read_classifier_dir

HF_PROBLEM_TYPE = {MULTILABEL: "multi_label_classification", "single_label": "single_label_classification"}
# post-processors that add tokens around a text (training encoded texts without any)
_ADDING_POST_PROCESSORS = {"TemplateProcessing", "BertProcessing", "RobertaProcessing"}
FINAL_NORM_BIAS = "final_norm.norm.bias"  # the project's name; the classifier's output bias is folded into it


class ExportError(UserError, ValueError):
    """A classifier that a ``transformers`` sequence-classification model cannot compute exactly."""


def check_exportable(info: dict) -> None:
    head = info["head_config"]
    problems = []
    family = family_named(info["encoder_type"], "classifier.json")
    if not family.hf_sequence_classification:
        problems.append(f"the encoder is {family.name!r}, a model family without a transformers "
                        f"sequence-classification class")
    if head.pooling != "last":
        problems.append(f"pooling is {head.pooling!r}, but transformers' *ForSequenceClassification pools the last "
                        f"token (train with --pooling last)")
    if family.hf_sequence_classification:
        try:
            hf_family(info["encoder_config"])
        except ConversionError as e:  # e.g. a GPT-2 encoder with MoE layers: no transformers class holds it
            problems.append(str(e))
    if head.mlp_hidden:
        problems.append(f"the head has an MLP ({list(head.mlp_hidden)}), but transformers' classifier is one linear "
                        f"layer (train without --mlp-hidden)")
    if problems:
        raise ExportError("cannot export to Hugging Face: " + "; ".join(problems))


def _hf_name(config, ours: str) -> str:
    """The Hugging Face name of the project's tensor ``ours`` (one tensor), from the export's weight table."""
    return next(rule.theirs[0] for rule in weight_map(config) if rule.ours == ours)


def classifier_to_hf(info: dict, full: dict[str, torch.Tensor], dtype: torch.dtype | None = None):
    """(transformers config, state dict) of the saved classifier ``(info, full)``."""
    check_exportable(info)
    head, config = info["head_config"], info["encoder_config"]
    encoder = {k.removeprefix("encoder."): v.float() for k, v in full.items() if k.startswith("encoder.")}
    cfg, sd = to_hf(encoder, config)
    sd.pop("lm_head.weight", None)  # the classifier has a score layer instead of an LM head
    weight = full["head.output.weight"].double()  # [k, h]
    bias = full.get("head.output.bias")
    if bias is not None and bool(bias.abs().max() > 0):
        if not config.norm_has_bias:
            raise ExportError(f"cannot export to Hugging Face: {hf_family(config).classifier}'s score layer has no "
                              f"bias and RMSNorm none to take it into; train the {config.variant} classifier with "
                              f"--head-bias no")
        final_norm_bias = _hf_name(config, FINAL_NORM_BIAS)
        ln_bias = sd[final_norm_bias].double()
        shift = torch.linalg.lstsq(weight, bias.double().unsqueeze(1)).solution.squeeze(1)  # W shift = bias
        error = (weight @ shift - bias.double()).abs().max().item()
        if error > 1e-6 * max(1.0, bias.abs().max().item()):
            raise ExportError(f"cannot take the output bias into the final LayerNorm (its weight rows are dependent; "
                              f"residual {error:.2e})")
        sd[final_norm_bias] = (ln_bias + shift).float()
    sd["score.weight"] = weight.float()
    names = info["label_names"]
    cfg.architectures = [hf_family(config).classifier]
    cfg.num_labels = len(names)
    cfg.id2label = {i: name for i, name in enumerate(names)}
    cfg.label2id = {name: i for i, name in enumerate(names)}
    cfg.problem_type = HF_PROBLEM_TYPE[head.problem_type]
    cfg.pad_token_id = int(info["pad_id"])
    cfg.max_text_tokens = int(info["max_length"])
    cfg.tweet_normalizer = None if info["normalizer"] is None else info["normalizer"].to_dict()
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
        cfg.dtype = dtype
    else:
        cfg.dtype = torch.float32
    return cfg, sd


def export_classifier(model_dir: str | Path, out: str | Path, *, dtype: torch.dtype | str | None = None,
                      force: bool = False) -> Path:
    """Write the Hugging Face classifier of a classifier directory to ``out`` (atomically)."""
    model_dir = Path(model_dir)
    refuse_overlap(out, [("--model", model_dir)])
    info, full = read_classifier_dir(model_dir)
    cfg, sd = classifier_to_hf(info, full, parse_dtype(dtype))
    if info.get("thresholds_file"):
        cfg.thresholds = [float(t) for t in load_thresholds(model_dir / info["thresholds_file"], info["label_names"])]
    with atomic_dir(out, force=force) as tmp:
        copy_tokenizer_files(model_dir / "tokenizer", tmp)
        _training_tokenization(tmp, info)
        cfg.save_pretrained(tmp)
        write_hf_weights(tmp, sd)
    return Path(out)


VERIFY_TEXTS = ["I am so happy today!", "This is terrible, I'm furious #angry", "not sure what to expect tomorrow",
                "Thank you @user for the lovely flowers http://t.co/x"]


def export_command(args) -> int:
    """``mds-export-classifier``: export ``--model`` into ``--out``; with ``--verify``, reload it with transformers
    and print how far its probabilities are from the project classifier's."""
    out = export_classifier(args.model, args.out, dtype=args.dtype, force=args.force)
    print(f"exported {args.model} to {out}")
    if args.verify:
        result = compare_with_project(args.model, out, VERIFY_TEXTS)
        print(f"max |p_hf - p_project| = {result['max_abs_diff']:.2e}; same tokens: {result['tokens_equal']}")
    return 0


def _training_tokenization(directory: Path, info: dict) -> None:
    """Make the exported tokenizer encode as training did: no added special tokens, right padding with the
    training pad id, cut at the training length."""
    tok_file = directory / "tokenizer.json"
    tok = json.loads(tok_file.read_text(encoding="utf-8"))
    post = tok.get("post_processor") or {}
    kinds = {post.get("type")} | {p.get("type") for p in post.get("processors", [])}
    if kinds & _ADDING_POST_PROCESSORS:
        tok["post_processor"] = None
        tok_file.write_text(json.dumps(tok, ensure_ascii=False, indent=2), encoding="utf-8")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    pad_token = _token_of(tok, int(info["pad_id"]))
    config.update(pad_token=pad_token, padding_side="right", truncation_side="right",
                  model_max_length=int(info["max_length"]), add_bos_token=False, add_eos_token=False)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_of(tokenizer_json: dict, token_id: int) -> str:
    for added in tokenizer_json.get("added_tokens", []):
        if added["id"] == token_id:
            return added["content"]
    for token, i in (tokenizer_json.get("model", {}).get("vocab") or {}).items():
        if i == token_id:
            return token
    raise ExportError(f"the training pad id {token_id} is not in the tokenizer's vocabulary")


@torch.no_grad()
def compare_with_project(model_dir: str | Path, hf_dir: str | Path, texts: list[str]) -> dict:
    """Probabilities of the exported model (transformers, fp32, one padded batch) against the project
    classifier's on ``texts``: ``{"max_abs_diff", "tokens_equal"}``."""

    ours = load_classifier(model_dir)
    normalizer = ours.info["normalizer"]
    normalized = [normalizer(t) for t in texts] if normalizer else list(texts)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    batch = tok(normalized, padding=True, truncation=True, return_tensors="pt")
    hf = AutoModelForSequenceClassification.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    logits = hf(**batch).logits.float()
    probs = torch.sigmoid(logits) if hf.config.problem_type == HF_PROBLEM_TYPE[MULTILABEL] else logits.softmax(-1)
    reference = ours.predict_proba(texts)
    hf_ids = [ids[:int(m.sum())] for ids, m in zip(batch["input_ids"].tolist(), batch["attention_mask"])]
    return {"max_abs_diff": float(np.abs(probs.numpy() - reference).max()),
            "tokens_equal": hf_ids == ours.encode(texts)}
