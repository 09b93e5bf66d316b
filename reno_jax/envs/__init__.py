"""Tool-calling environments behind one interface (`interface.TextEnv`).

interface.py     TextEnv, Message, ToolCall, Step: what every environment speaks
registry.py      environments by name for `python -m experiments.train` (sampler, warm-start teacher)
tictactoe/       AReno's task: rules, perfect-play table, board datasets, wording, move and game tasks
connect4/        Connect Four against random / greedy / negamax opponents
guess_number.py  the README's one-page example environment
host.py          HostEnv: environments stepped in Python on the host (guess_number_host.py: the smallest one)
reasoning_gym_env.py     any Reasoning Gym dataset as a host environment (answer, optionally a calculator)
arithmetic_calculator.py Reasoning Gym's basic_arithmetic on large numbers with calculate(expression)
two_hop_lookup.py        two-hop questions over an invented knowledge base with lookup(query)
"""
