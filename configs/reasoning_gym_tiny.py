"""Any Reasoning Gym dataset as a host environment (`reno_jax.envs.reasoning_gym_env`): the entry's question, then
`answer(value)` scored by the dataset's own `score_answer` (optionally `calculate(expression)` first).

  python -m experiments.train --config=configs/reasoning_gym_tiny.py --workdir=workdir/legs \
      --config.env.dataset=leg_counting --config.env.dataset_options='{"min_animals": 3}'
  python -m experiments.evaluate --workdir=workdir/legs --suites=heldout

Needs the `tasks` extra (`pip install -e ".[tasks]"`). Not tuned for any dataset: the sizes below hold a question of
up to 256 tokens and an answer call of up to 48 with the shipped tokenizer; the warm start imitates a teacher that
answers the gold answer on `teacher_rate` of the episodes and another entry's answer on the rest.
"""

import ml_collections

from configs import tictactoe_tiny


def get_config() -> ml_collections.ConfigDict:
    c = tictactoe_tiny.get_config()
    c.num_steps = 100
    c.eval_every = 0  # --config.eval_every=10: the held-out suite played greedily (eval/heldout/...)

    # --- task: every option of the environment at its default, so the command line can set each ---------------
    c.env = ml_collections.ConfigDict()
    c.env.name = "reasoning_gym"
    c.env.module = ""
    c.env.dataset = "leg_counting"  # a Reasoning Gym dataset name
    c.env.dataset_options = "{}"  # the dataset's config fields, a JSON object
    c.env.with_calculator = False  # offer calculate(expression) before the answer (then two turns)
    c.env.teacher_rate = 0.5  # warm start: share of the teacher's episodes answered with the gold answer
    c.env.eval_size = 512  # held-out entries (another dataset seed)

    c.sft.num_steps = 100
    c.sft.batch_size = 32

    c.rollout.boards_per_step = 16  # questions per step
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 48  # '<tool_call>{"name": "answer", "arguments": {"value": "..."}}</tool_call>'
    c.rollout.max_turns = 0  # the environment's own: 1, or 2 with the calculator
    c.rollout.max_length = 0  # what the prompt, the turns and the responses below need
    c.rollout.host_max_prompt_tokens = 256
    c.rollout.host_max_response_tokens = 32
    c.rollout.temperature = 0.7
    c.rl.forking_entropy_coef = 0.0  # tic-tac-toe's one-token exploration bonus does not apply here
    c.rl.entropy_top_k = 0
    return c
