"""Where a rank's stages come from: one folder per way of splitting a module (sequential/, traced/), each
owning its ``StageSource`` (the stages built per shape), its call stand-in, its unit finder and its
builder (``source.py``); beside them, the machinery both use to split (meta twins, exports, fake
tensors, stage shapes, materialisation). The pipeline's runtime sees only the protocols."""
