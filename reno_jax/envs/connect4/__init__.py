"""Connect Four through a `drop_piece` tool call, written against `reno_jax.envs.interface.TextEnv` only: rules,
scripted opponents (random, greedy, depth-limited negamax), wording and the env."""
