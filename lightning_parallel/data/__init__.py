"""Distributed samplers: evaluation without padding, resumable training."""
