"""Tic-tac-toe through a `choose_square` tool call: rules, the perfect-play table, board datasets, wording,
the tool parser and the move / game tasks."""
