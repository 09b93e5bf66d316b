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
    ``chat().num_values``) gives every slot's option index."""

    template: jax.Array
    values: jax.Array


@flax.struct.dataclass
class ToolCall:
    """A parsed tool call (``reno_jax.protocol.toolcall``).

    Attributes:
      kind: ``int32 []`` ``toolcall.KIND_OK`` (0), ``KIND_NO_CALL``, ``KIND_BAD_CALL`` or ``KIND_OUT_OF_RANGE``.
      tool: ``int32 []`` index of the called tool in ``chat().tools`` (0 unless ``kind == KIND_OK``).
      args: ``int32 [A]`` the tool's arguments in its schema order: integers as their value, enum strings as
        their option index (0 past the tool's arguments or unless ``kind == KIND_OK``).
    """

    kind: jax.Array
    tool: jax.Array
    args: jax.Array

    @property
    def ok(self) -> jax.Array:
        return self.kind == 0
