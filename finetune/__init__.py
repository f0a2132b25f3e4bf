"""Text classification on top of the project's language models (the third paper: multilabel emotion
finetuning on SemEval-2018 E-c with per-class tuned thresholds).

Modules, each importable on its own (only ``heads`` needs torch):
  data         - SemEval-2018 E-c, SST-2 and any CSV/TSV/JSON(L) labelled file -> ``LabeledTexts``
  normalize    - tweet normalisation (URLs, @user mentions, HTML entities, whitespace); emoji kept
  metrics      - micro/macro-F1, official Jaccard accuracy, per-class scores, eval.json, per-class chart
  thresholds   - per-class decision thresholds tuned for F1, stored as JSON beside a model
  predictions  - prediction files in the official E-c format (what the official scorer reads)
  heads        - pooling + classifier head over hidden states [b, s, h] (or pooled [b, h]); losses
"""
