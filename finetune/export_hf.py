"""Export a finetuned classifier as Hugging Face ``*ForSequenceClassification`` (GPT-2, Llama, Qwen2, Qwen3, Mistral).

    python -m finetune.export_hf --model runs/ec --out runs/ec/hf [--dtype float32] [--force] [--verify]

    from transformers import pipeline
    clf = pipeline("text-classification", model="runs/ec/hf", top_k=None)   # sigmoid scores per label
    clf("so happy today @user http")                                        # texts normalised as in training

The export computes the project classifier's probabilities (``--verify`` measures it). What the
``transformers`` classes can hold, and so what is exported:
  * last-token pooling and a linear head: ``*ForSequenceClassification`` pools the last non-pad token and
    has a single bias-free ``score`` layer; other poolings and MLP heads are refused, naming the setting;
  * the head's output bias: GPT-2 takes it into the final LayerNorm's bias (b' = b + W^+ bias: the hidden
    state only feeds ``score`` there, so ``score`` sees W b' = W b + bias exactly); Llama's RMSNorm has no
    bias, so a llama classifier must have been trained without one (``--head-bias no``, the default for llama).
The config carries ``problem_type``, ``id2label``/``label2id``, ``pad_token_id`` (the padding id used in
training), the tuned per-class ``thresholds`` (a list in label order), ``max_text_tokens`` and the
``tweet_normalizer`` settings (apply ``finetune.normalize.TweetNormalizer(**config.tweet_normalizer)`` to
texts first, as training did). The tokenizer adds no special tokens and pads on the right, as in training.
"""
from __future__ import annotations

from pipeline.job.arguments import add_dtype_arg
from pipeline.job.errors import ArgumentParser, job_command


def parse_args(argv=None):
    p = ArgumentParser(prog="mds-export-classifier", description=__doc__)
    p.add_argument("--model", required=True, help="classifier directory (what finetune/train.py --save wrote)")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    add_dtype_arg(p, help="dtype of the exported weights")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--verify", action="store_true", help="reload with transformers and compare probabilities")
    return p.parse_args(argv)


def _job():
    from finetune.hf_export import export_command  # noqa: PLC0415  (deferred: --help must not load torch)
    return export_command


main, cli = job_command(parse_args, _job, __name__)  # cli: the console script (pyproject.toml)
