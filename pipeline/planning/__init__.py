"""The layout planner's library: model sizes (``shapes``), memory by ZeRO stage and recomputation policy
(``memory``), the collectives of a step (``comm``), server profiles as data (``hardware``, ``hardware.json``),
the step-time model and the search (``layouts``), the command's work (``planner``) and the check against the
published scaling of Megatron-LM and the mLSTM paper (``validation``). docs/performance.md explains the model."""
