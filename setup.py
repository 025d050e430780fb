"""Build the native extensions (the shm ring, the balancing kernels); all other metadata
lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "overlord.shm._ring",
            sources=["native/ring.c", "native/ringhandle.c", "native/ringmodule.c"],
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra"],
        ),
        # -ffp-contract=off: no fused multiply-add, so the kernels round exactly as the
        # numpy forms they stand in for (same inputs, same plan, with or without them).
        Extension(
            "overlord.plan.balance._native",
            sources=["native/balance.c", "native/balance_assign.c", "native/plan_check.c", "native/balancemodule.c"],
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-ffp-contract=off"],
        ),
    ]
)
