"""reno_jax: agentic RL post-training (rollout + GSPO) for Ling-3.0 in JAX."""

__version__ = "0.1.0"
