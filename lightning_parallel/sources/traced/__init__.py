"""The traced path: any other module has its ``forward`` exported with dynamic sizes (once, for every
rank that traces it: share.py) and cut at its blocks (split.py); source.py is its builder, call_binding.py
its call stand-in; what its stage graphs need for the techniques is theirs
(techniques/tensor_parallel/traced.py, techniques/fsdp/traced.py)."""
