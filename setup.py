"""The compiled parts: the host checksum, block I/O, host copy, victim and replay kernels (kernels/*.c).

Everything else is configured in pyproject.toml. Each extension is optional: where
no C compiler exists the build goes on without them and kvtier computes the same
checksum with numpy (kernels/checksum.py), moves NVMe blocks one Python call
at a time (tiers/io_backends.py), copies with numpy (tiers/hostcopy.py) and
values victims with numpy (predictor/reuse_model.py) and replays the value policy
through its Python hooks (policy/value_compiled.py): the same results, only slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvtier.kernels._checksum", ["kernels/_checksum.c"], depends=["kernels/checksum.h"], optional=True),
    Extension("kvtier.kernels._blockio", ["kernels/_blockio.c"], depends=["kernels/checksum.h"], optional=True),
    Extension("kvtier.kernels._copy", ["kernels/_copy.c"],
              depends=["kernels/copy_pool.h", "kernels/copy_runs.h", "kernels/stream_copy.h"],
              optional=True),
    Extension("kvtier.kernels._value", ["kernels/_value.c"], optional=True),
    Extension("kvtier.kernels._land", ["kernels/_land.c"], depends=["kernels/buffer_args.h"], optional=True),
    Extension("kvtier.kernels._plan", ["kernels/_plan.c"], depends=["kernels/buffer_args.h"], optional=True),
    Extension("kvtier.kernels._replay", ["kernels/_replay.c"],
              depends=["kernels/replay_state.h", "kernels/replay_calibration.h"], optional=True),
])
