"""The game-free base of every config: each field at the library's default (`reno_jax.run_config`, where each is
documented and checked), and a neutral environment section (no `env.name`: a config built on this one names its
environment and that environment's fields).

  c = base.get_config()
  c.env = ml_collections.ConfigDict(dict(name="guess_number", module=""))
"""

import ml_collections

from reno_jax import run_config


def get_config() -> ml_collections.ConfigDict:
    return run_config.default_config_dict()
