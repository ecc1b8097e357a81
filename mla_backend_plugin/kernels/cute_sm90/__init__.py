"""CuTe-DSL MLA decode for Hopper (sm_90a): kernel.py (device code), launch.py (host side), config.py."""
