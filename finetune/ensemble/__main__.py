"""``python -m finetune.ensemble``: the command is ``finetune.ensemble.build``."""
from finetune.ensemble.build import main

main()
