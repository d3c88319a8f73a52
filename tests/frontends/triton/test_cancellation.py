"""A client that disconnects is stopped within a few engine steps even when 30 other streams
keep the response path busy (it used to run on for about 100 tokens at 50 streams)."""

from __future__ import annotations

import pytest
from quanta_lab.bench.cancel import tokens_after_disconnect

pytestmark = pytest.mark.live

OTHERS = 30
TOKENS = 300
# Tokens generated after the disconnect: about 100 at 50 streams before responses were
# merged, 2-7 since on an idle machine. The tiny model's steps take a few ms, shorter than
# the way of a cancellation through Triton, so this counts a few steps, not one or two.
MAX_AFTER = 30
# The shared server's model with room for every stream (1024 blocks, 64 seqs, no host tier).
MODEL = "quanta-roomy"


# A cancellation's way through Triton is timed by the machine, and a CI machine running
# other test workers beside the server can stretch one measurement to twice the bound (77
# once); the broken path ran on for about 100 tokens every time, so a second measurement is
# taken before failing: a regression fails both.
ATTEMPTS = 2


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_disconnected_stream_stops_within_a_few_steps_under_load(triton, transport):
    counts = []
    for _ in range(ATTEMPTS):
        after, _ = tokens_after_disconnect(triton, OTHERS + 1, TOKENS, transport, model=MODEL)
        counts.append(after)
        if 0 <= after <= MAX_AFTER:
            return
    raise AssertionError(f"tokens generated after the disconnect, each attempt: {counts}")
