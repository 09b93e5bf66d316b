"""Task sources for host environments: question generators with their own scoring, adapted to one interface
(reasoning_gym: any Reasoning Gym dataset by name; needs the optional `tasks` extra, imported only when used)."""
