"""One optimizer step's gradients: synchronised once per step (sync.py), held aside across Lightning's
zero_grad, reduced over replicas, clipped across stages; tied weights' replicas, fp16 loss scaling,
token-exact (item-weighted) losses."""
