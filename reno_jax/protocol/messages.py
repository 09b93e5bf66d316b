"""The protocol's data: a message to render (`Message`) and a parsed tool call (`ToolCall`).

They sit in the protocol layer because the protocol produces and consumes them (`chat` renders a `Message`,
`toolcall` parses into a `ToolCall`); environments (`reno_jax.envs.interface`) speak them.
"""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class Message:
    """A message as data: ``template`` (``int32 []``) picks one of the environment's templates of that role
    (user templates for `reset`, tool templates for `step`), ``values`` (``int32 [S]``, S =
    ``chat().num_values``) gives every slot's option index. A tool message whose templates hold span slots
    (``chat.SpanSlot``) also gives ``span_ids`` (``int32 [J, W]``, J = the spans the templates read) and
    ``span_len`` (``int32 [J]``): the token ids each span slot inserts (e.g. a ``ToolCall.text_ids`` row);
    None otherwise (the pytree of messages without spans is unchanged)."""

    template: jax.Array
    values: jax.Array
    span_ids: jax.Array | None = None
    span_len: jax.Array | None = None


@flax.struct.dataclass
class ToolCall:
    """A parsed tool call (``reno_jax.protocol.toolcall``).

    Attributes:
      kind: ``int32 []`` ``toolcall.KIND_OK`` (0), ``KIND_NO_CALL``, ``KIND_BAD_CALL`` or ``KIND_OUT_OF_RANGE``.
      tool: ``int32 []`` index of the called tool in ``chat().tools`` (0 unless ``kind == KIND_OK``).
      args: ``int32 [A]`` the tool's arguments in its schema order: integers as their value, enum strings as
        their option index (0 past the tool's arguments or unless ``kind == KIND_OK``); a free-text argument 0.
      text_ids: ``int32 [M, L]`` the tool's free-text arguments in its schema order (M = the schema's largest
        free-text argument count per tool, L = its largest ``maxTokens``): the token ids between the quotes, zero
        padded; all zeros unless ``kind == KIND_OK``. None when the schema has no free-text argument (the pytree
        of such environments is unchanged).
      text_len: ``int32 [M]`` the token count of each ``text_ids`` row (None like ``text_ids``).
    """

    kind: jax.Array
    tool: jax.Array
    args: jax.Array
    text_ids: jax.Array | None = None
    text_len: jax.Array | None = None

    @property
    def ok(self) -> jax.Array:
        return self.kind == 0
