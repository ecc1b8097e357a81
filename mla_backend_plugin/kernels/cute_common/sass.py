"""Reading a cubin's SASS and resource usage without a GPU, for the CuTe families' ahead-of-time builds.

Host side, no DSL import. Two tools, found where the Python environment already has them:

* ``cuobjdump --dump-resource-usage`` for registers, stack and local memory: Triton bundles one (CUDA 12.8 in
  Triton 3.6, 13.1 in 3.7); it reads the usage of sm_90a, sm_100a and sm_103a cubins alike.
* ``nvdisasm -c`` for the SASS text. Not every copy decodes every arch: CUDA 12.8 decodes sm_100a but not
  sm_103a ("Cannot decode architecture 'SM103'"). So every candidate is tried in order until one decodes the
  cubin: the ``nvidia-cuda-nvdisasm`` wheel (CUDA 13; nvidia-cutlass-dsl 4.6 requires it, 4.8 makes it the
  ``[sass]`` extra), Triton's bundled nvdisasm, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``, then ``PATH``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess


def _triton_tool(name: str) -> str | None:
    try:
        import triton.backends.nvidia as nvidia_backend
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", name)
    return path if os.path.exists(path) else None


def find_cuobjdump() -> str:
    found = _triton_tool("cuobjdump") or shutil.which("cuobjdump")
    if found is None:
        raise RuntimeError("cuobjdump not found (Triton's bundled one or the CUDA toolkit's)")
    return found


def nvdisasm_candidates() -> list[str]:
    """Every nvdisasm this environment has, in the order they are tried."""
    out = []
    try:
        dist = importlib.metadata.distribution("nvidia-cuda-nvdisasm")
        for f in dist.files or ():
            if str(f).endswith("bin/nvdisasm"):
                out.append(str(dist.locate_file(f)))
    except importlib.metadata.PackageNotFoundError:
        pass
    out.append(_triton_tool("nvdisasm"))
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            out.append(os.path.join(root, "bin", "nvdisasm"))
    out.append(shutil.which("nvdisasm"))
    seen: list[str] = []
    for p in out:
        if p and os.path.isfile(p) and os.access(p, os.X_OK) and p not in seen:
            seen.append(p)
    return seen


def disassemble(cubin_path: str) -> tuple[str, str]:
    """(SASS text, the nvdisasm that decoded it); raises with every candidate's complaint when none can."""
    tried = []
    for tool in nvdisasm_candidates():
        proc = subprocess.run([tool, "-c", cubin_path], capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout, tool
        tried.append(f"{tool}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:] or ['no output']}")
    raise RuntimeError("no nvdisasm here decodes this cubin (pip install nvidia-cuda-nvdisasm, CUDA 13); tried "
                       + ("; ".join(tried) or "none found"))


def resource_usage(cubin_path: str) -> dict:
    """Registers, stack, local and static shared bytes of the cubin's kernel (the largest, if several)."""
    text = subprocess.run([find_cuobjdump(), "--dump-resource-usage", cubin_path], capture_output=True,
                          text=True).stdout
    best: dict = {}
    for line in text.splitlines():
        if "REG:" not in line:
            continue
        usage = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", line)}
        if usage.get("reg", 0) >= best.get("reg", -1):
            best = usage
    return dict(registers=best.get("reg"), stack=best.get("stack"), local=best.get("local"),
                shared_static=best.get("shared"))


def count(sass: str, pattern: str) -> int:
    """Instructions whose opcode matches ``pattern`` (a regex anchored at the opcode)."""
    return len(re.findall(rf"(?m)^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?{pattern}", sass))


def first_line(sass: str, pattern: str) -> int | None:
    """Index of the first SASS line whose opcode matches ``pattern`` (program order), or None."""
    rx = re.compile(rf"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?{pattern}")
    for i, line in enumerate(sass.splitlines()):
        if rx.match(line):
            return i
    return None


def write_cubin(compiled, directory: str) -> str:
    """The cubin of a CuTe-DSL function compiled with ``--keep-cubin`` (``compiled.__cubin__``), written to
    ``directory/kernel.cubin`` for the SASS tools above; its path."""
    cubin = getattr(compiled, "__cubin__", None)
    if not isinstance(cubin, (bytes, bytearray)) or not cubin:
        raise RuntimeError("the DSL returned no cubin (--keep-cubin)")
    path = os.path.join(directory, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    return path
