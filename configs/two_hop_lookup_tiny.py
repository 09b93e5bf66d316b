"""Two-hop lookup over invented knowledge bases (`reno_jax.envs.two_hop_lookup`): "In which country was the
employer of Alda Voren founded?" needs `lookup("Alda Voren: works_for")`, then a lookup of the organisation it
names, then `answer(value)`.

  python -m experiments.train --config=configs/two_hop_lookup_tiny.py --workdir=workdir/two_hop
  python -m experiments.train --config=configs/two_hop_lookup_tiny.py --workdir=workdir/two_hop_random \
      --config.env.random_tool=True                      # the control: lookups answer at random, their rate must fall
  python -m experiments.evaluate --workdir=workdir/two_hop --num_episodes=512

Every question is asked in a small world of its own (`env.fresh_worlds`), so the policy must copy names from the
question and the responses (a single fixed world is learnt by heart: docs/benchmarks.md, "The two-hop task"); the
held-out suite's worlds come from seeds no training question uses. Each lookup costs `env.lookup_cost` of reward,
which is what makes looking up worth less than answering at once when the tool answers at random (the control).
The warm start imitates a teacher that always makes the first lookup and makes the second one on half of the
questions (guessing an invented name of the right kind on the rest). The run trains its own tokenizer on the task's
text (`model.tokenizer="env"`). The lengths below are the shipped tokenizer's (the prompt at most 114 tokens, 67
fixed; a teacher's call at most 48; a lookup's fact at most 39), bounds for the run's own.
"""

import ml_collections

from configs import tictactoe_tiny


def get_config() -> ml_collections.ConfigDict:
    c = tictactoe_tiny.get_config()
    c.num_steps = 120  # GSPO steps

    # --- task: every option of the environment at its default, so the command line can set each ---------------
    c.env = ml_collections.ConfigDict()
    c.env.name = "two_hop_lookup"
    c.env.module = "reno_jax.envs.two_hop_lookup"
    c.env.fresh_worlds = True  # a world per question; False: one fixed world (names learnt by heart)
    c.env.world_seed = 0  # the stream of worlds (or the fixed world)
    c.env.heldout_fraction = 0.2  # fixed world: of each kind's entities, those whose questions are held out
    c.env.lookup_cost = 0.05  # reward per lookup
    c.env.teacher_second_lookup_rate = 0.5  # warm start: share of the teacher's episodes with the second lookup
    c.env.random_tool = False  # True: the control (lookups answer a random entity of the right kind)

    # --- supervised warm start on the teacher's conversations: the calculator task's recipe (the peak rate held
    # until the copying of names has arrived, then a decay that makes it exact; the run's own tokenizer for shorter
    # conversations)
    c.model.tokenizer = "env"
    c.sft.num_steps = 2500
    c.sft.batch_size = 32
    c.sft.decay_steps = 800  # the peak held, then the cosine to a tenth over the last 800 steps

    # --- rollout ----------------------------------------------------------------------------------------------
    c.rollout.boards_per_step = 16  # questions per step
    c.rollout.group_size = 8
    # A call is at most 48 tokens ('<tool_call>{"name": "lookup", "arguments": {"query": "..."}}' with a query of
    # up to ~30 tokens); the turn ends at '</tool_call>'.
    c.rollout.max_new_tokens = 52
    c.rollout.max_turns = 3  # lookup, lookup, answer
    # Prompt (<= 114) + three turns (156) + two tool turns (10 fixed + a response of up to 55 tokens each): a longer
    # response (an error listing an entity's relations) ends the episode as truncated.
    c.rollout.max_length = 400
    c.rl.length_bucket = 32  # train steps at the batch's used width, a few compiled widths
    c.rl.share_prompt_prefix = False  # as the calculator's: questions of many lengths recompiled the shared cut
    # The calculator task's gentler RL: no entropy bonus on the most uncertain token (a name being copied).
    c.rl.learning_rate = 1e-3
    c.rl.end_learning_rate = 1e-4
    c.rl.forking_entropy_coef = 0.0
    return c
