"""Text classification on top of the project's language models (the third paper: multilabel emotion
finetuning on SemEval-2018 E-c with per-class tuned thresholds).

Modules, each importable on its own (data, normalize, metrics, thresholds and predictions without torch):
  data         - SemEval-2018 E-c, SST-2 and any CSV/TSV/JSON(L) labelled file -> ``LabeledTexts``
  normalize    - tweet normalisation (URLs, @user mentions, HTML entities, whitespace); emoji kept
  metrics      - micro/macro-F1, official Jaccard accuracy, per-class scores, eval.json, per-class chart
  thresholds   - per-class decision thresholds tuned for F1, stored as JSON beside a model
  predictions  - prediction files in the official E-c format (what the official scorer reads)
  heads        - pooling + classifier head over hidden states [b, s, h] (or pooled [b, h]); losses
  model        - ``Classifier`` = encoder (the project GPT, any variant and TP size; or the mLSTM's final cell
                 state) + head; aux LM loss, frozen encoder, layer-wise LR groups; ``load_base_state`` reads any
                 base model directory
  batching     - texts -> token ids -> right-padded batches (training: shuffled, DP-sharded; prediction: by length)
  saved        - the classifier directory (classifier.json, model.safetensors, thresholds, tokenizer);
                 ``load_classifier(dir).predict(texts)``
  export_hf    - the classifier as transformers' GPT2/LlamaForSequenceClassification (``python -m finetune.export_hf``)

Commands: ``finetune/train.py`` (the DeepSpeed finetuning job), ``python -m finetune.predict`` (E-c predictions
with the tuned thresholds). Notebooks: ``finetune/notebooks/``.
"""
