"""Serving through NVIDIA Triton Inference Server.

The backend (``backend.py``) runs inside Triton's Python backend stub; the launcher, client and
CLI run in the user's process. Nothing here imports torch or tritonclient at import time, so the
CLI stays fast and the package imports where Triton is not installed.
"""
