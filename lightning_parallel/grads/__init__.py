"""A stage's gradients and optimizer state: held aside, reduced over replicas, clipped across stages;
tied weights' replicas, ZeRO-1, fp16 loss scaling, token-exact (item-weighted) losses."""
