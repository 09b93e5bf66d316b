"""Shipped tokenizer assets (tokenizer.json, tokenizer_config.json, chat_template.jinja) and the generic builder
(`build_tokenizer`; the shipped corpus: `reno_jax.envs.tictactoe.tokenizer_corpus`)."""
