"""Shipped tokenizer assets (tokenizer.json, tokenizer_config.json, chat_template.jinja) and their build script."""
