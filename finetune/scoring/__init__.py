"""Scoring a classifier: multilabel and single-label metrics, per-class thresholds, prediction files in the official
E-c format.
"""
