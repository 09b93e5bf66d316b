"""Host-side tools for host environments: plain Python that speaks text, no JAX (calculator: arithmetic;
knowledge_base: an invented world, its lookup tool, two-hop questions and a random-lookup control)."""
