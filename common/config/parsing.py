"""Reading a config: TOML files, `--section.key VALUE` overrides, one-line errors, the resolved copy."""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from common.config.base import MAX_CONFIG_BYTES, ConfigError, _toml_type
from common.config.tandem import TandemConfig

_SECTION_RULE = re.compile(r"^[a-z_]+: ")  # a section's own rule names its key first: "group_size: must be ..."
_KEY_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OVERRIDE_FORM = "overrides look like --section.key VALUE or --section.key=VALUE"


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sections() -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in TandemConfig.model_fields.items()}


def _close_name(loc: list[str]) -> str | None:
    """The dotted section or key that the unknown one at `loc` most likely meant: the close name in the same place,
    else the same name in the section that has it (`learner.temperature` -> `generator.temperature`), else None."""
    sections, name = _sections(), loc[-1]
    elsewhere = [f"{section}.{name}" for section, model in sections.items() if name in model.model_fields]
    if len(loc) == 1:
        close = elsewhere or difflib.get_close_matches(name, sections, n=1)
        return close[0] if close else None
    model = _section_at(loc[:-1])
    allowed = list(model.model_fields) if model is not None else []
    parent = ".".join(loc[:-1])
    close = [f"{parent}.{key}" for key in difflib.get_close_matches(name, allowed, n=1)] or elsewhere
    return close[0] if close else None


def _section_at(loc: list[str]) -> type[BaseModel] | None:
    """The section (or subsection: `learner.lora`) at a dotted location, or None where there is none."""
    model: Any = _sections().get(loc[0]) if loc else None
    for part in loc[1:]:
        field = model.model_fields.get(part) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


def _unknown_key_hint(loc: list[str], override: str | None = None) -> str:
    """What to write instead of the unknown key or section at `loc`: the close name (`'capacity'` in the same
    section, `'generator.temperature'` in another; for an override the whole override key, `--learner.lr`), else
    the names allowed there. `override`: the dotted key of the override that wrote it (at or below `loc`)."""
    what = "unknown section" if len(loc) == 1 else "unknown key"
    close = _close_name(loc)
    if close and override:  # the rest of the override's key, below an unknown section that names a section
        rest = override[len(".".join(loc)) :] if close.count(".") == len(loc) - 1 else ""
        return f"{what}; did you mean --{close}{rest}?"
    if close:
        parent = ".".join(loc[:-1]) + "."
        same_section = len(loc) >= 2 and close.startswith(parent)
        return f"{what}; did you mean '{close.removeprefix(parent) if same_section else close}'?"
    if len(loc) == 1:
        return f"{what} ({', '.join(_sections())})"
    model = _section_at(loc[:-1])
    allowed = list(model.model_fields) if model is not None else []
    return f"{what} (keys of [{'.'.join(loc[:-1])}]: {', '.join(allowed)})"


def _override_at(loc: list[str], written: dict[str, str]) -> str | None:
    """The dotted key of the override that wrote the value at `loc` (`learner.lrr`), or one below it (an unknown
    section `lerner` that only `--lerner.lr` wrote); None when the config file wrote it."""
    dotted = ".".join(loc)
    return next((key for key in written if key == dotted or key.startswith(f"{dotted}.")), None)


def _naming_override(line: str, written: dict[str, str]) -> str:
    """`learner.lr: must be > 0` -> `--learner.lr -1: must be > 0` when an override set learner.lr (or a key
    below it: `--learner.lr.x 1` made it a table)."""
    key, _, rest = line.partition(": ")
    override = _override_at(key.split("."), written)
    return f"{written[override]}: {rest}" if override else line


def _error_lines(item: Any, written: dict[str, str]) -> list[str]:
    """One pydantic error as lines `section.key: what is wrong (got VALUE)`, or `--section.key VALUE: what is
    wrong` when an override (`written`: dotted key -> the override as written) set the value."""
    loc = [str(part) for part in item["loc"]]
    message = item["msg"].removeprefix("Value error, ")
    if not loc:  # TandemConfig's cross-role rules: one problem a line, each naming its key
        return [_naming_override(line, written) for line in message.splitlines()]
    if item["type"] == "extra_forbidden":
        override = _override_at(loc, written)
        return [f"{written[override] if override else '.'.join(loc)}: {_unknown_key_hint(loc, override)}"]
    if item["type"] == "model_type":
        kind = _toml_type(item["input"])
        return [f"{'.'.join(loc)}: must be a table ([{'.'.join(loc)}] in TOML, an object in JSON), not {kind}"]
    if len(loc) == 1 and _SECTION_RULE.match(message):  # a section's rule names its key: `algo.tis_level`
        key, message = message.split(": ", 1)
        loc.append(key)
    overridden = _override_at(loc, written) is not None  # the override as written shows the value
    if "input" in item and not isinstance(item["input"], dict) and "(got " not in message and not overridden:
        message += f" (got {_short_repr(item['input'])})"
    return [_naming_override(f"{'.'.join(loc)}: {message}", written)]


def _override_key(arg: str) -> str:
    """The dotted key of an override `--section.key[=VALUE]`; raises ConfigError saying how one is written."""
    if not arg.startswith("--"):
        raise ConfigError(f"{arg}: {_OVERRIDE_FORM}")
    key = arg[2:].split("=", 1)[0]
    parts = key.split(".")
    if len(parts) == 1:
        if key in TandemConfig.model_fields:
            raise ConfigError(f"{arg}: [{key}] is a section, not a key: write --{key}.KEY VALUE")
        raise ConfigError(f"{arg}: {_OVERRIDE_FORM}")
    if not all(_KEY_PART.match(part) for part in parts):
        raise ConfigError(
            f"{arg}: a key's parts are names (letters, digits, '_'), none of them empty: {_OVERRIDE_FORM}"
        )
    return key


def _is_override(arg: str) -> bool:
    return arg.startswith("--") and arg[2:3].isalpha()


def parse_override_value(text: str) -> Any:
    """A command-line value as TOML would read it (`1e-6`, `true`, `[1, 2]`, `"x"`), else the plain string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:  # tomllib recurses once per nesting level: "[[[[...": not a config value
        raise ConfigError(f"{_short_repr(text)}: nested too deeply to be a config value") from None


def _spelled(arg: str, value: str | None) -> str:
    """An override as the user wrote it, quoted for a shell where needed, its value cut to 160 characters (a path
    fits; a pasted blob does not)."""
    if value is None:
        return shlex.quote(arg if len(arg) <= 160 else arg[:157] + "...")
    return f"{shlex.quote(arg)} {shlex.quote(value if len(value) <= 160 else value[:157] + '...')}"


def _split_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """(dotted key, value text, the override as written) of each override in `args`. A value is never taken from
    the next override (`--run.name --learner.lr 1` is a missing value); raises ConfigError naming the argument
    for anything that is not an override."""
    split = []
    i = 0
    while i < len(args):
        arg = args[i]
        key = _override_key(arg)
        if "=" in arg:
            split.append((key, arg.split("=", 1)[1], _spelled(arg, None)))
            i += 1
        else:
            if i + 1 >= len(args) or _is_override(args[i + 1]):
                raise ConfigError(f"{arg}: missing value (write {arg} VALUE or {arg}=VALUE)")
            split.append((key, args[i + 1], _spelled(arg, args[i + 1])))
            i += 2
    return split


def _parsed(split: list[tuple[str, str, str]]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key, text, spelled in split:
        try:
            overrides[key] = parse_override_value(text)
        except ConfigError as error:
            raise ConfigError(f"{spelled.split(' ', 1)[0]}: {error}") from None
    return overrides


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--learner.lr", "1e-6", "--algo.max_staleness=0"]` -> `{"learner.lr": 1e-6, "algo.max_staleness": 0}`.
    A value is never taken from the next override (`--run.name --learner.lr 1` is a missing value); raises
    ConfigError naming the argument for anything that is not an override."""
    return _parsed(_split_overrides(args))


def override_spellings(args: list[str]) -> dict[str, str]:
    """Dotted key -> the override as written (`learner.lr` -> `--learner.lr 1e-6`), for the messages that name
    the override rather than the file; raises ConfigError as parse_overrides."""
    return {key: spelled for key, _, spelled in _split_overrides(args)}


def apply_overrides(
    data: dict[str, Any], overrides: dict[str, Any], written: dict[str, str] | None = None
) -> dict[str, Any]:
    """Set dotted keys in a nested dict (a copy); unknown keys are caught by validation afterwards. A key below a
    value raises ConfigError naming the override (as `written`, see override_spellings, else `--KEY`)."""
    data = json.loads(json.dumps(data, default=str))
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{(written or {}).get(dotted, '--' + dotted)}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def build_config(data: Any, written: dict[str, str] | None = None) -> TandemConfig:
    """Validate a nested dict into a `TandemConfig`, raising `ConfigError` with one line per problem. `written`
    (dotted key -> the override as written, see override_spellings): a problem in a value an override set names
    the override, `--learner.lr -1: ...`, instead of the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a table of sections, not {_toml_type(data)}")
    try:
        return TandemConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            "\n".join(line for item in error.errors() for line in _error_lines(item, written or {}))
        ) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads keeps the last of two equal keys; a config that has two means an edit went wrong."""
    table: dict[str, Any] = {}
    for key, value in pairs:
        if key in table:
            raise ConfigError(f"not valid JSON: duplicate key '{key}'")
        table[key] = value
    return table


def _with_line(message: str, text: str) -> str:
    """tomllib's message with the text of the line it points at: `... (at line 3, column 6): lr = 2`."""
    found = re.search(r"at line (\d+)", message)
    lines = text.splitlines()
    if found and 1 <= int(found.group(1)) <= len(lines):
        return f"{message}: {_short_repr(lines[int(found.group(1)) - 1].strip())[1:-1]}"
    return message


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory: name the .toml file in it (or a run's config.json)")
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    if not path.is_file():
        raise ConfigError(f"{path}: is not a regular file")
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read: {error.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        text = raw.decode("utf-8-sig")  # an editor's byte-order mark is no error
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.start} is {raw[error.start]:#04x}): save it as UTF-8"
        ) from None
    if not text.strip():
        raise ConfigError(
            f"{path}: is empty: write the sections to change (docs/config.md), or name a packaged config such as 'demo'"
        )
    return text


def read_config_file(path: Path) -> dict[str, Any]:
    """The sections in a TOML file, or in a JSON one (`.json`: a run's resolved `config.json`). Raises ConfigError
    naming the file and what is wrong: missing, a directory, too large, not UTF-8, empty, not valid TOML or JSON
    (with the line), nested too deeply, or (JSON) not an object at the top."""
    text = _read_text(path)
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys) if kind == "JSON" else tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {_with_line(str(error), text)}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}") from None
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    except RecursionError:  # both parsers recurse once per nesting level
        raise ConfigError(f"{path}: not valid {kind}: nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f'{path}: must hold a JSON object of sections ({{"run": {{...}}, ...}}), not {_toml_type(data)}'
        )
    return data


def plugin_search_path(written: list[str], config_path: Path | None) -> list[str]:
    """`env.plugin_paths` as every role searches it: absolute folders, in order, without repeats.

    A TOML config file gives its own folder first, then the written entries (relative ones from that folder), then
    the current directory; no file: the entries from the current directory, then it. A `.json` config is a resolved
    one (a run's `config.json`, whose list is complete): its entries are kept (relative ones from its folder), so the
    roles of `tandem run` and `tandem ray` search the folders of the user's config, not the run directory."""
    cwd = Path.cwd()
    folder = Path(os.path.abspath(config_path)).parent if config_path is not None else cwd
    entries = [Path(os.path.abspath(folder / Path(entry).expanduser())) for entry in written]
    if config_path is None:
        entries = [*entries, cwd]
    elif config_path.suffix != ".json":
        entries = [folder, *entries, cwd]
    return list(dict.fromkeys(str(entry) for entry in entries))


def load_config(path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None) -> TandemConfig:
    """Read a TOML file (or the resolved `config.json` of a run; None = all defaults), apply dotted overrides,
    validate everything and resolve `env.plugin_paths` against the file (`plugin_search_path`). Raises
    ConfigError, one line per problem, each naming the file or the key; a problem in a value set by a
    command-line override (a list) names the override as written, `--learner.lr -1: ...`."""
    data = read_config_file(Path(path)) if path is not None else {}
    written: dict[str, str] = {}
    if overrides:
        split = _split_overrides(overrides) if isinstance(overrides, list) else []
        written = {key: spelled for key, _, spelled in split}
        data = apply_overrides(data, _parsed(split) if isinstance(overrides, list) else overrides, written)
    config = build_config(data, written)
    config.env.plugin_paths = plugin_search_path(config.env.plugin_paths, None if path is None else Path(path))
    config.model.chat_template = chat_template_path(config.model.chat_template, None if path is None else Path(path))
    return config


def chat_template_path(written: str, config_path: Path | None) -> str:
    """`model.chat_template` as every role reads it: a template file's path made absolute from the config file's
    folder (as `plugin_search_path` resolves env.plugin_paths; no file: from the current directory); "" and "none"
    as written."""
    if written in ("", "none"):
        return written
    folder = Path(os.path.abspath(config_path)).parent if config_path is not None else Path.cwd()
    return os.path.abspath(folder / Path(written).expanduser())


def write_resolved(config: TandemConfig, run_dir: Path, name: str = "config.json") -> Path:
    """Write the resolved config as `name` in the run directory (atomically) and return its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / name
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(config.model_dump_json(indent=2))
    tmp.replace(target)
    return target
