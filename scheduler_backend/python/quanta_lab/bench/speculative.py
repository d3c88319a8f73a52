"""``quanta bench speculative``: what prompt lookup buys where the output copies its input,
and what it costs where it does not, on a real model.

Two workloads, each run with and without ``--speculative-config`` on engines of the same
model in the same process, alternating, greedy or seeded (so the outputs must be equal, and
are checked):

- ``edit``: input-grounded. Each prompt is a paragraph of public-domain text (the Gettysburg
  Address and the Preamble, ``quality_data``) with a few words misspelt, and the model is asked
  to write it out corrected: most of the answer is a copy of the prompt.
- ``chat``: the chat questions of ``bench quality`` (short free answers that quote nothing),
  where lookups seldom find anything and drafts seldom survive.

In fp32 both answer token for token alike. In bf16 a verification runs its k+1 tokens as one
chunk, whose attention and products round differently from the one-token decode path, so at a
near-tie the greedy pick can differ (as it can for a request recomputed after a preemption):
the report counts the outputs that are equal.

Decode speed is taken per request from its token times (first token to last), so prefill,
which speculation does not touch, is left out; requests run one at a time for batch 1, or in
groups of ``batch``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from quanta_lab.bench.quality_data import CHAT_QUESTIONS, PERPLEXITY_TEXT

EDIT_INSTRUCTION = (
    "Correct the spelling mistakes in the following text. Write out the whole corrected text "
    "and nothing else.\n\n"
)


def misspell(text: str, every: int = 9) -> str:
    """``text`` with every ``every``-th word of five letters or more given two letters swapped
    (deterministic, so every run sees the same prompts)."""
    words = text.split(" ")
    count = 0
    for i, word in enumerate(words):
        if len(word) >= 5 and word.isalpha():
            count += 1
            if count % every == 0:
                words[i] = word[0] + word[2] + word[1] + word[3:]
    return " ".join(words)


def edit_prompts() -> list[str]:
    """One prompt per paragraph of the text (one-line paragraphs joined)."""
    paragraphs = [" ".join(p.split()) for p in PERPLEXITY_TEXT.split("\n\n") if p.strip()]
    return [EDIT_INSTRUCTION + misspell(p) for p in paragraphs]


WORKLOADS = {"edit": edit_prompts, "chat": lambda: list(CHAT_QUESTIONS)}


@dataclass
class Run:
    workload: str
    batch: int
    speculative: bool
    decode_tok_s: float  # output tokens after the first / seconds from first to last, summed
    mean_output_tokens: float
    steps: int
    drafts: int  # request steps that verified drafts
    draft_tokens: int
    accepted_tokens: int

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_verification(self) -> float | None:
        """Tokens a request step that verified drafts yielded (its own one included)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None


@dataclass
class SpeculativeReport:
    model: str
    dtype: str
    cpu_isa: str
    threads: int
    config: dict[str, Any]
    max_tokens: int
    temperature: float
    runs: list[Run] = field(default_factory=list)
    # per workload@batch: (outputs equal to plain decoding's, outputs)
    identical: dict[str, tuple[int, int]] = field(default_factory=dict)

    def speedup(self, workload: str, batch: int) -> float | None:
        pick = {r.speculative: r for r in self.runs if (r.workload, r.batch) == (workload, batch)}
        if len(pick) < 2 or pick[False].decode_tok_s <= 0:
            return None
        return pick[True].decode_tok_s / pick[False].decode_tok_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for run, row in zip(self.runs, data["runs"], strict=True):
            row["acceptance"] = run.acceptance
            row["tokens_per_verification"] = run.tokens_per_verification
        data["speedup"] = {
            f"{r.workload}@{r.batch}": self.speedup(r.workload, r.batch)
            for r in self.runs
            if r.speculative
        }
        return data


def decode_rate(token_times: Sequence[Sequence[float]]) -> float:
    """Tokens per second after the first token, over the requests' own decode spans."""
    tokens = sum(len(t) - 1 for t in token_times if len(t) > 1)
    seconds = sum(t[-1] - t[0] for t in token_times if len(t) > 1)
    return tokens / seconds if seconds > 0 else 0.0


def run_speculative(
    model_dir: str,
    *,
    workloads: Sequence[str],
    batches: Sequence[int],
    max_tokens: int,
    config: dict[str, Any],
    dtype: str | None,
    threads: int | None,
    repeats: int = 1,
    temperature: float = 0.0,
) -> SpeculativeReport:
    """Plain and speculative runs of each workload at each batch size."""
    import torch
    from quanta import LLM, SamplingParams
    from quanta.frontends.openai.protocol import ChatMessage
    from quanta.runner.cpu import cpu_isa
    from quanta.text.chat_template import ChatTemplate

    if threads is not None:
        torch.set_num_threads(threads)
    engines = {
        spec: LLM(
            model_dir,
            dtype=dtype,
            cache={"num_device_blocks": 1024},
            enable_prefix_caching=False,
            speculative_config=config if spec else None,
        )
        for spec in (False, True)
    }
    template = ChatTemplate.from_model_dir(model_dir)
    report = SpeculativeReport(
        model=model_dir,
        dtype=str(engines[False].engine.runner.dtype).removeprefix("torch."),
        cpu_isa=cpu_isa(),
        threads=torch.get_num_threads(),
        config=config,
        max_tokens=max_tokens,
        temperature=temperature,
    )
    # NOTE: sampled runs are seeded: both engines draw the same tokens (runner/speculative.py)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    for llm in engines.values():
        llm.generate("warm up", SamplingParams(max_tokens=4, temperature=0.0))
    for workload in workloads:
        texts = WORKLOADS[workload]()
        for batch in batches:
            # NOTE: a batch larger than the workload repeats its prompts (greedy: the copies
            # answer alike, and each is a request of its own)
            texts_b = (texts * -(-batch // len(texts)))[: max(batch, len(texts))]
            prompts = [template.render([ChatMessage(role="user", content=p)]) for p in texts_b]
            times: dict[bool, list[list[float]]] = {False: [], True: []}
            outputs: dict[bool, list[list[int]]] = {False: [], True: []}
            before = {s: engines[s].engine.loop.stats() for s in engines}
            for _ in range(repeats):
                for lo in range(0, len(prompts), batch):
                    group = prompts[lo : lo + batch]
                    for spec in (False, True):  # alternating: the machine's drift hits both
                        outs = engines[spec].generate(group, params)
                        times[spec] += [list(o.metrics.token_times) for o in outs if o.metrics]
                        outputs[spec] += [o.token_ids for o in outs]
            for spec, llm in engines.items():
                after = llm.engine.loop.stats()
                report.runs.append(
                    Run(
                        workload=workload,
                        batch=batch,
                        speculative=spec,
                        decode_tok_s=decode_rate(times[spec]),
                        mean_output_tokens=statistics.fmean(len(o) for o in outputs[spec]),
                        steps=after.num_steps - before[spec].num_steps,
                        drafts=after.spec_num_drafts - before[spec].spec_num_drafts,
                        draft_tokens=after.spec_num_draft_tokens
                        - before[spec].spec_num_draft_tokens,
                        accepted_tokens=after.spec_num_accepted_tokens
                        - before[spec].spec_num_accepted_tokens,
                    )
                )
            same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
            report.identical[f"{workload}@{batch}"] = (same, len(outputs[False]))
    return report
