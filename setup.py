"""The one compiled part: the host checksum kernel (kernels/_checksum.c).

Everything else is configured in pyproject.toml. The extension is optional: where
no C compiler exists the build goes on without it and kvtier computes the same
checksum with numpy (kernels/checksum.py), only slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.kernels._checksum", ["kernels/_checksum.c"], optional=True)])
