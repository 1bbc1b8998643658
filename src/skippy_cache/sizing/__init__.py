"""Sizing a cache from traffic: `skippy-cache replay` (docs/sizing.md).

A Mooncake-format trace (trace.py) is replayed through the cache's own books
(replay.py): no model is loaded and nothing is prefilled; the figures are what
the tiers would have served for the capacities given.
"""
