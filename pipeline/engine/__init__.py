"""DeepSpeed wiring: process groups, DeepSpeed config checks, the engine (plain or pipelined), optimizer steps,
learning-rate schedules.
"""
