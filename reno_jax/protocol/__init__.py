"""The tool-calling protocol, independent of any environment: tokenizers and token bytes, the chat-template
compiler (messages -> token stencils rendered in jit), the tool-call compiler (tool schemas -> token automaton)
and the stop matcher."""
