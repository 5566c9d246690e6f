"""The pipeline timeline: per-rank spans of every stage call, P2P and collective, and their report."""
