"""The compiled balancing kernels (native/balance.c), where they were built.

`NATIVE` is the extension module, or None where it is missing (a source checkout that
has not run `make install` / `setup.py build_ext`): then `_kk`, `_greedy` and `_refine`
run their numpy forms, which give the same bins bit for bit, only slower
(tests/plan/test_balance_native.py checks that both agree).
"""

from __future__ import annotations

from types import ModuleType

NATIVE: ModuleType | None
try:
    from overlord.plan.balance import _native as NATIVE
except ImportError:  # not built: the numpy forms stand in
    NATIVE = None

__all__ = ["NATIVE"]
