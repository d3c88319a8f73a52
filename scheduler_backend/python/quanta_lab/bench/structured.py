"""``quanta bench structured``: what structured output costs and what it buys, on a real model.

A tool-calling workload: each prompt lists three tools and asks the model to answer one user
request with one JSON call. The tools are pydantic models; their union's JSON schema is the
guide, and the same union validates every answer (strictly, extra keys refused), so "valid"
means what an agent needs: the whole text parses and is a call of one of the tools with
well-typed arguments. Whether it calls the tool the request asks for is counted apart (valid
is not right). "Found" is the lenient yield: a valid call somewhere in the text (inside prose
or a code fence), as a forgiving parser would dig it out.

Per batch size, the same prompts run free and guided through the same engine (greedy both
times), ``repeats`` times in alternating order, so drift and other work on the machine fall
on both alike. TPOT is taken over the steps where the whole batch is decoding (from the last
request's first token to the first request's end), so an output that ends early does not
make its run look faster by shrinking the batch, and over the same steps in every run (the
first ``n`` of that window, ``n`` the shortest run's), since free and guided outputs end at
different lengths and a later step attends over more context; a Run reports the median over
its repeats.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # the schema says additionalProperties: false


class _WeatherArgs(_Strict):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class _FlightArgs(_Strict):
    origin: str
    destination: str
    date: Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}$")]


class _HotelArgs(_Strict):
    city: str
    nights: Annotated[int, Field(ge=1, le=30)]


class GetWeather(_Strict):
    name: Literal["get_weather"]
    arguments: _WeatherArgs


class SearchFlights(_Strict):
    name: Literal["search_flights"]
    arguments: _FlightArgs


class BookHotel(_Strict):
    name: Literal["book_hotel"]
    arguments: _HotelArgs


# NOTE: a plain union, so the schema says anyOf: a discriminated one says oneOf, which the
# grammar library can only approximate by anyOf (and warns so); the name literals make the
# branches disjoint either way.
ToolCall = GetWeather | SearchFlights | BookHotel
TOOL_CALL: TypeAdapter[Any] = TypeAdapter(ToolCall)

SYSTEM = (
    "You are an assistant that calls tools. The tools are:\n"
    '- get_weather(city: string, unit: "celsius" or "fahrenheit")\n'
    "- search_flights(origin: string, destination: string, date: YYYY-MM-DD)\n"
    "- book_hotel(city: string, nights: integer)\n"
    'Answer with one JSON object only: {"name": <tool>, "arguments": {...}}.'
)
# Each user request with the tool it asks for.
REQUESTS = (
    ("What's the weather in Paris right now, in celsius?", "get_weather"),
    ("Find me a flight from Boston to Denver on 2026-12-03.", "search_flights"),
    ("Book a hotel in Rome for 3 nights.", "book_hotel"),
    ("Is it cold in Oslo? Use fahrenheit.", "get_weather"),
    ("I need to fly from Madrid to Lisbon on 2027-01-15.", "search_flights"),
    ("Reserve a room in Tokyo for a week.", "book_hotel"),
    ("How warm is it in Cairo today?", "get_weather"),
    ("Search flights from Chicago to Miami for 2026-12-20.", "search_flights"),
    ("Get me a hotel in Berlin, two nights.", "book_hotel"),
    ("Weather for Sydney in celsius, please.", "get_weather"),
    ("Flights from London to New York on 2027-02-01?", "search_flights"),
    ("Book five nights in Vienna.", "book_hotel"),
    ("Tell me the temperature in Toronto in fahrenheit.", "get_weather"),
    ("Any flights from Seoul to Bangkok on 2026-12-11?", "search_flights"),
    ("A hotel in Prague for 4 nights, please.", "book_hotel"),
    ("What is the weather like in Lima?", "get_weather"),
)
# One call of each tool as the guide writes JSON (what the library comparison walks).
ANSWERS = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "search_flights", "arguments": {"origin": "Boston", "destination": "Denver", '
    '"date": "2026-12-03"}}',
    '{"name": "book_hotel", "arguments": {"city": "Rome", "nights": 3}}',
)


def is_valid_call(text: str) -> bool:
    """Whether ``text`` is exactly one well-typed call of one of the tools."""
    return called_tool(text) is not None


def called_tool(text: str) -> str | None:
    """The tool ``text`` validly calls, or None."""
    try:
        return str(TOOL_CALL.validate_json(text, strict=True).name)
    except ValidationError:
        return None


def contains_valid_call(text: str) -> bool:
    """Whether a well-typed call starts at some ``{`` of ``text`` (prose around it allowed)."""
    decoder = json.JSONDecoder()
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
            TOOL_CALL.validate_python(value, strict=True)
        except (ValueError, ValidationError):
            continue
        return True
    return False


@dataclass
class Run:
    """One batch size, free or guided."""

    batch: int
    guided: bool
    tpot_ms: float  # median over the repeats of the mean step time while the whole batch decodes
    tpot_ms_each: list[float]
    steps: int  # whole-batch steps each repeat's mean covers (the same in the free and guided)
    valid: int  # answers that are exactly one valid call
    right_tool: int  # valid calls of the tool the request asks for
    found: int  # answers with a valid call somewhere in them
    total: int
    mean_output_tokens: float
    stopped: int  # outputs that ended on their own (EOS or the grammar's end)


@dataclass
class StructuredReport:
    model: str
    dtype: str
    cpu_isa: str
    threads: int
    max_tokens: int
    repeats: int
    vocab_ms: float  # xgrammar's description of the vocabulary: once per engine, on first use
    compile_ms: float  # the tool-call schema's first compile (the compiler caches it)
    load_average: tuple[float, float] = (0.0, 0.0)  # 1-minute, before and after: others' work
    runs: list[Run] = field(default_factory=list)
    sample: dict[str, str] = field(default_factory=dict)  # one answer each way
    libraries: list[dict[str, Any]] = field(default_factory=list)  # --compare-outlines

    def overhead(self, batch: int) -> float | None:
        """Guided TPOT over free TPOT, minus one, at ``batch``."""
        free = [r for r in self.runs if r.batch == batch and not r.guided]
        guided = [r for r in self.runs if r.batch == batch and r.guided]
        if not free or not guided or free[0].tpot_ms <= 0:
            return None
        return guided[0].tpot_ms / free[0].tpot_ms - 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["overhead"] = {str(r.batch): self.overhead(r.batch) for r in self.runs if r.guided}
        return data


def full_batch_steps(token_times: Sequence[Sequence[float]]) -> list[float]:
    """Seconds each step took, in order, over the steps in which every request decoded.

    A token's time is the end of the step that made it (one clock read per step, shared by
    the step's requests), so the step ending at ``b`` took ``b - a``, ``a`` the end before
    it. The window opens at the last request's first token (the step after its prefill is
    the first the whole batch decodes) and closes at the first request's last token."""
    token_times = [times for times in token_times if times]
    if not token_times:
        return []
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    ends = sorted({t for times in token_times for t in times if start <= t <= end})
    return [b - a for a, b in itertools.pairwise(ends)]


def full_batch_tpot(token_times: Sequence[Sequence[float]]) -> float:
    """Mean seconds between tokens while every request of the batch was decoding; a batch
    whose first output ended before the last began has no such step: all its gaps then."""
    steps = full_batch_steps(token_times)
    if not steps:
        steps = [b - a for times in token_times for a, b in itertools.pairwise(times)]
    return statistics.fmean(steps) if steps else 0.0


def paired_tpots(runs: Sequence[Sequence[Sequence[float]]]) -> tuple[list[float], int]:
    """Each run's mean step over its first ``n`` whole-batch steps, ``n`` the fewest any of
    ``runs`` (each a run's token times) has, and ``n``. Free and guided outputs end at
    different lengths, and a later step attends over more context, so only the same steps
    compare; with no common step, each run's ``full_batch_tpot`` and 0."""
    steps = [full_batch_steps(times) for times in runs]
    n = min((len(s) for s in steps), default=0)
    if n == 0:
        return [full_batch_tpot(times) for times in runs], 0
    return [statistics.fmean(s[:n]) for s in steps], n


def prompts_for(template: Any, batch: int) -> list[str]:
    """``batch`` chat prompts, cycling through ``REQUESTS``."""
    from quanta.frontends.openai.protocol import ChatMessage

    return [
        template.render(
            [
                ChatMessage(role="system", content=SYSTEM),
                ChatMessage(role="user", content=REQUESTS[i % len(REQUESTS)][0]),
            ]
        )
        for i in range(batch)
    ]


def run_structured(
    model_dir: str,
    *,
    batches: Sequence[int],
    max_tokens: int,
    dtype: str | None,
    threads: int | None,
    repeats: int = 3,
) -> StructuredReport:
    """Free and guided runs of the tool-call workload at each batch size."""
    import time

    import torch
    import xgrammar  # noqa: F401  (imported here, so vocab_ms is the description alone)
    from quanta import LLM, SamplingParams, StructuredOutput
    from quanta.runner.cpu import cpu_isa
    from quanta.text.chat_template import ChatTemplate

    if threads is not None:
        torch.set_num_threads(threads)
    load_before = os.getloadavg()[0]
    llm = LLM(model_dir, dtype=dtype, cache={"num_device_blocks": 2048})
    template = ChatTemplate.from_model_dir(model_dir)
    spec = StructuredOutput(json_schema=TOOL_CALL.json_schema())
    started = time.perf_counter()
    llm.engine.grammars.warm()
    vocab_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    llm.engine.grammars(spec)
    compile_ms = (time.perf_counter() - started) * 1e3
    report = StructuredReport(
        model=model_dir,
        dtype=str(llm.engine.runner.dtype).removeprefix("torch."),
        cpu_isa=cpu_isa(),
        threads=torch.get_num_threads(),
        max_tokens=max_tokens,
        repeats=repeats,
        vocab_ms=vocab_ms,
        compile_ms=compile_ms,
    )
    params = {
        guided: SamplingParams(
            max_tokens=max_tokens, temperature=0.0, structured_output=spec if guided else None
        )
        for guided in (False, True)
    }
    for guided in (False, True):  # first calls: the mask thread, the kernels' first shapes
        llm.generate(prompts_for(template, 2), params[guided])
    for batch in batches:
        prompts = prompts_for(template, batch)
        times: dict[bool, list[list[tuple[float, ...]]]] = {False: [], True: []}
        first: dict[bool, list[Any]] = {}
        for repeat in range(repeats):
            for guided in (False, True) if repeat % 2 == 0 else (True, False):
                outs = llm.generate(prompts, params[guided])
                times[guided].append([o.metrics.token_times for o in outs if o.metrics])
                first.setdefault(guided, outs)
        tpots, steps = paired_tpots([*times[False], *times[True]])
        for guided in (False, True):
            outs = first[guided]
            each = [t * 1e3 for t in (tpots[repeats:] if guided else tpots[:repeats])]
            asked = [REQUESTS[i % len(REQUESTS)][1] for i in range(batch)]
            report.runs.append(
                Run(
                    batch=batch,
                    guided=guided,
                    tpot_ms=statistics.median(each),
                    tpot_ms_each=each,
                    steps=steps,
                    valid=sum(is_valid_call(o.text.strip()) for o in outs),
                    right_tool=sum(
                        called_tool(o.text.strip()) == tool
                        for o, tool in zip(outs, asked, strict=True)
                    ),
                    found=sum(contains_valid_call(o.text) for o in outs),
                    total=len(outs),
                    mean_output_tokens=statistics.fmean(len(o.token_ids) for o in outs),
                    stopped=sum(o.finish_reason == "stop" for o in outs),
                )
            )
            report.sample.setdefault("guided" if guided else "free", outs[0].text)
    report.load_average = (load_before, os.getloadavg()[0])
    return report
