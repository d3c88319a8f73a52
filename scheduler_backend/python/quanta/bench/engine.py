"""``quanta bench engine``: prefill and decode tokens/s against HF transformers.

Both engines get the same checkpoint, dtype, thread count and token ids; the table and the
JSON say which dtype, linear kernel and CPU instruction set ran. Quanta runs through
its full loop (scheduling, block tables, paged attention), so the number is what a server
gets, not a bare forward pass. Each of ``--repeat`` rounds runs a prefill-only run (one
token) and a full run (``gen_len`` tokens) back to back; decode throughput comes from the
median of the rounds' own differences, prefill throughput from the shortest prefill-only run
(``paired_rates``). Against a built engine the run fits itself to the limits the engine was
built for (``fit_to_engine``) and says what it changed.

With ``--preset NAME`` instead of a checkpoint (a real shape such as ``llama-3-8b``), both
engines get random weights of that shape made on the device: no checkpoint is written or read
(``model_source``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from quanta.build.checkpoint import write_model_files
from quanta.build.manifest import EngineManifestError, read_manifest
from quanta.core.config import (
    AttentionKernel,
    CacheConfig,
    EngineConfig,
    LinearKernel,
    LoadFormat,
    SchedulerConfig,
)
from quanta.core.request import SamplingParams
from quanta.frontends.engine import Engine, build_engine
from quanta.metrics import json_safe
from quanta.runner.quantized import resident_weight_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BenchRow:
    batch: int
    quanta_prefill_tps: float
    quanta_decode_tps: float
    hf_prefill_tps: float | None
    hf_decode_tps: float | None
    dtype: str = "float32"
    linear_kernel: str = "torch"
    cpu_isa: str = ""
    # below fp32: share of greedy tokens equal to an fp32 engine's at the same position
    greedy_agreement_fp32: float | None = None
    attention_kernel: str = "eager"
    quantized_kernel: str = "none"
    weight_bytes: int = 0  # weights resident in memory (packed or quantized), once each
    device: str = "cpu"  # where both engines ran: "cpu", or the GPU's name
    layer_path: str = "layer-by-layer"  # "chain": decode steps' layers in one native call
    linear_tiles: str = "none"  # "amx": the panel kernel's wider products on AMX tiles


STEP_TOKENS = 4096  # tokens per step on a plain checkpoint: a batch's prompts in few steps


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What one run measures: batch sizes and the step token budget, with a note per change
    made to fit an engine's build limits."""

    batches: list[int]
    max_num_batched_tokens: int
    notes: tuple[str, ...] = ()


def fit_to_engine(model_dir: Path, batches: list[int], prompt_len: int, gen_len: int) -> BenchPlan:
    """The run ``batches`` ask for, within the limits of the engine at ``model_dir``.

    Why clamp rather than refuse: an engine is built for its serving load, and a benchmark of
    it should measure what it can serve; batch sizes over ``max_batch_size`` become that size
    and the step budget becomes ``max_num_tokens`` (longer prefills run in chunks, as served).
    A request longer than ``max_seq_len`` cannot be shortened without changing what is
    measured, so that raises ``EngineManifestError`` naming the ``quanta build`` option.
    """
    manifest = read_manifest(model_dir)
    if manifest is None:
        return BenchPlan(list(batches), STEP_TOKENS)
    where, limits = f"engine {manifest.name!r}", manifest.limits
    if prompt_len + gen_len > limits.max_seq_len:
        raise EngineManifestError(
            f"--prompt-len {prompt_len} + --gen-len {gen_len} exceed the max_seq_len "
            f"{limits.max_seq_len} {where} was built for: shorten them or rebuild with "
            f"--max-seq-len {prompt_len + gen_len}"
        )
    notes = []
    over = [b for b in batches if b > limits.max_batch_size]
    fitted = [b for b in batches if b <= limits.max_batch_size]
    if over:
        fitted += [] if limits.max_batch_size in fitted else [limits.max_batch_size]
        notes.append(
            f"batch {', '.join(map(str, over))} is over the max_batch_size "
            f"{limits.max_batch_size} {where} was built for: measuring "
            f"{', '.join(map(str, fitted))} (rebuild with --max-batch-size {max(over)} "
            "to measure it)"
        )
    tokens = min(STEP_TOKENS, limits.max_num_tokens)
    if max(fitted) * prompt_len > tokens:
        notes.append(
            f"step budget {tokens} tokens, the max_num_tokens {where} was built for: "
            f"batch {max(fitted)} prefills in chunks (rebuild with --max-num-tokens "
            f"{max(fitted) * prompt_len} to prefill it in one step)"
        )
    return BenchPlan(fitted, tokens, tuple(notes))


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What a benchmark loads: a directory, how its weights come (``"dummy"``: random, made
    on the device), and the name its table shows."""

    path: Path
    load_format: LoadFormat
    name: str


@contextlib.contextmanager
def model_source(model_dir: Path | None, preset: str | None = None) -> Iterator[ModelSource]:
    """A checkpoint or engine directory as it is, or a preset's shape with no weights on disk.

    A preset gets a temporary directory with its config.json and tokenizer only (removed on
    exit): Quanta makes its weights on the device (``load_format="dummy"``) and HF builds its
    model from the config (``load_hf``), so an 8B or 13B shape costs no disk and no read."""
    if (model_dir is None) == (preset is None):
        raise ValueError("give a model directory or a preset (not both)")
    if model_dir is not None:
        yield ModelSource(model_dir, "auto", model_dir.name)
        return
    assert preset is not None
    with tempfile.TemporaryDirectory(prefix=f"quanta-{preset}-") as tmp:
        yield ModelSource(write_model_files(preset, Path(tmp)), "dummy", preset)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _time_quanta(engine: Engine, prompts: list[list[int]], gen_len: int) -> float:
    return run_quanta(engine, prompts, gen_len)[0]


def run_quanta(
    engine: Engine, prompts: list[list[int]], gen_len: int
) -> tuple[float, list[tuple[int, ...]]]:
    """(seconds, greedy tokens per prompt) of one run through the full loop.

    The runs repeat the same prompts, so the prefix cache is emptied first: otherwise every
    run after the first would find its prompts cached and time a prefill it never did."""
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    loop = engine.loop
    loop.reset_prefix_cache()
    start = time.perf_counter()
    streams = [loop.submit(engine.make_request(p, params)) for p in prompts]
    loop.run_until_idle()
    elapsed = time.perf_counter() - start
    tokens = []
    for s in streams:
        assert s is not None
        res = s.result(timeout=0)
        if res.error is not None:
            raise res.error
        tokens.append(res.token_ids)
    return elapsed, tokens


def _agreement(ours: list[tuple[int, ...]], reference: list[tuple[int, ...]]) -> float:
    """Share of positions where two greedy runs chose the same token."""
    pairs = [
        (a, b) for x, y in zip(ours, reference, strict=True) for a, b in zip(x, y, strict=True)
    ]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def time_hf_generate(model: torch.nn.Module, prompts: list[list[int]], gen_len: int) -> float:
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    _synchronize(ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            do_sample=False,
            pad_token_id=0,
        )
    _synchronize(ids.device)
    return time.perf_counter() - start


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _synchronize(device: torch.device) -> None:
    """HF's generate may return while a GPU still computes; the clock waits for it. (Quanta's
    loop reads every step's tokens back to the host, so its runs end synchronized.)"""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def paired_rates(
    rounds: list[tuple[float, float]], batch: int, prompt_len: int, gen_len: int
) -> tuple[float, float]:
    """(prefill, decode) tokens/s from rounds of (prefill-only seconds, full-run seconds).

    Why pairs: a round's two runs go back to back, so a load that slows one likely slows the
    other, and a round's decode time is its own full run minus its own prefill. The best full
    run minus the best prefill run of other rounds can be nearly nothing when every prefill
    run was slowed, and the decode rate then several times too high. Why the median of the
    rounds' differences and not the shortest: other processes only add time to a run, so the
    shortest prefill run counts, but a slowed prefill run shortens its round's difference, and
    the shortest difference is never longer than best full minus best prefill: it would keep
    that error. A round whose full run was not longer than its prefill run measured nothing
    and is dropped; with none left the decode rate is NaN (the caller says so).
    ``bench/peer/vllm_engine.py`` does the same for vLLM."""
    prefill_s, decode_s = paired_seconds(rounds)
    return batch * prompt_len / prefill_s, batch * (gen_len - 1) / decode_s


def paired_seconds(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """(prefill, decode) seconds from rounds of (prefill-only, full-run) seconds, as
    ``paired_rates`` takes them: the shortest prefill-only run, and the median of the rounds'
    own differences (NaN when no full run outlasted its prefill-only run)."""
    decode_s = [full - prefill for prefill, full in rounds if full > prefill]
    return min(p for p, _ in rounds), statistics.median(decode_s) if decode_s else math.nan


def _say_no_decode(engine: str, batch: int, rates: tuple[float, float]) -> None:
    if math.isnan(rates[1]):
        Console(stderr=True).print(
            f"note: {engine} batch {batch}: no round's full run took longer than its "
            "prefill-only run, so no decode rate (NaN)",
            highlight=False,
        )


def run_engine_bench(
    model_dir: Path | None,
    batches: list[int],
    prompt_len: int,
    gen_len: int,
    *,
    compare_hf: bool = True,
    threads: int | None = None,
    output: Path | None = None,
    repeat: int = 3,
    dtype: str | None = None,
    linear_kernel: LinearKernel = "auto",
    attention_kernel: AttentionKernel = "auto",
    quantization: str | None = None,
    prefix_caching: bool = True,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    preset: str | None = None,
) -> list[BenchRow]:
    """Measure every batch size, print a table, optionally write JSON.

    Against a built engine the batch sizes and step budget are fitted to its limits first,
    and each change is printed (``fit_to_engine``). Every run computes its prompts in full;
    ``prefix_caching`` only says whether the cache's bookkeeping (naming each full block) is
    part of what is timed. ``preset`` instead of ``model_dir``: random weights of its shape,
    made on the device (``model_source``)."""
    if threads:
        torch.set_num_threads(threads)
    with model_source(model_dir, preset) as source:
        plan = fit_to_engine(source.path, batches, prompt_len, gen_len)
        for note in plan.notes:
            Console(stderr=True).print(f"note: {note}", highlight=False)
        engine = build_engine(
            bench_engine_config(
                source,
                plan,
                prompt_len + gen_len,
                dtype=dtype,
                linear_kernel=linear_kernel,
                attention_kernel=attention_kernel,
                quantization=quantization,
                enable_prefix_caching=prefix_caching,
                device=device,
                tensor_parallel_size=tensor_parallel_size,
            )
        )
        rows = _measure(engine, source, plan.batches, prompt_len, gen_len, compare_hf, repeat)
        engine.runner.close()
    _print(rows, source.name, prompt_len, gen_len, tensor_parallel_size)
    if output is not None:
        # NOTE: a decode rate no round measured is NaN: null in the file, which stays strict JSON
        output.write_text(json.dumps(json_safe([asdict(r) for r in rows]), indent=2))
    return rows


def bench_engine_config(
    source: ModelSource, plan: BenchPlan, seq_len: int, **engine: object
) -> EngineConfig:
    """The engine a benchmark runs: KV blocks for the largest batch's sequences of
    ``seq_len`` tokens (none on the host), the plan's step budget, ``engine``'s options."""
    max_batch = max(plan.batches)
    blocks = max_batch * seq_len // 16 + 2 * max_batch
    return EngineConfig.model_validate(
        {
            "model": str(source.path),
            "load_format": source.load_format,
            "cache": CacheConfig(num_device_blocks=blocks, num_host_blocks=0),
            "scheduler": SchedulerConfig(
                max_num_batched_tokens=plan.max_num_batched_tokens, max_num_seqs=max_batch
            ),
            **engine,
        }
    )


def _measure(
    engine: Engine,
    source: ModelSource,
    batches: list[int],
    prompt_len: int,
    gen_len: int,
    compare_hf: bool,
    repeat: int,
) -> list[BenchRow]:
    info = engine.describe()
    resident = resident_weight_bytes(engine.runner.model)
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    if compare_hf and info["quantized_kernel"] != "none":
        Console(stderr=True).print("note: no HF peer: transformers cannot read quantized weights")
        compare_hf = False
    hf = load_hf(source, engine.runner.dtype, engine.runner.device) if compare_hf else None
    reference = None
    if engine.runner.dtype != torch.float32:  # report what the faster dtype changes
        reference = _fp32_reference(engine.config, source)
    rows = []
    for b in batches:
        prompts = _prompts(b, prompt_len, vocab)
        # NOTE: ``repeat`` rounds per engine, each a prefill-only run then a full run, so
        # that a round's decode time is the difference of two runs under the same load
        # (``paired_rates``).
        _time_quanta(engine, prompts[:1], 2)  # warm-up
        rounds, tokens = [], []
        for _ in range(repeat):
            prefill_s = _time_quanta(engine, prompts, 1)
            full_s, tokens = run_quanta(engine, prompts, gen_len)
            rounds.append((prefill_s, full_s))
        q_pre, q_dec = paired_rates(rounds, b, prompt_len, gen_len)
        _say_no_decode("Quanta", b, (q_pre, q_dec))
        h_pre = h_dec = None
        if hf is not None:
            time_hf_generate(hf, prompts[:1], 2)
            hf_rounds = [
                (time_hf_generate(hf, prompts, 1), time_hf_generate(hf, prompts, gen_len))
                for _ in range(repeat)
            ]
            h_pre, h_dec = paired_rates(hf_rounds, b, prompt_len, gen_len)
            _say_no_decode("HF", b, (h_pre, h_dec))
        agreement = None
        if reference is not None:
            agreement = _agreement(tokens, run_quanta(reference, prompts, gen_len)[1])
        kernel = (info["dtype"], info["linear_kernel"], info["cpu_isa"])
        rows.append(
            BenchRow(
                b,
                q_pre,
                q_dec,
                h_pre,
                h_dec,
                *kernel,
                agreement,
                info["attention_kernel"],
                info["quantized_kernel"],
                resident,
                _device_name(engine.runner.device),
                info["layer_path"],
                info["linear_tiles"],
            )
        )
    return rows


def _fp32_reference(config: EngineConfig, source: ModelSource) -> Engine | None:
    """An fp32 engine of the same model, or None (with a note) where none can be had.

    An engine directory holds its weights in its own dtype only, so for one the reference is
    built from the checkpoint it was built from, while that is still where the manifest says.
    Random weights made in another dtype are other weights: a preset has no reference.
    """
    if source.load_format == "dummy":
        Console(stderr=True).print("note: random weights, so no greedy agreement with fp32")
        return None
    manifest = read_manifest(source.path)
    checkpoint = source.path if manifest is None else Path(manifest.source.path)
    try:
        # NOTE: one process holds one tensor-parallel group; the reference runs in one rank.
        # The panel kernel runs bf16 only: an fp32 reference of a ``native`` run takes the
        # kernel fp32 would have had
        update: dict[str, object] = {
            "dtype": "float32",
            "model": str(checkpoint),
            "tensor_parallel_size": 1,
        }
        if config.linear_kernel == "native":
            update["linear_kernel"] = "auto"
        return build_engine(config.model_copy(update=update))
    except (OSError, EngineManifestError) as exc:
        Console(stderr=True).print(
            f"note: no fp32 reference, so no greedy agreement with fp32: {exc}", highlight=False
        )
        return None


def load_hf(source: ModelSource, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """HF transformers' model of ``source``: its checkpoint, or for a preset the model built
    from its config with HF's own random initialisation, straight on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.load_format == "auto":
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
        return model.to(device).eval()
    with device:
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(source.path), dtype=dtype
        )
    return model.eval()


def _print(rows: list[BenchRow], name: str, prompt_len: int, gen_len: int, ranks: int = 1) -> None:
    first = rows[0]
    threads = f"{torch.get_num_threads()} threads" + (f" x {ranks} ranks" if ranks > 1 else "")
    table = Table(
        title=f"{name}: prompt {prompt_len}, generate {gen_len}, "
        f"{threads}, {first.dtype}, linears {first.linear_kernel}"
        f"{' (+amx tiles)' if first.linear_tiles == 'amx' else ''}, "
        f"decode attention {first.attention_kernel}, layers {first.layer_path}, "
        f"quantized {first.quantized_kernel}, "
        f"weights {first.weight_bytes / 1e6:.1f} MB, "
        f"{'CPU ' + first.cpu_isa if first.device == 'cpu' else first.device} (tokens/s)"
    )
    for col in (
        "batch",
        "quanta prefill",
        "hf prefill",
        "ratio",
        "quanta decode",
        "hf decode",
        "ratio",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.batch),
            f"{r.quanta_prefill_tps:.0f}",
            _fmt(r.hf_prefill_tps),
            _ratio(r.quanta_prefill_tps, r.hf_prefill_tps),
            f"{r.quanta_decode_tps:.1f}",
            _fmt(r.hf_decode_tps),
            _ratio(r.quanta_decode_tps, r.hf_decode_tps),
        )
    Console().print(table)
    if first.greedy_agreement_fp32 is not None:
        shares = ", ".join(f"batch {r.batch}: {r.greedy_agreement_fp32:.1%}" for r in rows)
        Console().print(f"greedy tokens equal to fp32's at the same position: {shares}")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _ratio(ours: float, peer: float | None) -> str:
    return "-" if not peer else f"{ours / peer:.2f}x"
