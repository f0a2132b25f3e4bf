"""The documented finetuning recipes, as ``finetune/train.py`` flags (on top of ``--base``, ``--train``, ``--dev``),
so that the README, the notebooks and ``bench/emotion_finetune.py`` run the same thing.

``EC_RECIPE``, SemEval-2018 E-c (chosen on honest dev scores: thresholds tuned on a held-out tenth of train,
never on dev; bench/README.md has the search): every layer of the base trained; last-token pooling and a
linear head, which ``LlamaForSequenceClassification`` / ``GPT2ForSequenceClassification`` hold, so the
classifier exports to ``transformers``; square-root positive weights for the rare emotions; warmup then
linear decay; per-class thresholds (``--threshold-objective macro``: each emotion's threshold maximises its own
F1, which maximises macro-F1; the micro-F1 refinement buys a little micro-F1 with the rare classes' recall).

``LINEAR_PROBE``: the cheap reference (the encoder frozen, mean-pooled features of its first 16 layers
computed once, a linear head trained on them).
"""
EC_RECIPE = ["--pooling", "last", "--epochs", "3", "--lr", "5e-5", "--warmup", "0.1", "--lr-decay-style", "linear",
             "--global-batch-size", "16", "--max-length", "64", "--pos-weight", "sqrt",
             "--threshold-objective", "macro", "--holdout", "0.1"]

LINEAR_PROBE = ["--freeze-encoder", "--encoder-layers", "16", "--pooling", "mean", "--epochs", "20", "--lr", "2e-3",
                "--global-batch-size", "32", "--max-length", "64", "--threshold-objective", "micro",
                "--holdout", "0.1"]
