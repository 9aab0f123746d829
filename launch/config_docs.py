"""Generate docs/config.md from the pydantic models: every section, key, type, default and description.

.venv/bin/python -m launch.config_docs > docs/config.md
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

from common.config import TandemConfig


def _type_name(annotation: typing.Any) -> str:
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    return text or str(annotation).replace("typing.", "")


def _constraints(field: typing.Any) -> str:
    parts = []
    for item in field.metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                parts.append(f"{symbol} {getattr(item, attr)}")
    return ", ".join(parts)


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `common/config.py` by `python -m launch.config_docs`; do not edit by hand.",
        "One TOML file describes a run; each role reads its own section. Any key can be overridden on the",
        'command line as `--section.key VALUE` (values parse as TOML: `1e-6`, `true`, `"text"`).',
        "",
    ]
    for section_name, section_field in TandemConfig.model_fields.items():
        model: type[BaseModel] = section_field.annotation
        lines += [f"## `[{section_name}]`", "", (model.__doc__ or "").strip(), ""]
        lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            default = field.default if field.default is not None else "—"
            description = (field.description or "").replace("|", "\\|")
            lines.append(
                f"| `{name}` | `{_type_name(field.annotation)}` | `{default}` | {_constraints(field)} | {description} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
