"""The scheduler's host: the data plane's scheduler under the wall clock, answers, timeouts and budgets.

It decides on metadata and applies the decisions (dispatch, drop, wake); bytes go from
the host to the first worker and worker to worker over :mod:`ppipe.runtime.wire`. It
imports no HTTP server, no Ray and no torch, reaches workers only through
:class:`~ppipe.runtime.launch.handle.WorkerHandle` and reads time only from the clock it is
given.

- :mod:`~ppipe.runtime.scheduler.host`: :class:`~ppipe.runtime.scheduler.host.Runtime`:
  requests in, decisions applied, answers out.
- :mod:`~ppipe.runtime.scheduler.batches`: a dispatch sent to its first worker, the
  workers' reports taken.
- :mod:`~ppipe.runtime.scheduler.failures`: gone workers, lost reports, re-created workers.
- :mod:`~ppipe.runtime.scheduler.switching`: live plan switches.
- :mod:`~ppipe.runtime.scheduler.inflight`: what is kept of requests and batches until answered.
- :mod:`~ppipe.runtime.scheduler.budgets`, :mod:`~ppipe.runtime.scheduler.metrics`: the
  service margins and the Prometheus metrics.
"""
