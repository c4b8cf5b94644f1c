"""Ingress: the KServe v2 HTTP and gRPC APIs, their encoding and the decoding of request bodies.

Ingress reads, authenticates, validates and decodes requests and hands each to the
scheduler's host (:mod:`ppipe.runtime.scheduler`); it imports no Ray and no torch.
"""
