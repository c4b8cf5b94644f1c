"""The runtime: ``ppipe serve`` on Ray behind an Open Inference Protocol (KServe v2) API.

Pieces (each a module):

- :mod:`~ppipe.runtime.clock`: :class:`WallClock`, the data plane's ``Clock`` on the
  asyncio loop of the frontend; converts workers' wall times to the scheduler's timeline.
- :mod:`~ppipe.runtime.protocol`: KServe v2 request/response encoding (JSON tensors and
  the binary tensor extension), pure functions.
- :mod:`~ppipe.runtime.backends`: how a worker runs its partition: ``ort`` (onnxruntime),
  ``tensorrt`` (GPU) or ``emulated`` (sleeps for the profiled latency, emits tensors of
  the profiled size; for rehearsals and tests, never a stand-in for a GPU result).
- :mod:`~ppipe.runtime.worker`: :class:`VgpuWorker`, one Ray actor per vGPU of the plan.
  A batch goes worker to worker along its reserved path (fp16 feature maps); only the last
  stage's output goes back to the frontend.
- :mod:`~ppipe.runtime.transport`: how feature maps cross: NCCL (CuPy) between GPU workers
  on distinct GPUs, with both ends posted at dispatch; otherwise the data path's connections.
  Chosen per worker pair (``ppipe serve --transport auto|tcp|nccl``).
- :mod:`~ppipe.runtime.wire`, :mod:`~ppipe.runtime.datapath`: the per-batch data path,
  TCP connections from the frontend along each batch's reserved route and reports back
  (Ray places the workers and watches their lives; it carries no batch).
- :mod:`~ppipe.runtime.deploy`: placing the workers on the Ray nodes the plan names.
- :mod:`~ppipe.runtime.driver`: :class:`Runtime`, which runs the data plane's scheduler
  under the wall clock and turns its decisions into data-path messages.
- :mod:`~ppipe.runtime.server`: the starlette app (health, metadata, infer, /metrics).
- :mod:`~ppipe.runtime.bench`: the open-loop load generator behind ``ppipe bench``
  (arrivals from :mod:`ppipe.sim.arrivals`; requests through
  :mod:`~ppipe.runtime.httpclient`).

Ray, onnxruntime and TensorRT are imported lazily: importing this package is cheap.
"""
