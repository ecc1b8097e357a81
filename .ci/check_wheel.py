"""CI: the release wheel carries every CuTe-DSL serving variant of the archs it was packaged for (PDL on),
each entry complete (library + meta.json) and matching the sources it was built from, and no eval data (the eval
model under evals/model/ and any .safetensors weights stay in the source tree: setup.cfg).

    python .ci/check_wheel.py dist/mla_backend_plugin-*.whl sm_90a sm_100f
"""

from __future__ import annotations

import json
import sys
import zipfile

from mla_backend_plugin.kernels.cute_common.aot import SHARED_RUNTIME
from mla_backend_plugin.ops.registry import KERNELS

PREFIX = "mla_backend_plugin/kernels/prebuilt/"
EVAL_MODEL = "mla_backend_plugin/evals/model/"


def eval_data(names) -> list[str]:
    """The wheel entries that are eval data: anything under the eval model's directory, or weights anywhere."""
    return sorted(n for n in names if n.startswith(EVAL_MODEL) or n.endswith(".safetensors"))


def main(wheel: str, archs: list[str]) -> int:
    from mla_backend_plugin.kernels.cute_sm90 import build as sm90_build
    from mla_backend_plugin.kernels.cute_sm90.launch import AOT as SM90_AOT
    from mla_backend_plugin.kernels.cute_sm100 import build as sm100_build
    from mla_backend_plugin.kernels.cute_sm100.launch import AOT as SM100_AOT

    families = {"cute_sm90": (sm90_build, SM90_AOT), "cute_sm100": (sm100_build, SM100_AOT)}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metas = {n[len(PREFIX):].split("/")[0]: json.loads(z.read(n)) for n in names
                 if n.startswith(PREFIX) and n.endswith("/meta.json")}
    problems, found = [], 0
    evals = eval_data(names)
    if evals:
        problems.append(f"eval data in a serving wheel ({len(evals)} file(s): {', '.join(evals[:4])}); "
                        "setup.cfg keeps evals/model/ out")
    for arch in archs:
        for family, (build, aot) in families.items():
            if arch not in KERNELS[family].archs:
                continue
            for variant, pdl in [(v, True) for v in build.builds()]:
                key = aot.cache_key(variant, pdl, arch)
                meta = metas.get(key)
                label = f"{family} {arch}: {variant.name} pdl={'on' if pdl else 'off'}"
                if meta is None or f"{PREFIX}{key}/{aot.library_name}" not in names:
                    problems.append(f"{label} missing ({key})")
                elif meta.get("source_sha256") != aot.source_hash() or meta.get("runtime") != SHARED_RUNTIME:
                    problems.append(f"{label}: entry does not match these sources")
                else:
                    found += 1
    size = sum(i.file_size for i in zipfile.ZipFile(wheel).infolist() if i.filename.startswith(PREFIX))
    print(f"{wheel}: {found} packaged variants for {', '.join(archs)} ({size / 2**20:.1f} MiB unpacked); "
          f"{len(evals)} eval data file(s); {len(problems)} problem(s)")
    for p in problems[:20]:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
