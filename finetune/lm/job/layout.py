"""The layout rule of the language-model finetuning commands, one of the project's layout rules
(``pipeline.job.layout``): ``setup`` runs it with the others when the command passes ``extras={POST_TRAINING:
"SFT"}`` (or "DPO"); it refuses nothing of the other commands.

SFT's packed rows attend within their conversations through ``models.documents``, which needs the whole
sequence and the whole model on each rank; DPO's forward is the model's own, tested at TP only. Both run at
TP x DP with ZeRO 0-2 today.
"""
from __future__ import annotations

from pipeline.job.layout import LayoutCheck, rule

POST_TRAINING = "post_training"  # the extras key: what the command trains ("SFT", "DPO")


@rule
def post_training_layout(c: LayoutCheck) -> str | None:
    what = c.extras.get(POST_TRAINING)
    if what is None:
        return None
    L = c.layout
    for refused, flag in ((L.sequence_parallel, "--sequence-parallel"), (L.context > 1, "--context-parallel"),
                          (L.pipeline > 1, "--pipeline-parallel"), (L.tiled_mlp > 1, "--tiled-mlp"),
                          (L.tiled_loss > 1, "--tiled-loss"), (L.zero_stage == 3, "ZeRO stage 3"),
                          (L.expert > 1, "--expert-parallel")):
        if refused:
            return (f"{what} with {flag}: the {what} forward runs at tensor and data parallelism with ZeRO 0-2 "
                    f"only today; drop {flag}")
    return None
