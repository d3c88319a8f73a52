"""The commands the README and docs/ show, as a user would copy them.

Every fenced shell block line that starts with a known program, every fenced Python block, and
every inline command with options (`quanta bench engine --model ... --batch 1,8,32`) is one
documented command. Shell lines are kept as text (continuations joined, comments cut) so a
smoke test runs them through bash exactly as written, after ``shrink`` has made them tiny.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = (
    "quanta",
    "locust",
    "curl",
    "bash",
    "source",
    "bench/peer/setup_vllm.sh",
    "bench/lm_eval/run.sh",
)
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
_INLINE = re.compile(r"`((?:quanta|locust) [^`]+)`")
# A value to fill in (NAME, ..., a lone capital: --seed S, =T), an optional part ([--flag]) or a
# choice (a|b): the text shows a command's shape, not one to run as written.
_PLACEHOLDER = re.compile(r"\b[A-Z]{3,}\b|\.\.\.|(?<=[\s=])[A-Z](?=[\s,\"]|$)|\[-|\w\|\w")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    text: str
    python: bool = False

    @property
    def words(self) -> list[str]:
        return self.text.split()


def markdown_files() -> list[Path]:
    """Every markdown file of the project (hidden and generated folders left out)."""
    skip = {".venv", "build", "out", "engines"}
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts[:-1])
    )


def strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` inside quotes is kept)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def documented_commands() -> list[DocCommand]:
    found: dict[str, DocCommand] = {}
    for path in markdown_files():
        name = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        fence: str | None = None
        block: list[tuple[int, str]] = []
        paragraph: list[tuple[int, str]] = []
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):  # NOTE: a list item's block is indented
                _add(found, _inline_commands(name, paragraph))
                paragraph = []
                if fence is None:
                    fence, block = line.lstrip()[3:].strip(), []
                    continue
                _add(found, _block_commands(name, fence, block))
                fence = None
                continue
            if fence is not None:
                block.append((number, line))
            elif line.strip():
                paragraph.append((number, line))
            else:
                _add(found, _inline_commands(name, paragraph))
                paragraph = []
        _add(found, _inline_commands(name, paragraph))
    return list(found.values())


def _add(found: dict[str, DocCommand], commands: list[DocCommand]) -> None:
    for cmd in commands:
        found.setdefault(cmd.text, cmd)


def _inline_commands(name: str, paragraph: list[tuple[int, str]]) -> list[DocCommand]:
    """Inline commands of one paragraph; a command wrapped over lines (a list item's
    continuation, a long option list) is one command, named by the line it starts on."""
    if not paragraph:
        return []
    joined = "\n".join(line for _, line in paragraph)
    commands = []
    for match in _INLINE.finditer(joined):
        text = " ".join(match.group(1).split())
        complete = " --" in text and not text.split()[-1].startswith("-")
        if complete and not _PLACEHOLDER.search(text):
            number = paragraph[joined.count("\n", 0, match.start())][0]
            commands.append(DocCommand(f"{name}:{number}", text))
    return commands


def _block_commands(name: str, fence: str, block: list[tuple[int, str]]) -> list[DocCommand]:
    if fence == "python":
        start = block[0][0] if block else 0
        source = textwrap.dedent("\n".join(line for _, line in block))
        return [DocCommand(f"{name}:{start}", source, True)]
    if fence not in SHELL_FENCES:
        return []
    commands, pending, start = [], "", 0
    for number, raw in block:
        line = strip_comment(raw)
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        text = (pending + line.strip()).strip()
        pending = ""
        first = text.split()[0] if text else ""
        if first in PROGRAMS or (text and fence):
            commands.append(DocCommand(f"{name}:{start}", text))
    return commands


# Option values a smoke test shrinks to (the command keeps its shape, at a tiny size).
TINY_VALUES = {
    "--num-requests": "6",
    "--rate": "4",
    "--rates": "1",
    "--loads": "0.9",
    "--seeds": "0",
    "--run-time": "6s",
    "-u": "2",
    "-r": "2",
    "--num-users": "4",
    "--batch": "1,2",
    "--candidates": "50",
    "--waiting": "50",
    "--prompt-len": "16",
    "--gen-len": "8",
    "--time-scale": "0.05",
    "--repeat": "1",
    "--repeats": "1",
    "--streams": "3",
    "--tokens": "12",
    "--replicas": "3",
    "--abusers": "1",
}


def shrink(text: str, ports: dict[int, int] | None = None) -> str:
    """``text`` at a tiny size: counts and durations down, the opt-125m preset built (or
    served) as opt-tiny (in the same directory), the documented ports (8000/8001/8002/9000)
    mapped to the test's free ones."""
    for flag, value in TINY_VALUES.items():
        text = re.sub(rf"(?<=\s){re.escape(flag)}\s+\S+", f"{flag} {value}", text)
    text = text.replace("make-model opt-125m", "make-model opt-tiny")
    text = text.replace("--preset opt-125m", "--preset opt-tiny")
    for documented, actual in (ports or {}).items():
        text = re.sub(rf"(?<![0-9]){documented}(?![0-9])", str(actual), text)
    return text
