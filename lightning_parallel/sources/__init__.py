"""Where a rank's stages come from: one folder per way of splitting a module, each owning its
``StageSource`` (``stages.py``), its call stand-in (``call.py``), its unit finder and its builder
(``source.py``). The pipeline's runtime (:mod:`lightning_parallel.pipeline`) sees only the protocols."""
