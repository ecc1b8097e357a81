"""XQA-style MLA decode in CUDA C++ (csrc/xqa_mla): mma.sync + TMA, for SM120/SM121, also built for sm_90a.

``build.py`` compiles the sources with nvcc into a cached cubin per architecture; ``cuda_driver.py`` loads it
through the CUDA driver API (ctypes, no torch C++ extension); ``launch.py`` holds the registry entry points.
Nothing here imports a GPU toolchain at import time.
"""
