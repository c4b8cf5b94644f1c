"""The runtime: ``ppipe serve`` behind an Open Inference Protocol (KServe v2) API.

Laid out by role, as the drawing in DESIGN.md ("The runtime at scale"):

- :mod:`~ppipe.runtime.ingress`: HTTP and gRPC (KServe v2), the protocol's encoding, the
  OpenAPI document and the decoding of request bodies. No Ray, no torch.
- :mod:`~ppipe.runtime.scheduler`: the host of the data plane's scheduler under the wall
  clock (:class:`~ppipe.runtime.scheduler.host.Runtime`): it submits requests, applies the
  scheduler's decisions, answers, times out, and learns from the workers' reports; budgets
  and metrics. No HTTP server, no Ray, no torch.
- :mod:`~ppipe.runtime.workers`: one worker per vGPU: the stage server, the backends
  (``ort``, ``tensorrt``, ``torch``, ``emulated``) and the worker-to-worker transports
  (NCCL, staging rings, CUDA IPC).
- :mod:`~ppipe.runtime.wire.frames`: the data path's framing and its TCP connections.
- :mod:`~ppipe.runtime.launch`: starting a plan's workers (Ray), frontend shards.
- :mod:`~ppipe.runtime.control`: live plan switches and the re-plan loop.
- :mod:`~ppipe.runtime.client`: ``ppipe bench``'s load generator and HTTP client.
- :mod:`~ppipe.runtime.clock`: the wall clock handed to the data plane, shared by all roles.
- :mod:`~ppipe.runtime.memory` and :mod:`~ppipe.runtime.timerslack`: how every serving process
  sets itself up (its allocator; its threads' timer slack).

Ray, onnxruntime and TensorRT are imported lazily: importing this package is cheap.
"""
