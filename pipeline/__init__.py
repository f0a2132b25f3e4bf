"""Data flow, DeepSpeed engine wiring, pretraining, checkpoints, export and evaluation."""
import os

# CPU runs: torch puts its large allocations on 2 MB transparent huge pages instead of faulting in 4 KB pages
# after every free (measured on the E-c finetune, 2 cores: 178k -> 16k page faults/s, 3.7 -> 2.2 s per step).
# torch reads the variable at its first CPU allocation, so importing this package first is enough; it does
# nothing on GPU tensors, and a user's own setting (THP_MEM_ALLOC_ENABLE=0) wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
