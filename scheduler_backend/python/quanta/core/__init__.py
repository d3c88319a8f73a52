"""Pure-Python heart of Quanta: requests, block bookkeeping, messages and the loop.

NOTE: nothing under ``quanta.core`` may import torch (a test enforces it), so the same
scheduler runs inside Triton, in the offline API and in the simulator.
"""
