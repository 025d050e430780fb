"""Build the native ring extension; all other metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "overlord.shm._ring",
            sources=["native/ring.c", "native/ringmodule.c"],
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra"],
        )
    ]
)
