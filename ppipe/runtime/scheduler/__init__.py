"""The scheduler's host: the data plane's scheduler under the wall clock, answers, timeouts and budgets.

It decides on metadata and applies the decisions (dispatch, drop, wake); bytes go from
the host to the first worker and worker to worker over :mod:`ppipe.runtime.wire`. It
imports no HTTP server, no Ray and no torch.
"""
