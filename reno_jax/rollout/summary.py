"""A batch of episodes in figures: the rollout's own (rewards, lengths, call validity) and the environment's
(its declared `episode_metrics`), host floats, named like the published AReno run where one exists."""

from __future__ import annotations

import jax
import numpy as np

from reno_jax.envs import interface


def rollout_summary(traj, env: interface.TextEnv, prefix: str = "rollout/") -> dict[str, float]:
    """Per-step figures of a host `Trajectory` (`rollout/rewards_mean`, ..., then `rollout/<env metric>`)."""
    reward = np.asarray(traj.reward, np.float64)
    stats = jax.tree.map(np.asarray, traj.stats)
    policy_tokens = np.asarray(traj.loss_mask).sum(axis=1)  # per row
    prompt_length = np.asarray(traj.prompt_length)
    if getattr(traj, "episode_id", None) is not None:  # turn samples: an episode's policy tokens, its turns' prompts
        episodes = np.asarray(traj.episode_id)
        policy_tokens = np.bincount(episodes, weights=policy_tokens)
        prompt_length = prompt_length[np.asarray(traj.valid).any(axis=1)]
    out = {
        "rewards_mean": float(reward.mean()),
        "rewards_std": float(reward.std()),
        "rewards_min": float(reward.min()),
        "rewards_max": float(reward.max()),
        "accuracy": float((reward > 0).mean()),
        "response_len_mean": float(policy_tokens.mean()),
        "prompt_len_mean": float(prompt_length.mean()),
        "tool_call_valid_rate": float(np.mean(stats.valid_call)),
        "turns_mean": float(np.mean(stats.num_turns)),
    }
    out.update(interface.summarize(env, jax.tree.map(np.asarray, traj.env_info)))
    return {f"{prefix}{k}": v for k, v in out.items()}


def plotted_metrics(env: interface.TextEnv, prefix: str = "rollout/") -> tuple[str, ...]:
    """The environment's figures that ask for a learning-curve panel."""
    return tuple(f"{prefix}{name}" for name, metric in env.episode_metrics().items() if metric.plot)


def suite_figures(traj, num_episodes: int) -> dict[str, float]:
    """An evaluation suite's rollout figures over its `num_episodes` episodes (jitted and host environments alike):
    mean reward, valid calls, cut-off episodes, turns and generated tokens."""
    stats = traj.stats
    return {
        "num_episodes": num_episodes,
        "mean_reward": float(np.mean(traj.reward)),
        "tool_call_valid_rate": float(np.mean(stats.valid_call)),
        "cut_off_rate": float(np.mean(stats.truncated)),
        "mean_turns": float(np.mean(stats.num_turns)),
        "mean_generated_tokens": float(np.mean(stats.generated_tokens)),
    }
