from __future__ import annotations

import ast
import os
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# Engines that configure no dtype take the machine's fastest (bf16 where the CPU has AMX or
# AVX512_BF16). The suite pins fp32 instead, for every engine it starts (servers inherit the
# environment), so its results do not depend on the CI machine's CPU: fp32 is what the parity
# and invariance tests check bit for bit. Tests of the default and of bf16 say so explicitly.
os.environ["QUANTA_DEFAULT_DTYPE"] = "float32"
# Likewise decode attention runs eagerly unless a test asks for the compiled kernel (the
# default where a C++ compiler exists): compiling costs seconds in every process that loads
# a model, servers included, and test_runner_parity runs both kernels against HF.
os.environ["QUANTA_ATTENTION_KERNEL"] = "eager"
# And torch runs one thread in every process of the suite (servers and commands inherit it)
# unless a test or the caller says otherwise: the models are tiny, and a second OpenMP thread
# spinning against the servers and subprocesses a test starts beside it made the engine tests
# four to five times slower on two busy cores. Tests of thread counts set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing in the suite may reach a model hub: offline, a lookup fails at once instead of
# retrying against a network the test machines do not have.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fakes import HashRunner, decode_chars
from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.loop import EngineLoop
from quanta.core.request import Request, RequestStatus, SamplingParams
from quanta.core.speculative import SpeculativeConfig
from quanta.policies import make_policy
from quanta.policies.fastserve import FASTSERVE_RULE

# Property tests draw the same examples on every run (a CI run checks what the author ran,
# and a failure reproduces); HYPOTHESIS_PROFILE=explore draws new ones on each run.
settings.register_profile("repeatable", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


class LoopFactory:
    """Builds fake-runner loops and, at teardown, proves every block went home."""

    def __init__(self) -> None:
        self.loops: list[EngineLoop] = []

    def __call__(
        self,
        *,
        device: int = 64,
        host: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        policy: str = "fcfs",
        decode=decode_chars,
        fail_on: set[str] | None = None,
        prefix_caching: bool = False,
        policy_options: dict[str, object] | None = None,
        speculative: SpeculativeConfig | None = None,
        vocab: int = 50,
        **sched: object,
    ) -> EngineLoop:
        runner = HashRunner(
            device, host, block_size, vocab=vocab, fail_on=fail_on, keep_sources=prefix_caching
        )
        loop = EngineLoop(
            runner=runner,
            policy=make_policy(policy, SchedulerConfig(**sched), **(policy_options or {})),  # type: ignore[arg-type]
            blocks=BlockManager(block_size, device, host, prefix_caching=prefix_caching),
            clock=VirtualClock(),
            max_model_len=max_model_len,
            decode=decode,
            speculative=speculative,
        )
        self.loops.append(loop)
        return loop

    def check_all_free(self) -> None:
        for loop in self.loops:
            loop.stop()
            loop.blocks.check_integrity()
            assert loop.blocks.all_free(), "blocks leaked"


@pytest.hookimpl(tryfirst=True)  # NOTE: before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses the shared server is ``live`` whether or not it says so; on a
    pytest-xdist worker (``scripts/test.sh``), the heaviest modules come first."""
    for item in items:
        if "triton" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.live)
    if hasattr(config, "workerinput"):
        heaviest_first(items)


# -- pytest-xdist: what each worker runs -------------------------------------------------------
# The container image's module (a build, then a server) weighs most, then one holding slow
# tests, then one with live or engine tests, then the rest.
_WEIGHT = {"docker": -1, "slow": 0, "live": 1, "engine": 2}
SHARED_SERVER = "the shared tritonserver"
# FastServe's systems default to the load signal (FCFS until the queue stops draining);
# tests that must see skip-join MLFQ preempt, on tiny loads, ask for the paper's rule.
MLFQ_ALWAYS = FASTSERVE_RULE


def heaviest_first(items: list[pytest.Item]) -> None:
    """Modules ordered by weight (stably: collection order among equals), so the long ones
    start at once and the short ones fill in at the end and the workers finish together. The
    scheduler hands out work units in this order (``--no-loadscope-reorder``)."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def weight(module: list[pytest.Item]) -> int:
        marks = {mark.name for item in module for mark in item.iter_markers()}
        return min((w for name, w in _WEIGHT.items() if name in marks), default=len(_WEIGHT))

    items[:] = [item for module in sorted(modules.values(), key=weight) for item in module]


def shared_server_modules(tests: Path) -> set[str]:
    """Test modules (as node ids name them) with a test or fixture taking ``triton``."""
    found = set()
    for path in tests.rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        functions = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
        if any(arg.arg == "triton" for f in functions for arg in f.args.args):
            found.add(path.relative_to(tests.parent).as_posix())
    return found


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # NOTE: a pytest-xdist hook; before its own
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each module is one unit of work for one worker, so its module-scoped fixtures (servers
    included) are built once, except that the modules on the shared server form one unit, so
    a run starts one tritonserver, not one per worker. (``--dist loadgroup`` with marks would
    say this, but pytest-xdist 3.8 groups by renaming node ids, which pytest 9.2 ignores.)
    A worker that dies fails its test and the run goes on (``module_scheduling``)."""
    from module_scheduling import ModuleScheduling

    shared = shared_server_modules(Path(__file__).parent)
    return ModuleScheduling(config, log, shared, SHARED_SERVER)


# -- shared, built once per session -----------------------------------------------------------
class TinyCheckpoints:
    """Each preset checkpoint built at most once per session (seed 0, float32), on first use.

    Tests read them and never write into them; a test that changes a checkpoint builds its own.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, preset: str) -> Path:
        from quanta.build.checkpoint import ensure_checkpoint

        return ensure_checkpoint(preset, self.root / preset)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def opt_tiny(tiny_checkpoint: TinyCheckpoints) -> Path:
    return tiny_checkpoint("opt-tiny")


@pytest.fixture(scope="session")
def llama_tiny(tiny_checkpoint: TinyCheckpoints) -> Path:
    return tiny_checkpoint("llama-tiny")


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory, opt_tiny: Path):
    """The session's one tritonserver, serving ``opt_tiny`` in every variant the live tests
    need (``serving.shared_models``); started on first use, always stopped."""
    from quanta.frontends.triton.launcher import LaunchError
    from serving import SharedTriton

    shared = SharedTriton(tmp_path_factory.mktemp("triton"), opt_tiny)
    try:
        try:
            shared.start(timeout=150)
        except LaunchError as exc:
            # NOTE: once, on a machine at load 7, one of the repository's Python-backend
            # models logged "serving" and Triton never marked it loaded. A second server is
            # started rather than failing every live test; the first one's log stays in
            # the report (a real failure fails the second start too).
            warnings.warn(f"the shared tritonserver did not start: {exc}", stacklevel=1)
            shared.stop()
            shared = SharedTriton(tmp_path_factory.mktemp("triton"), opt_tiny)
            shared.start()
        yield shared
    finally:
        shared.stop()


# -- fake-runner loops -----------------------------------------------------------------------
@pytest.fixture
def make_loop():
    factory = LoopFactory()
    yield factory
    factory.check_all_free()


def make_requests(
    n: int, *, prompt_len: int | list[int] = 6, max_tokens: int = 8, seed: int = 0, **params: object
) -> list[Request]:
    lens = prompt_len if isinstance(prompt_len, list) else [prompt_len] * n
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[(7 * i + j) % 50 for j in range(lens[i])],
            params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
            arrival_time=float(i) * 1e-3,
            seed=seed + i,
        )
        for i in range(n)
    ]


def make_resident(bm: BlockManager, req: Request) -> Request:
    """``req`` as if its prompt had run: KV for the whole prompt on the device, the token its
    last step sampled appended (one to decode next), RUNNING."""
    tokens = len(req.prompt_token_ids)
    req.num_computed_tokens = tokens
    req.append_token(1, 0.0)
    req.set_status(RequestStatus.RUNNING)
    assert bm.allocate_slots(req.request_id, tokens) is not None
    return req


def move_to_host(bm: BlockManager, req: Request) -> Request:
    """A resident ``req`` swapped out: its blocks on the host, SWAPPED."""
    assert bm.swap_out(req.request_id) is not None
    req.set_status(RequestStatus.SWAPPED)
    return req
