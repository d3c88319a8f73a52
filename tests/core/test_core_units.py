"""Pure-Python units: sampling validation, block accounting, detokenizer, the import wall."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from quanta.core.blocks import BlockManager, Tier
from quanta.core.detokenize import Detokenizer
from quanta.core.request import CacheKind, RequestMetadata, SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "greater than or equal to 0"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", -1, "greater than or equal to 0"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("stop", [""], "stop strings must be non-empty"),
        ("temperature", float("nan"), "finite number"),
        ("bogus", 1, "Extra inputs are not permitted"),
    ],
)
def test_bad_sampling_values_raise_clear_errors(field, value, message):
    with pytest.raises(ValidationError, match=message):
        SamplingParams(**{field: value})


def test_sampling_defaults_and_stop_string():
    p = SamplingParams(stop="END")
    assert p.stop == ("END",) and p.top_k == 0 and p.top_p == 1.0 and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_bad_metadata_rejected():
    with pytest.raises(ValidationError, match="online"):
        RequestMetadata(priority_class="batch")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("agsifr"), st.integers(0, 5), st.integers(1, 40)), max_size=60
    )
)
def test_block_accounting_is_exact_under_any_sequence(ops):
    bm = BlockManager(block_size=4, num_device_blocks=20, num_host_blocks=10)
    tokens: dict[str, int] = {}
    for op, who, n in ops:
        rid = f"r{who}"
        kind = CacheKind.HIDDEN if who % 2 else CacheKind.KV  # a unified pool of both kinds
        tier = bm.tier_of(rid)
        if op in "ag" and tier in (None, Tier.DEVICE):
            total = tokens.get(rid, 0) + n
            before = bm.num_free(Tier.DEVICE)
            got = bm.allocate_slots(rid, total, kind)
            if got is None:
                assert bm.num_free(Tier.DEVICE) == before  # nothing taken on failure
            else:
                tokens[rid] = total
                assert bm.num_blocks(rid) == bm.blocks_for(total, kind)
                assert bm.kind_of(rid) is kind
        elif op == "s" and tier is Tier.DEVICE:
            bm.swap_out(rid)
        elif op == "i" and tier is Tier.HOST:
            bm.swap_in(rid)
        elif op == "f":
            bm.free(rid)
            tokens.pop(rid, None)
            assert bm.kind_of(rid) is None
        assert bm.kind_of(rid) in (None, kind)  # swaps keep it
        bm.check_integrity()
    for rid in list(tokens):
        bm.free(rid)
    assert bm.all_free()


def test_swap_moves_blocks_between_tiers():
    bm = BlockManager(4, 4, 4)
    bm.allocate_slots("a", 10)
    pairs = bm.swap_out("a")
    assert pairs is not None and len(pairs) == 3
    assert bm.tier_of("a") is Tier.HOST and bm.num_free(Tier.DEVICE) == 4
    bm.allocate_slots("b", 16)
    assert bm.swap_in("a") is None  # device full: nothing moves
    assert bm.tier_of("a") is Tier.HOST
    bm.free("b")
    assert bm.swap_in("a") is not None and bm.tier_of("a") is Tier.DEVICE
    bm.free("a")
    bm.check_integrity()
    assert bm.all_free()


def test_detokenizer_holds_back_partial_stop_and_utf8():
    table = {0: "he", 1: "llo", 2: " wo", 3: "rld", 4: "\ufffd"}
    d = Detokenizer(lambda ids: "".join(table[i] for i in ids), stop=("o w",))
    assert d.update([0], final=False) == ("he", False)
    assert d.update([0, 1], final=False) == ("ll", False)  # "o" might start "o w"
    assert d.update([0, 1, 2], final=False) == ("", True)  # stop hit: cut before it
    d2 = Detokenizer(lambda ids: "".join(table[i] for i in ids))
    assert d2.update([0, 4], final=False) == ("he", False)  # incomplete character held
    assert d2.update([0, 4], final=True) == ("\ufffd", False)


def test_core_and_policies_do_not_import_torch():
    code = (
        "import sys, quanta.core.loop, quanta.core.apply, quanta.policies, quanta;"
        "import quanta.core.config, quanta.core.commit;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 560), min_size=1, max_size=60),
    stop=st.sampled_from([(), ("e",), ("the ", "\n")]),
    family=st.sampled_from(["opt", "llama"]),
)
def test_incremental_detokenizer_emits_what_a_full_decode_would(ids, stop, family):
    """Step by step, the emitted text adds up to the full decode cut at the first stop string,
    on the project's byte-level tokenizer: ids that split UTF-8 characters, runs of invalid
    UTF-8 longer than the window, special ids and ids past the vocabulary included."""
    decode = _byte_level_decode(family)
    detok = Detokenizer(decode, stop=stop)
    out, stopped = "", False
    for n in range(1, len(ids) + 1):
        text, stopped = detok.update(ids[:n], final=n == len(ids))
        out += text
        if stopped:
            break
    full = decode(ids)
    cuts = [i for s in stop if (i := full.find(s)) >= 0]
    if stopped:
        assert cuts and out == full[: min(cuts)]
    else:
        assert out == full and not cuts


@functools.cache
def _byte_level_decode(family: str) -> Callable[[Sequence[int]], str]:
    """The decode of the presets' byte-level BPE tokenizer (``quanta make-model``)."""
    from quanta.build.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(family)  # type: ignore[arg-type]
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
