"""The finetuning job's parts: its arguments, inputs read and checked, providers (base model, splits, head, engine),
the loop's step and hooks, and the end (thresholds, scores, predictions, the saved classifier).
"""
