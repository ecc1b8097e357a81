"""Import a script of benchmarks/ as a module (it imports its siblings by name: benchmarks/ is its script
directory), for the CPU tests of the benchmark tools."""

from __future__ import annotations

import importlib
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def import_benchmark(name: str):
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
