"""Collectives and cross-rank failure handling shared by the strategy and the callbacks."""
