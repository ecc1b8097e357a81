"""Packaging lives in setup.cfg; this file only adds the CUDA C++ sources to built packages.

csrc/xqa_mla is compiled with nvcc on the user's machine at first use (kernels/xqa_sm120/build.py), so a wheel must
carry it: build_py copies it to mla_backend_plugin/kernels/xqa_sm120/csrc, where build.py looks first. Editable
installs read the repository's csrc/ directly.
"""

import os
import shutil

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


setup(cmdclass={"build_py": BuildPyWithCudaSources})
