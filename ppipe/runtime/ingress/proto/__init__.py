"""The KServe v2 gRPC API's messages, built in a private descriptor pool.

``grpc_predict_v2.proto`` (wire-compatible with KServe's reference definition) is compiled
once into ``grpc_predict_v2_desc.py``, its serialized FileDescriptorProto (regenerate with
``python -m ppipe.runtime.ingress.proto._regen``); the message classes are built from it here.

Why not the usual ``_pb2``/``_pb2_grpc`` modules:

- They register ``inference.ModelInferRequest`` & co. in protobuf's *default* pool, and so
  do tritonclient's and KServe's own generated modules: a process that imports both (a
  client that also drives ``ppipe bench``, or our tritonclient tests running a server
  in-process) fails with "duplicate symbol 'inference.ServerLiveRequest'". A private pool
  keeps the same wire format without claiming those global names.
- Generated ``_pb2`` code carries a version guard (protoc >= 26 emits
  ``ValidateProtobufRuntimeVersion``): code from one protoc refuses older runtimes and
  runtimes two majors newer, while setup.cfg allows protobuf 4.25 to 7.x. A serialized
  descriptor has no such guard and loads on every protobuf 4.25+.
- The service itself needs no generated code: :mod:`ppipe.runtime.ingress.grpc_server` and the
  bench client use grpc's generic handlers and ``channel.unary_unary`` with the paths in
  :data:`METHODS`.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ppipe.runtime.ingress.proto.grpc_predict_v2_desc import FILE_DESCRIPTOR

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

_pool = descriptor_pool.DescriptorPool()
_pool.Add(descriptor_pb2.FileDescriptorProto.FromString(FILE_DESCRIPTOR))


def _message(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ServerLiveRequest = _message("ServerLiveRequest")
ServerLiveResponse = _message("ServerLiveResponse")
ServerReadyRequest = _message("ServerReadyRequest")
ServerReadyResponse = _message("ServerReadyResponse")
ModelReadyRequest = _message("ModelReadyRequest")
ModelReadyResponse = _message("ModelReadyResponse")
ServerMetadataRequest = _message("ServerMetadataRequest")
ServerMetadataResponse = _message("ServerMetadataResponse")
ModelMetadataRequest = _message("ModelMetadataRequest")
ModelMetadataResponse = _message("ModelMetadataResponse")
ModelInferRequest = _message("ModelInferRequest")
ModelInferResponse = _message("ModelInferResponse")
InferParameter = _message("InferParameter")
InferTensorContents = _message("InferTensorContents")

#: rpc name -> (full method path, request class, response class)
METHODS = {
    name: (f"/{SERVICE}/{name}", _message(f"{name}Request"), _message(f"{name}Response"))
    for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer")
}
