"""The documented finetuning recipes, as ``finetune/train.py`` flags (on top of ``--base``, ``--train``, ``--dev``),
so that docs/emotions.md, the notebooks and ``bench/emotion_finetune.py`` run the same thing.

``EC_RECIPE``, SemEval-2018 E-c (chosen on honest dev scores: thresholds tuned on a held-out tenth of train,
never on dev; bench/README.md has the search): every layer of the base trained; last-token pooling and a
linear head, which ``LlamaForSequenceClassification`` / ``GPT2ForSequenceClassification`` hold, so the
classifier exports to ``transformers``; square-root positive weights for the rare emotions; 2 epochs on the
schedule of a 3-epoch run (warmup 115 steps, then linear decay that would reach 0 after 3 epochs, stopped at
1.85e-5 after 2: the third epoch overfits, and decaying to 0 within 2 epochs scored lower); per-class
thresholds refined for the mean of micro-F1, macro-F1 and Jaccard (``--threshold-objective mean``: per-class F1
alone gives the best macro-F1 and the micro-F1 refinement the best micro-F1 and Jaccard, each at a clear cost
in the other numbers; the mean serves the three E-c reports), averaged over 100 bootstrap resamples of the
684 held-out tweets (``--threshold-bagging``: a rare class has 30-40 positives there, and its best threshold
jumps with which of them are drawn; bagging gave +0.007 on each average).

``EC_LABEL_RECIPE``, the best-scoring one: ``EC_RECIPE`` with the 11 emotion names after every tweet, each
emotion read from the hidden state at its own name (which has seen the whole tweet), and SpanEmo's
label-correlation loss at SpanEmo's weight 0.2 (Alhuzali and Ananiadou 2021): +0.019 micro-F1, +0.025 macro-F1,
+0.020 Jaccard on dev over ``EC_RECIPE`` in the same code (bench/README.md). ``transformers``'
``*ForSequenceClassification`` cannot hold such a head (it pools the last token into one linear layer), so this
classifier is served by ``finetune.predict`` and is not exported.

``EC_ENSEMBLE``, past SpanEmo on dev (``python -m finetune.ensemble``): two ``EC_LABEL_RECIPE`` classifiers (seeds
1234 and 7), one ``EC_RECIPE`` classifier and the TF-IDF model, all holding out the same tenth of train, their
probabilities averaged and the thresholds tuned on that tenth (bench/README.md has the combinations tried).

``LINEAR_PROBE``: the cheap reference (the encoder frozen, mean-pooled features of its first 16 layers
computed once, a linear head trained on them).
"""
EC_RECIPE = ["--pooling", "last", "--epochs", "2", "--lr", "5e-5", "--warmup", "0.15", "--lr-decay-style", "linear",
             "--min-lr", "1.85e-5", "--global-batch-size", "16", "--max-length", "64", "--pos-weight", "sqrt",
             "--threshold-objective", "mean", "--threshold-bagging", "100", "--holdout", "0.1",
             "--group-by-length", "50"]
EC_LABEL_RECIPE = [*EC_RECIPE[2:], "--pooling", "labels", "--label-correlation", "0.2"]

LINEAR_PROBE = ["--freeze-encoder", "--encoder-layers", "16", "--pooling", "mean", "--epochs", "20", "--lr", "2e-3",
                "--global-batch-size", "32", "--max-length", "64", "--threshold-objective", "micro",
                "--holdout", "0.1"]

# the held-out split of train an ensemble tunes its thresholds on, when its members do not say (the recipes' own)
DEFAULT_HOLDOUT, DEFAULT_HOLDOUT_SEED = 0.1, 1234
RECIPES = {"last": EC_RECIPE, "labels": EC_LABEL_RECIPE}  # the names python -m finetune.ensemble --recipe takes
EC_ENSEMBLE = ["--recipe", "labels:1234", "--recipe", "labels:7", "--recipe", "last:1234", "--tfidf"]
