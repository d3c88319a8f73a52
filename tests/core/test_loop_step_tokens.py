"""The loop hands each step's token count to whoever takes it (the metrics' iteration-tokens
histogram): every step once, in order, and nothing more."""

from __future__ import annotations

from conftest import make_requests


def test_every_step_token_count_is_taken_once_in_order(make_loop):
    loop = make_loop(max_num_batched_tokens=8)
    for r in make_requests(2, prompt_len=[12, 3], max_tokens=4):
        loop.submit(r)
    assert loop.take_step_tokens() == []
    loop.step()
    first = loop.take_step_tokens()
    assert first == [loop.runner.steps[0].num_tokens] and first[0] <= 8
    loop.run_until_idle()
    rest = loop.take_step_tokens()
    assert first + rest == [s.num_tokens for s in loop.runner.steps]
    assert sum(first + rest) == 12 + 3 + 2 * 3  # prompts, then one token per later decode
    assert loop.take_step_tokens() == []
