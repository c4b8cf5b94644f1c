"""The wire: message types and framing of every process boundary, and the data path's TCP connections.
"""
