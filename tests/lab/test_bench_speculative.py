"""``quanta bench speculative``'s pure pieces: its workloads and its decode rate."""

from __future__ import annotations

from quanta_lab.bench.speculative import EDIT_INSTRUCTION, decode_rate, edit_prompts, misspell


def test_misspelling_swaps_two_letters_of_every_ninth_long_word() -> None:
    out = misspell("Wonderful things happen in every single morning when sunlight arrives", 3)
    assert out.split()[2] == "hpapen"  # the 3rd word of five letters or more
    assert out.split()[6] == "mroning" and out.split()[5] == "single"
    numbered = " ".join(f"word{i:02d}x" for i in range(20))
    assert misspell(numbered, 1) == numbered  # only alphabetic words count


def test_edit_prompts_are_the_paragraphs_with_their_instruction() -> None:
    prompts = edit_prompts()
    assert len(prompts) == 4
    assert all(p.startswith(EDIT_INSTRUCTION) for p in prompts)
    assert "Four score and seven years ago" in prompts[0]


def test_decode_rate_leaves_the_first_token_out() -> None:
    assert decode_rate([[0.0, 1.0, 2.0], [5.0, 5.5]]) == 3 / 2.5
    assert decode_rate([[1.0]]) == 0.0
