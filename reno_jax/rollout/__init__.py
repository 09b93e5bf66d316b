"""Generation and multi-turn agent rollouts, jitted end to end.

sampling.py  temperature / top-k / top-p / greedy sampling with the behaviour log-prob (fp32)
generate.py  chunked prefill, decode step, fixed-length `generate`, stop detection tables
rollout.py   `RolloutConfig`, `EpisodeStarts`, `make_env`, `rollout` -> `Trajectory` (move and game tasks)
"""
