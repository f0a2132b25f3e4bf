"""Evaluation: WikiText perplexity, LAMBADA, bits per character (lm_scoring), lm-evaluation-harness, the mLSTM
sentiment neuron.
"""
