"""Packaging lives in setup.cfg; this file adds the CUDA C++ sources to built packages and tags a wheel that
carries prebuilt kernels for its platform.

csrc/xqa_mla is compiled with nvcc on the user's machine at first use (kernels/xqa_sm120/build.py), so a wheel must
carry it: build_py copies it to mla_backend_plugin/kernels/xqa_sm120/csrc, where build.py looks first. Editable
installs read the repository's csrc/ directly.
"""

import os
import shutil

import setuptools
from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithCudaSources(build_py):
    def run(self):
        super().run()
        src = os.path.join(HERE, "csrc", "xqa_mla")
        dst = os.path.join(self.build_lib, "mla_backend_plugin", "kernels", "xqa_sm120", "csrc")
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)


PREBUILT = os.path.join(HERE, "mla_backend_plugin", "kernels", "prebuilt")


def has_prebuilt_kernels() -> bool:
    return os.path.isdir(PREBUILT) and any(os.scandir(PREBUILT))


cmdclass = {"build_py": BuildPyWithCudaSources}
try:  # setuptools >= 70.1 has its own
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # no wheel builder here (an sdist or editable install needs none)
        bdist_wheel = None

if bdist_wheel is not None:

    class BdistWheelTagged(bdist_wheel):
        """A wheel carrying the CuTe-DSL kernels exported by `compile --into-package` holds x86-64 shared
        libraries: it is tagged for the platform (py3-none-<platform>), a source-only one stays py3-none-any."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            return ("py3", "none", plat) if has_prebuilt_kernels() else (python, abi, plat)

    cmdclass["bdist_wheel"] = BdistWheelTagged


class Distribution(setuptools.Distribution):
    def has_ext_modules(self):  # binaries inside: a platlib wheel, files at its root
        return has_prebuilt_kernels()


setup(cmdclass=cmdclass, distclass=Distribution)
