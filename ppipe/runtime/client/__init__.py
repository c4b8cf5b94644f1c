"""Clients of a running ``ppipe serve``: the ``ppipe bench`` load generator and its HTTP client.
"""
