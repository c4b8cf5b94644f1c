"""Launchers: how a plan's workers and frontend processes are started (Ray today) and what they are handed.
"""
