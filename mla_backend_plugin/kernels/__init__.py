"""Decode kernel families, one folder each. Which one runs on which GPU is decided in ops/registry.py only."""
