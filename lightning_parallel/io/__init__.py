"""Atomic, durable checkpoint files and the background writer."""
