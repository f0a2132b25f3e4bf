"""The job layer: user errors and the one handler, atomic files, the model-family registry, the shared arguments, setup
and the training loop.
"""
