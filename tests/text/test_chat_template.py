"""The chat template's rendering options, as HF's ``apply_chat_template`` takes them:
``add_generation_prompt``, ``continue_final_message`` and extra template variables."""

from __future__ import annotations

import pytest
from quanta.text.chat_template import ChatTemplate, ChatTemplateError, Turn

JINJA = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
)
CHAT = [Turn("user", "Hi"), Turn("assistant", "The answer is ")]


@pytest.fixture
def jinja() -> ChatTemplate:
    return ChatTemplate(JINJA, bos_token="<s>", eos_token="</s>")


def test_continue_final_message_ends_inside_the_last_turn_as_hf_cuts_it(jinja):
    # the text's trailing space is the template's to keep: it writes the text as given
    assert jinja.render(CHAT, continue_final_message=True) == (
        "<s><|user|>Hi<|end|><|assistant|>The answer is "
    )
    assert ChatTemplate().render(CHAT, continue_final_message=True) == (
        "user: Hi\nassistant: The answer is "
    )


def test_continue_final_message_matches_hfs_apply_chat_template(jinja):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
    )
    hf.chat_template = JINJA
    conversation = [{"role": t.role, "content": t.content} for t in CHAT]
    for kwargs in ({"continue_final_message": True}, {"add_generation_prompt": False}, {}):
        expected = hf.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=kwargs.get("add_generation_prompt", True)
            and not kwargs.get("continue_final_message", False),
            continue_final_message=kwargs.get("continue_final_message", False),
        )
        assert jinja.render(CHAT, **kwargs) == expected, kwargs


def test_without_a_generation_prompt_the_prompt_ends_after_the_last_turn(jinja):
    assert jinja.render(CHAT[:1], add_generation_prompt=False) == "<s><|user|>Hi<|end|>"
    assert ChatTemplate().render(CHAT[:1], add_generation_prompt=False) == "user: Hi\n"


def test_template_kwargs_reach_the_template_and_may_not_replace_its_variables(jinja):
    assert jinja.render(CHAT[:1], template_kwargs={"enable_thinking": False}).endswith(
        "<|assistant|><think></think>"
    )
    assert "<think>" not in jinja.render(CHAT[:1], template_kwargs={"enable_thinking": True})
    with pytest.raises(ChatTemplateError, match="set by the server"):
        jinja.render(CHAT[:1], template_kwargs={"messages": []})


def test_a_final_message_the_template_drops_cannot_be_continued():
    drops = ChatTemplate("{% for m in messages %}{{ m['role'] }};{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not write the final message"):
        drops.render(CHAT, continue_final_message=True)
