"""Checkpoints: DeepSpeed tags saved and verified, safe loading, full state dicts, model directories, universal
checkpoints and resharding.
"""
