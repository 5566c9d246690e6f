"""The planner's former name, kept so ``python -m lightning_parallel.memory`` (the command the docs of
earlier releases give) still runs :mod:`lightning_parallel.planner`'s command line: for instance
``python -m lightning_parallel.memory experiments/models.py:CharLM --devices 4 --memory 2GiB``.
"""
