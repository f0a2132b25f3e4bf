"""Tracking: metrics.jsonl beside DeepSpeed's monitor, and the plots of a run's curves."""
