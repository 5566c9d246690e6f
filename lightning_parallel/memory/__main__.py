"""``python -m lightning_parallel.memory``: the planner's command line under its former name."""

import runpy

runpy.run_module("lightning_parallel.planner", run_name="__main__", alter_sys=True)
