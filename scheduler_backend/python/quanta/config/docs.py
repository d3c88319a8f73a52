"""The docs' option tables, rendered from the config models.

``docs/serving.md`` holds one table per model between ``<!-- options:NAME -->`` and
``<!-- /options:NAME -->``, and the ``config.pbtxt`` parameters' table (the fields marked
``Pbtxt``) between ``<!-- parameters:config.pbtxt -->`` and its closing marker;
``python -m quanta.config.docs`` rewrites them from the models' fields, and ``--check`` only
reports whether they are current (a test runs that check).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from quanta.config.cli import field_envvar, field_flags, split_default
from quanta.config.models import GROUPS, BackendArgs
from quanta.config.pbtxt import parameters

DOC = Path("docs/serving.md")


def table_name(model: type[BaseModel]) -> str:
    """``EngineArgs`` -> ``engine``: the name in the table's markers."""
    return model.__name__.removesuffix("Args").lower()


def render_table(model: type[BaseModel]) -> str:
    """A markdown table of ``model``'s options: flag, default and meaning."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for name, info in model.model_fields.items():
        flags = ", ".join(
            f"`{f}`" for spelling in field_flags(name, info) for f in spelling.split("/")
        )
        shown, meaning = _default(info.default, info.description or "")
        meaning = meaning.replace("|", "\\|")
        if envvar := field_envvar(info):
            meaning += f" (env: `{envvar}`)"
        rows.append(f"| {flags} | {shown} | {meaning} |")
    return "\n".join(rows)


def render_parameters() -> str:
    """A markdown table of the ``config.pbtxt`` parameters: key, default, meaning, and the
    command-line option of the same field (none for ``BackendArgs``)."""
    rows = ["| parameter | default | meaning | option |", "|---|---|---|---|"]
    for key, param in parameters().items():
        if param.info.is_required():
            shown, meaning = "required", split_default(param.description)[0]
        else:
            default = None if param.info.default == "" else param.info.default
            shown, meaning = _default(default, param.description)
        meaning = meaning.replace("|", "\\|")
        flag = field_flags(param.field, param.info)[0].split("/")[0]
        option = f"`{flag}`" if param.model is not BackendArgs else ""
        rows.append(f"| `{key}` | {shown} | {meaning} | {option} |")
    return "\n".join(rows)


def _default(default: object, description: str) -> tuple[str, str]:
    """The default column and the meaning: an option that is unset by default says in its
    description what applies then (``... (default: 128)``), which moves to the column."""
    if default is not None and default is not PydanticUndefined:
        return f"`{default}`", description
    meaning, unset = split_default(description)
    return unset or "", meaning


def render_doc(text: str) -> str:
    """``text`` with every marked table replaced by the one the models give now."""
    tables = {f"options:{table_name(model)}": render_table(model) for model in GROUPS}
    tables["parameters:config.pbtxt"] = render_parameters()
    for name, table in tables.items():
        pattern = re.compile(
            rf"(<!-- {re.escape(name)} -->\n)(?:.*?\n)?(<!-- /{re.escape(name)} -->)", re.DOTALL
        )
        if not pattern.search(text):
            raise ValueError(f"no <!-- {name} --> markers")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    """Rewrite ``docs/serving.md``'s option tables (``--check``: only say if they differ)."""
    current = DOC.read_text(encoding="utf-8")
    wanted = render_doc(current)
    if current == wanted:
        print(f"{DOC}: option tables are current")
        return 0
    if "--check" in argv:
        print(f"{DOC}: option tables differ from quanta.config; run python -m quanta.config.docs")
        return 1
    DOC.write_text(wanted, encoding="utf-8")
    print(f"{DOC}: option tables rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
