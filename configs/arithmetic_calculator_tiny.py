"""Arithmetic with a calculator (`reno_jax.envs.arithmetic_calculator`): Reasoning Gym's basic_arithmetic on 4-6 digit
operands, `calculate(expression)` then `answer(value)`, scored by the dataset's own `score_answer`.

  python -m experiments.train --config=configs/arithmetic_calculator_tiny.py --workdir=workdir/arith
  python -m experiments.train --config=configs/arithmetic_calculator_tiny.py --workdir=workdir/arith_no_tool \
      --config.env.tool_enabled=False                                   # the no-tool control, the same budget
  python -m experiments.evaluate --workdir=workdir/arith --config.rollout.host_eval_episodes=512

Needs the `tasks` extra (`pip install -e ".[tasks]"`). The warm start imitates a teacher that uses the calculator on
half of the questions and answers the rest itself with a plausible wrong number, so RL has the tool's worth to
discover. The run trains its own tokenizer on the task's text (`model.tokenizer="env"`): the system turn and
the call's skeleton become a few tokens each and every digit stays one, so a teacher episode is ~72 tokens (121 at
most in 64 draws) where the shipped tic-tac-toe tokenizer takes ~142 (206).
"""

import ml_collections

from configs import tictactoe_tiny


def get_config() -> ml_collections.ConfigDict:
    c = tictactoe_tiny.get_config()
    c.num_steps = 80  # GSPO steps

    # --- task: every option of the environment at its default, so the command line can set each ---------------
    c.env = ml_collections.ConfigDict()
    c.env.name = "arithmetic_calculator"
    c.env.module = "reno_jax.envs.arithmetic_calculator"
    c.env.min_digits = 4  # digits per operand
    c.env.max_digits = 6
    c.env.min_terms = 2  # operands per question (+ - *, exact integer results)
    c.env.max_terms = 3
    c.env.teacher_tool_rate = 0.5  # warm start: share of the teacher's episodes that use the calculator
    c.env.teacher_guess_kept = 0.5  # share of the right answer's leading digits the teacher's own guess keeps
    c.env.tool_enabled = True  # False: the no-tool control (answer only)
    c.env.eval_size = 512  # held-out questions (another dataset seed)

    # --- supervised warm start on the teacher's conversations (format, the tool on half the questions) -------
    # Copying (the expression into calculate, the result into answer) is the whole task and comes late: a decaying
    # rate from the start delays it by hundreds of steps, so the rate stays at its peak until the copying is there
    # and decays only at the end, which makes it exact (docs/benchmarks.md, "The calculator task"). ~13 min on 2
    # cores.
    c.model.tokenizer = "env"
    c.sft.num_steps = 4000
    c.sft.batch_size = 32
    c.sft.decay_steps = 1200  # the peak held, then the cosine to a tenth over the last 1200 steps

    # --- rollout ----------------------------------------------------------------------------------------------
    c.rollout.boards_per_step = 16  # questions per step
    c.rollout.group_size = 8
    # Lengths below are the shipped tokenizer's, an upper bound for the run's own (which spells the same digits
    # and a shorter skeleton). A call is 25 tokens with its turn end around its argument ('<tool_call>{"name":
    # "calculate", "arguments":
    # {"expression": "..."}}</tool_call>'); the tool shows expressions of up to 48 tokens (EXPRESSION_MAX_TOKENS).
    # The dataset's nested parentheses make a few long ones: 37 tokens at most in 20,000 training draws, but a
    # warm start met a 40-token one (a 65-token call, which the former 64 refused mid-run), hence 25 + 48.
    # The turn ends at '</tool_call>'.
    c.rollout.max_new_tokens = 73
    c.rollout.max_turns = 2  # calculate, answer
    # Prompt (<= 115) + two turns (146) + one tool turn (10 fixed + a response of up to 67 tokens): a longer
    # response (a calculator error message) ends the episode as truncated.
    c.rollout.max_length = 338
    # Train steps at the batch's used width (a teacher episode is ~72 of the 338 columns), a few compiled widths.
    c.rl.length_bucket = 32
    # Each row encodes its own prompt (~40 tokens): the shared-prompt cut is the shortest prompt seen so far, and
    # every shorter question recompiled the train step (10 compiles of ~27 s in 80 steps); sharing saved less.
    c.rl.share_prompt_prefix = False
    # A gentler RL than the board games': at tic-tac-toe's 3e-3, or with its entropy bonus on the most uncertain
    # token (here a digit being copied), GSPO broke the fresh copying within ~10 steps and then dropped the tool.
    c.rl.learning_rate = 1e-3
    c.rl.end_learning_rate = 1e-4
    c.rl.forking_entropy_coef = 0.0
    return c
