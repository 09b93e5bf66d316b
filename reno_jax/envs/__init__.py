"""Tool-calling environments behind one interface (`interface.TextEnv`).

interface.py     TextEnv, Message, ToolCall, Step: what every environment speaks
registry.py      environments by name for `python -m experiments.train` (sampler, warm-start teacher)
tictactoe/       AReno's task: rules, perfect-play table, board datasets, wording, move and game tasks
connect4/        Connect Four against random / greedy / negamax opponents
guess_number.py  the README's one-page example environment
"""
