"""A stand-in libcuda.so.1 for CPU-only machines, so vLLM's CUDA extensions can be imported there.

vLLM's CUDA platform module imports extensions linked against the driver library; without a driver they
fail to load and the CUDA platform (and with it every MLA backend) cannot even be imported. The stub exports
the driver entry points those extensions link to, each returning CUDA_ERROR_NO_DEVICE (100), so torch still
reports no GPU and nothing can run on one by accident. It is used only when no real driver is present.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

DRIVER_SYMBOLS = ["cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuGetProcAddress", "cuGetProcAddress_v2",
                  "cuGetErrorString", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGetAttribute",
                  "cuDevicePrimaryCtxRetain", "cuPointerGetAttribute", "cuMemAddressFree", "cuMemAddressReserve",
                  "cuMemCreate", "cuMemGetAllocationGranularity", "cuMemMap", "cuMemRelease", "cuMemSetAccess",
                  "cuMemUnmap", "cuTensorMapEncodeTiled"]
CUDA_ERROR_NO_DEVICE = 100


def real_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def build_stub(out_dir: str) -> str:
    """Compile the stub into out_dir/libcuda.so.1 and return out_dir."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("a C compiler (cc or gcc) is needed to build the CUDA driver stub")
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(out_dir, "cuda_stub.c")
    with open(src, "w") as f:
        f.writelines(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in DRIVER_SYMBOLS)
    subprocess.run([cc, "-shared", "-fPIC", "-o", os.path.join(out_dir, "libcuda.so.1"),
                    "-Wl,-soname,libcuda.so.1", src], check=True)
    return out_dir


def env_with_driver(base_env: dict | None = None) -> dict:
    """Environment for a subprocess that imports vLLM's CUDA platform: the stub on CPU-only machines."""
    env = dict(os.environ if base_env is None else base_env)
    if not real_driver_present():
        stub_dir = build_stub(tempfile.mkdtemp(prefix="cuda_stub_"))
        env["LD_LIBRARY_PATH"] = stub_dir + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    return env
