"""The traced path: any other module has its ``forward`` exported with dynamic sizes (once, for every
rank that traces it: share.py) and cut at its blocks (split.py); source.py is its builder, call_binding.py
its call stand-in, and tensor_parallel.py / fsdp.py what its stage graphs need for the techniques."""
