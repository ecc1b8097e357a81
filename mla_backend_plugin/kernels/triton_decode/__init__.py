"""Triton split-KV MLA decode (see kernel.py). Imports Triton lazily through ops/registry.py."""
