"""Text classification on top of the project's language models (the third paper: multilabel emotion
finetuning on SemEval-2018 E-c with per-class tuned thresholds).

Commands: ``finetune/train.py`` (the DeepSpeed finetuning job; ``python -m finetune.train``, ``mds-finetune``),
``python -m finetune.predict`` (E-c predictions with the tuned thresholds), ``python -m finetune.export_hf`` (the
classifier as a ``transformers`` model). Notebooks: ``finetune/notebooks/``.

Library, each module importable on its own (data, normalize, scoring without torch):
  data         - SemEval-2018 E-c, SST-2 and any CSV/TSV/JSON(L) labelled file -> ``LabeledTexts``; texts to predict
  normalize    - tweet normalisation (URLs, @user mentions, HTML entities, whitespace); emoji kept
  batching     - texts -> token ids -> right-padded batches (training: shuffled, DP-sharded; prediction: by length)
  heads        - pooling + classifier head over hidden states [b, s, h] (or pooled [b, h]); losses
  model        - ``Classifier`` = encoder (the project GPT, any variant and TP size; or the mLSTM's final cell
                 state) + head; aux LM loss, frozen encoder, layer-wise LR groups; ``load_base_state`` reads any
                 base model directory
  saved        - the classifier directory (classifier.json, model.safetensors, thresholds, tokenizer);
                 ``load_classifier(dir).predict(texts)``
  hf_export    - the classifier as transformers' GPT2/LlamaForSequenceClassification
  recipes      - the E-c recipe (the arguments docs/emotions.md's result comes from)
  scoring/     - metrics (micro/macro-F1, official Jaccard, per-class chart), per-class thresholds, E-c prediction files
  job/         - the finetuning job's arguments, inputs, providers, loop hooks and final scoring
"""

import pipeline  # noqa: F401  (first: its quiet loggers before torch and transformers load)
