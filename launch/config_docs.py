"""Generate docs/config.md from the pydantic models: every section, key, type, default and description.

.venv/bin/python -m launch.config_docs > docs/config.md
"""

from __future__ import annotations

import functools
import operator
import re
import types
import typing

from pydantic import BaseModel

from common.config import TandemConfig


def _without_validators(annotation: typing.Any) -> typing.Any:
    """`dict[str, Annotated[int, BeforeValidator(f)]]` -> `dict[str, int]`: the type a user writes, not its checks."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _without_validators(typing.get_args(annotation)[0])
    args = typing.get_args(annotation)
    stripped = tuple(_without_validators(arg) for arg in args)
    if not args or typing.get_origin(annotation) is typing.Literal or stripped == args:
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, stripped)
    return typing.get_origin(annotation)[stripped]


def _type_name(annotation: typing.Any) -> str:
    annotation = _without_validators(annotation)
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    return text or re.sub(r"common\.config\.(\w+\.)?", "", str(annotation).replace("typing.", ""))


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
        "Generated from `common/config/` by `python -m launch.config_docs`; do not edit by hand.",
        "One TOML file describes a run; each role reads its own section. Any key can be overridden on the",
        'command line as `--section.key VALUE` (values parse as TOML: `1e-6`, `true`, `"text"`).',
        "",
        "Every value is checked at load, and each problem is one line naming the key (`tandem config FILE` shows",
        "them): floats must be finite (TOML and JSON read `nan` and `inf`, no key takes them); integers, numbers",
        'and booleans are written as such (`100`, not `"100"`; `true`, not `1`); integers fit in 64 bits;',
        "timeouts are at most a week. A problem in a command-line override names the override",
        "(`tandem: --learner.lrr 1: unknown key; did you mean --learner.lr?`). The paths a run needs (`model.path`,",
        "`env.source` and its first 100 rows, `run.curve_keys_dir`) are checked on this machine by `tandem config` and",
        "`tandem run` before anything starts (`tandem config FILE --no-path-checks` skips them, for a config of other",
        "machines), and by each role when it starts, on its machine.",
        "",
    ]
    for section_name, section_field in TandemConfig.model_fields.items():
        lines += _section_lines(section_name, section_field.annotation)
    return "\n".join(lines)


def _is_section(annotation: typing.Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _section_lines(dotted: str, model: type[BaseModel]) -> list[str]:
    """The table of one section, then those of its subsections (`[learner.lora]`), each a heading of its own."""
    lines = [f"{'#' * (2 + dotted.count('.'))} `[{dotted}]`", "", (model.__doc__ or "").strip(), ""]
    lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    subsections = []
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            subsections.append((f"{dotted}.{name}", field.annotation))
            default = "—"
        else:
            default = field.get_default(call_default_factory=True)
            default = default if default is not None else "—"
        description = (field.description or "").replace("|", "\\|")
        lines.append(
            f"| `{name}` | `{_type_name(field.annotation)}` | `{default}` | {_constraints(field)} | {description} |"
        )
    lines.append("")
    for sub_name, sub_model in subsections:
        lines += _section_lines(sub_name, sub_model)
    return lines


if __name__ == "__main__":
    print(render(), end="")
