"""The compiled parts: the host checksum and host copy kernels (kernels/*.c).

Everything else is configured in pyproject.toml. The extension is optional: where
no C compiler exists the build goes on without them and kvtier computes the same
checksum with numpy (kernels/checksum.py) and copies with numpy (tiers/hostcopy.py),
only slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvtier.kernels._checksum", ["kernels/_checksum.c"], optional=True),
    Extension("kvtier.kernels._copy", ["kernels/_copy.c"], optional=True),
])
