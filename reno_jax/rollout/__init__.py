"""Generation and multi-turn agent rollouts for any `TextEnv`, jitted end to end.

sampling.py  temperature / top-k / top-p / greedy sampling with the behaviour log-prob (fp32)
generate.py  chunked prefill, decode step, fixed-length `generate` (the stop matcher is `protocol.stop`'s)
rollout.py   `RolloutConfig`, `compile_env` -> `CompiledEnv`, `rollout` -> `Trajectory`
"""
