"""Chat-template compiler: an environment's messages (templates with integer slots) and tool schemas -> token
stencils rendered inside jit with the tokenizer's own chat template.

CONTRACT (public API; the compiler below implements it):

    Slot(value=i, options=("a", "bb", ...))     text ``options[values[i]]`` (values clipped into range)
    Parts = tuple of str | Slot                 one message's content
    ChatSpec(system, tools, user, tool, tool_continues, num_values)
    compile_chat(tokenizer, spec, chat_template=None, max_stencil_rows=4096) -> ChatTables      (host, once)
    render_user(tables, message) -> (ids int32 [tables.prompt_len], n int32 [])   system + user + assistant header
    render_tool(tables, message, add_turn_end) -> (ids int32 [tables.response_len], n int32 [])
        rest of the assistant turn after its turn-end marker (the marker itself when ``add_turn_end``), the tool
        turn, and the next assistant header when ``spec.tool_continues[template]``
    resolve(parts, values) -> str; user_messages(spec, message) / tool_message(spec, message) -> chat dicts   (host)
    prompt_ids(tokenizer, spec, messages, ...) -> list[int]                                                   (host)
"""
