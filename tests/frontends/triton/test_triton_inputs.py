"""The Triton input table: the one declaration the clients, the backend, the model config and
docs/triton-api.md are all made from, and the round trip through it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from quanta.core.request import RequestMetadata, SamplingParams
from quanta.core.structured import StructuredOutput
from quanta.frontends.triton.backend import TritonPythonModel
from quanta.frontends.triton.inputs import (
    BY_NAME,
    INPUTS,
    SAMPLING_BY_RULE,
    TYPES,
    input_table,
    parse_request,
    request_inputs,
)

ROOT = Path(__file__).resolve().parents[3]


def test_the_docs_input_table_is_the_backends():
    text = (ROOT / "docs" / "triton-api.md").read_text()
    documented = text.split("<!-- inputs: begin -->\n", 1)[1].split("\n<!-- inputs: end -->", 1)[0]
    assert documented == input_table(), "regenerate it from quanta.frontends.triton.inputs"


class _Config:
    """What Triton hands ``auto_complete_config``: a config with nothing declared."""

    def __init__(self, text: str) -> None:
        self.inputs: list[dict[str, object]] = []
        self._declared = re.findall(r"^\s*input\s*\[", text, re.MULTILINE)

    def as_dict(self) -> dict[str, object]:
        return {"parameters": {}}

    def set_max_batch_size(self, size: int) -> None:
        pass

    def set_model_transaction_policy(self, policy: dict[str, bool]) -> None:
        pass

    def add_input(self, tensor: dict[str, object]) -> None:
        self.inputs.append(tensor)

    def add_output(self, tensor: dict[str, object]) -> None:
        pass


@pytest.mark.parametrize(
    "config", ["triton_models/config.pbtxt.template", "triton_models/quanta/config.pbtxt"]
)
def test_a_model_config_gets_exactly_the_tables_inputs(config):
    """The shipped configs declare no input by hand: auto-complete adds the table's."""
    cfg = _Config((ROOT / config).read_text())
    assert cfg._declared == []
    TritonPythonModel.auto_complete_config(cfg)
    assert cfg.inputs == [
        {"name": s.name, "data_type": s.dtype, "dims": s.dims, "optional": True} for s in INPUTS
    ]


def test_every_request_field_has_its_input():
    carried = {s.sampling for s in INPUTS if s.sampling is not None}
    assert carried | SAMPLING_BY_RULE == set(SamplingParams.model_fields)
    assert not carried & SAMPLING_BY_RULE
    assert [s.metadata for s in INPUTS if s.metadata] == list(RequestMetadata.model_fields)
    assert all(s.dtype in TYPES for s in INPUTS) and len(BY_NAME) == len(INPUTS)


def _arrays(inputs: dict[str, object]) -> dict[str, np.ndarray]:
    """Tensors as a client sends them: each value typed from the table."""
    arrays = {}
    for name, value in inputs.items():
        spec = BY_NAME[name]
        values = value if spec.many else [value]
        numpy = TYPES[spec.dtype].numpy
        if numpy is np.object_:
            arrays[name] = np.array([str(v).encode() for v in values], dtype=np.object_)
        else:
            arrays[name] = np.array(values, dtype=numpy)
    return arrays


def test_what_a_client_flattens_the_backend_reads_back_unchanged():
    params = SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.875,
        top_k=7,
        min_p=0.25,
        seed=3,
        stop=("x", "yz"),
        stop_token_ids=(2,),
        ignore_eos=True,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_tokens=2,
        logit_bias={3: -5.5, 7: 100.0},
        logprobs=3,
        prompt_logprobs=3,
        structured_output=StructuredOutput(regex="[ab]+"),
    )
    metadata = RequestMetadata(
        tenant="acme",
        tenant_authenticated=True,
        app="chat",
        interaction_id="i1",
        interaction_stage=1,
        interaction_last=True,
        system_tokens=4,
        priority_class="offline",
        ttft_slo_ms=250.0,
        tpot_slo_ms=50.0,
    )
    inputs = request_inputs([5, 6], params, stream=True, metadata=metadata)
    json.dumps(inputs)  # also an HTTP generate body
    parsed = parse_request(_arrays(inputs).get)
    assert parsed.params == params and parsed.metadata == metadata
    assert parsed.prompt == [5, 6] and parsed.stream and not parsed.echo
    assert (parsed.return_log_probs, parsed.top_log_probs, parsed.return_prompt_log_probs) == (
        True,
        3,
        True,
    )
    plain = request_inputs("hi", SamplingParams(), stream=False)
    assert parse_request(_arrays(plain).get).params == SamplingParams()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(stop_token_ids=(1, 2)), "one stop token id"),
        (SamplingParams(logprobs=1, prompt_logprobs=2), "one top_log_probs"),
        (SamplingParams(bad_words_ids=((1,),)), "bad words as text"),
    ],
)
def test_settings_no_input_can_carry_are_refused_on_the_client(params, message):
    with pytest.raises(ValueError, match=message):
        request_inputs("hi", params, stream=False)
