"""The messages frontend shards pass each other: requests for models another shard owns, and their answers.

A shard that receives a request for a model it does not own passes it to the owner
(:class:`ppipe.runtime.ingress.shard_router.ShardRouter`) as one data-path message, and
the owner answers with one: an HTTP request as :class:`PassRequest` (answered by
:class:`PassAnswer`), a gRPC call as :class:`PassGrpc` (answered by :class:`GrpcAnswer`).
The body (the HTTP body, or the serialized gRPC request or response) is not a field: it
follows the message as the raw tensor ``"body"`` (uint8), as feature maps follow a
:class:`~ppipe.runtime.wire.messages.StageMsg` (:mod:`ppipe.runtime.wire.frames`).

Every router's one inbox takes all four kinds, so each is a tagged struct (its tag is the
array's first element) and they travel in one :class:`ShardEnvelope`, the type the inbox
decodes: an unknown kind, a missing field or a field of the wrong type is refused at
decoding (:class:`~ppipe.runtime.wire.frames.WireError`), never half-read.

Evolution rule, as for :mod:`ppipe.runtime.wire.messages`: a new field gets a default and
goes last.
"""

from __future__ import annotations

from typing import Union

import msgspec

STRUCT = dict(array_like=True, frozen=True, gc=False, omit_defaults=True)

HttpHeaders = tuple[tuple[bytes, bytes], ...]
# gRPC metadata in two parts: the text values, and the bytes values (of "-bin" keys); a
# field cannot hold either, as MessagePack's str and bin decode to one Python type each
TextMetadata = tuple[tuple[str, str], ...]
BinaryMetadata = tuple[tuple[str, bytes], ...]


class HttpRequest(msgspec.Struct, **STRUCT):
    """What of an ASGI request scope travels to another shard (its body apart); the owner
    replays it into its own app."""

    method: str
    path: str
    query: bytes
    headers: HttpHeaders  # without content-length: the replay sets it from the body
    http_version: str = "1.1"
    client: tuple[str, int] = ("", 0)


class PassRequest(msgspec.Struct, tag="request", **STRUCT):
    """HTTP request ``id`` of the router at ``reply_to``, for the shard that owns its model."""

    id: int
    reply_to: str
    request: HttpRequest


class PassAnswer(msgspec.Struct, tag="answer", **STRUCT):
    """The owner's HTTP answer to request ``id``: its status and headers (the body follows)."""

    id: int
    status: int
    headers: HttpHeaders


class PassGrpc(msgspec.Struct, tag="grpc", **STRUCT):
    """gRPC call ``id`` of the router at ``reply_to``: the method ``rpc`` (``"ModelInfer"``,
    ...) and the caller's metadata (as :func:`split_metadata` splits it); the serialized
    request follows."""

    id: int
    reply_to: str
    rpc: str
    metadata: TextMetadata
    binary_metadata: BinaryMetadata = ()


class GrpcAnswer(msgspec.Struct, tag="grpc_answer", **STRUCT):
    """The owner's answer to gRPC call ``id``: ``code`` None for OK (the serialized response
    follows), else the status code's name, its message and trailing metadata (as
    :func:`split_metadata` splits it)."""

    id: int
    code: str | None
    message: str
    trailing: TextMetadata
    binary_trailing: BinaryMetadata = ()


ShardMessage = Union[PassRequest, PassAnswer, PassGrpc, GrpcAnswer]


class ShardEnvelope(msgspec.Struct, **STRUCT):
    """One message between shards' routers, of any of the four kinds."""

    msg: ShardMessage


def split_metadata(pairs) -> tuple[TextMetadata, BinaryMetadata]:
    """gRPC metadata ``(key, value)`` pairs as its text and its bytes values, each part in order."""
    pairs = [(k, v) for k, v in pairs]
    return (tuple((k, v) for k, v in pairs if not isinstance(v, bytes)),
            tuple((k, v) for k, v in pairs if isinstance(v, bytes)))


def join_metadata(text: TextMetadata, binary: BinaryMetadata) -> list[tuple[str, str | bytes]]:
    """The pairs :func:`split_metadata` split: the text values, then the bytes values."""
    return [*text, *binary]
