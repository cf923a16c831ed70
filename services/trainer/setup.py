"""The trainer's one compiled file; everything else is in pyproject.toml.

csrc/split_adamw.c is the split master layout's one-pass AdamW: plain C with no Python API,
loaded with ctypes (rollstream.trainer.split_kernel), so one build serves every Python
version. It is optional: where no C compiler is found the package installs without it and
the optimizer runs the same arithmetic as torch operations, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rollstream.trainer._split_adamw",
            sources=["src/rollstream/trainer/csrc/split_adamw.c"],
            # No contraction of a * b + c into one rounding beyond the file's own fmaf calls:
            # the results must be torch's bits (see the file).
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            libraries=["m"],
            py_limited_api=True,
            optional=True,
        )
    ]
)
