"""Ling-3.0 model: `from reno_jax.models import ling3` (config, params, forward, cache, log-probs)."""

from reno_jax.models import ling3  # noqa: F401
from reno_jax.models.config import Ling3Config  # noqa: F401
