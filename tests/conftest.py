"""Test-session settings: CPU only, XLA's cheapest backend optimisation level, and a compilation cache.

Almost all of the suite's time is XLA compilation of small programs; LLVM optimisation level 0 roughly halves it
and only changes float rounding (every numeric tolerance in the suite is far above that). Many tests build the
same programs again (a second run of the same config, a resumed run, the CLIs in subprocesses), so compiled
executables go to a persistent cache that is new for each test session (nothing carries over between sessions).
Set before JAX is imported, so subprocesses started by the CLI tests inherit it too.
"""

import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_backend_optimization_level=0"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="reno_jax_test_xla_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# `configs` and `experiments` are imported from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
