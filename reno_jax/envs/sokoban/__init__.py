"""Sokoban as a `TextEnv`: push every box onto a target in small rooms, one move per tool call."""
