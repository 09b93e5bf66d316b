"""Test-session settings: CPU only, and XLA's cheapest backend optimisation level.

Almost all of the suite's time is XLA compilation of small programs; LLVM optimisation level 0 roughly halves it
and only changes float rounding (every numeric tolerance in the suite is far above that). Set before JAX is
imported, so subprocesses started by the CLI tests inherit it too.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_backend_optimization_level=0"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# `configs` and `experiments` are imported from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
