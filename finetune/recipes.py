"""The documented finetuning recipes, as ``finetune/train.py`` flags (on top of ``--base``, ``--train``, ``--dev``),
so that the README, the notebooks and ``bench/emotion_finetune.py`` run the same thing.

``EC_RECIPE``, SemEval-2018 E-c (chosen on honest dev scores: thresholds tuned on a held-out tenth of train,
never on dev; bench/README.md has the search): every layer of the base trained; last-token pooling and a
linear head, which ``LlamaForSequenceClassification`` / ``GPT2ForSequenceClassification`` hold, so the
classifier exports to ``transformers``; square-root positive weights for the rare emotions; warmup then
linear decay; per-class thresholds tuned for the mean of micro-F1 and macro-F1 (``--threshold-objective
balanced``: per-class F1 alone gives the best macro-F1 and the micro-F1 refinement the best micro-F1 and
Jaccard, each at a clear cost in the other average; measured on held-out train and dev in bench/README.md).

``LINEAR_PROBE``: the cheap reference (the encoder frozen, mean-pooled features of its first 16 layers
computed once, a linear head trained on them).
"""
EC_RECIPE = ["--pooling", "last", "--epochs", "2", "--lr", "5e-5", "--warmup", "0.1", "--lr-decay-style", "linear",
             "--global-batch-size", "16", "--max-length", "64", "--pos-weight", "sqrt",
             "--threshold-objective", "balanced", "--holdout", "0.1"]

LINEAR_PROBE = ["--freeze-encoder", "--encoder-layers", "16", "--pooling", "mean", "--epochs", "20", "--lr", "2e-3",
                "--global-batch-size", "32", "--max-length", "64", "--threshold-objective", "micro",
                "--holdout", "0.1"]
