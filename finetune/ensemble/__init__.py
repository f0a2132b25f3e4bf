"""An ensemble of classifiers: the mean of its members' probabilities, decided by thresholds of its own.

Members are finetuned classifiers (``finetune/train.py --save``) and the TF-IDF model
(``finetune.ensemble.tfidf``), all holding out the same tweets of the same training file, so that the
ensemble's thresholds are tuned on probabilities none of its members trained on (never on dev).
``python -m finetune.ensemble`` trains or gathers the members and writes the directory; ``finetune.predict
--model DIR`` serves it as it serves one classifier.

Layout of an ensemble directory::

    ensemble.json       members (paths relative to this directory when inside it), label names, held-out
                        split, how the thresholds were tuned; written last (a directory without it is incomplete)
    thresholds.json     per-class thresholds of the averaged probabilities
    members/            the members trained or fitted by ``python -m finetune.ensemble`` (others stay where
                        they are and are named by path)
    eval.json, dev_predictions.txt, per_class_f1.png

    from finetune.ensemble.predictor import load_predictor
    ens = load_predictor("runs/ec-ensemble")      # an ensemble, a classifier or a TF-IDF model alike
    probs = ens.predict_proba(["so happy today!"])
"""
