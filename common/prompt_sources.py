"""Prompt datasets as users have them: column mapping, veRL's parquet, OpenRLHF's jsonl, several sources by weight.

    from common.prompt_sources import load_env_prompts, RowMapping, load_source
    records = load_env_prompts(config.env, seed=config.run.seed)      # what the buffer leases (env.kind = "file")
    records = load_source("train.parquet", RowMapping(label_key="reward_model.ground_truth"), limit=8)

One row becomes one `common.tasks.PromptRecord` (`record_from_row`):
  prompt     the value at `prompt_key` (a dotted path reaches nested keys: "extra_info.question"): a string becomes
             one user message; a list of `{role, content}` messages is the chat itself (veRL's `prompt` column,
             OpenRLHF's `--input_key` holding a chat). Else a chat under `messages_key`. Not both, not neither.
  template   `prompt_template` with `{prompt}` replaced by the last user message's text (other braces stay as
             written, so `\\boxed{}` needs no escaping); `system_prompt` is put first unless the chat has a system
             message.
  label      the value at `label_key` becomes `metadata["answer"]`, the key every built-in reward reads; a veRL row
             (`reward_model.ground_truth` present) gives its ground truth when `label_key` names nothing.
  metadata   every other value, nested dicts flattened to dotted keys (`extra_info.index`), lists and dicts left
             at a leaf as JSON strings, nulls left out: scalars only, the wire contract. `data_source` stays;
             a row without one gets the source's `name`, the key `common.reward_routing` routes on.

Several sources (`env.sources`) are mixed into one list (`mix_plan`): the epoch of the mix is the shortest
whole number of weight periods in which every source is read at least once, so each source contributes exactly
`weight_i / sum(weights)` of it; sources that run out earlier cycle (as `datasets.interleave_datasets` with
`stopping_strategy="all_exhausted"`). The order interleaves the sources by smooth weighted round-robin: after t
records, source i has given count_i(t) with  -1 < t * w_i / W - count_i(t) < n - 1  (n sources: never more than
one record ahead of its share, less than n - 1 behind) and exactly
t * w_i / W at every multiple of W. prompt_id = the position in that list, so the same files, config and
run.seed give the same ids (the buffer's journal resumes by them); the buffer's dispenser then shuffles each
epoch (buffers/leases.py). Each cycle of a source reads its rows in `default_rng((seed, source, cycle))` order, so
the rows that a partial last cycle repeats are a seeded choice, not always the first ones.

Failure modes: ValueError with one line naming the file and row (`line N` for jsonl) and what to change;
what `common.tasks.read_rows` raises for a missing or unreadable file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from common.tasks import MetadataValue, PromptRecord, read_rows

LABEL = "answer"  # the metadata key of the label: what every built-in reward reads
DATA_SOURCE = "data_source"  # veRL's column; the key reward routing reads
VERL_LABEL = "reward_model.ground_truth"  # veRL's label, used when label_key names nothing in the row
# The largest mix epoch. Its records are built at the buffer's start, the chats shared with the source rows: measured
# 6-8 us and ~140 B a record (25,000 records; AMD EPYC, avx2, no avx512, 2 cores under load), so 4M is ~30 s and
# ~560 MB on top of the sources. Larger means weights far apart or one source far larger than its weight: `mix_plan`.
MAX_MIX_PROMPTS = 4_000_000
# The largest sum of the weights as a reduced integer ratio (0.3 and 0.7 -> 3 and 7: 10). The epoch is a multiple
# of it, so a ratio like 0.333333 : 0.666667 (sum 1,000,000) would make every epoch a million records at least.
MAX_WEIGHT_PERIOD = 10_000
_MISSING = object()


@dataclass(frozen=True)
class RowMapping:
    """How one source's rows map to PromptRecords (the `[env]` keys, or a source's own; see the module docstring).
    `name`: the data_source of rows that have none ("" = leave them without)."""

    prompt_key: str = "prompt"
    messages_key: str = "messages"
    label_key: str = LABEL
    prompt_template: str = ""
    system_prompt: str = ""
    name: str = ""


def lookup(row: Mapping[str, Any], dotted: str) -> Any:
    """The value at a dotted path (`"extra_info.question"`), a top-level key written with dots first; `_MISSING`
    when any step is absent or not a mapping. A null value counts as absent."""
    if dotted in row:
        return _MISSING if row[dotted] is None else row[dotted]
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return _MISSING if value is None else value


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


def _chat(value: Any, key: str, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if _is_chat(value):
        return [{"role": m["role"], "content": m.get("content")} for m in value]
    raise ValueError(f"{where}: {key!r} must be a string or a list of {{role, content}} messages, got {_shown(value)}")


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return f"{type(value).__name__} {text[:80]}"


def _apply_template(messages: list[dict[str, str]], mapping: RowMapping, where: str) -> list[dict[str, str]]:
    if mapping.prompt_template:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError(
                f"{where}: env.prompt_template needs a user message to apply to, the chat has roles "
                f"{[m['role'] for m in messages]}"
            )
        last = users[-1]
        text = mapping.prompt_template.replace("{prompt}", str(messages[last]["content"]))
        messages = [*messages[:last], {"role": "user", "content": text}, *messages[last + 1 :]]
    if mapping.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": mapping.system_prompt}, *messages]
    return messages


def _flatten(prefix: str, value: Any, skip: set[str], out: dict[str, MetadataValue]) -> None:
    """Scalars at their dotted key, nested dicts flattened, lists (and dicts under a list) as JSON strings;
    the dotted paths in `skip` (the prompt, the messages, the label) and nulls left out."""
    if prefix in skip or value is None:
        return
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, skip, out)
    elif isinstance(value, str | int | float | bool):
        out[prefix] = value
    else:  # a list (or bytes, a date): one JSON string, so that metadata stays scalars
        out[prefix] = json.dumps(value, default=str, ensure_ascii=False)


def record_from_row(row: Mapping[str, Any], prompt_id: int, where: str, mapping: RowMapping) -> PromptRecord:
    """One row as a PromptRecord (the rules in the module docstring). Raises ValueError naming `where` (the file
    and row) and what to change: no prompt (listing the keys the row has), both a prompt and a chat, a prompt that
    is neither a string nor a chat, a message without string role and content."""
    prompt = lookup(row, mapping.prompt_key)
    chat = lookup(row, mapping.messages_key) if mapping.messages_key != mapping.prompt_key else _MISSING
    if prompt is _MISSING and chat is _MISSING:
        raise ValueError(
            f"{where}: no prompt: the row has no {mapping.prompt_key!r} (a string or a chat) and no "
            f"{mapping.messages_key!r} (a chat); its keys are {sorted(row)}: set env.prompt_key (a dotted path "
            "reaches a nested key, e.g. 'extra_info.question') or env.messages_key to the one holding the prompt"
        )
    if prompt is not _MISSING and chat is not _MISSING:
        raise ValueError(
            f"{where}: the row has both {mapping.prompt_key!r} and {mapping.messages_key!r}: keep one, or point "
            "env.prompt_key / env.messages_key elsewhere"
        )
    key = mapping.prompt_key if prompt is not _MISSING else mapping.messages_key
    messages = _apply_template(_chat(prompt if prompt is not _MISSING else chat, key, where), mapping, where)
    label_path = mapping.label_key
    label = lookup(row, label_path)
    if label is _MISSING and lookup(row, VERL_LABEL) is not _MISSING:
        label_path, label = VERL_LABEL, lookup(row, VERL_LABEL)
    metadata: dict[str, MetadataValue] = {}
    _flatten("", row, {mapping.prompt_key, mapping.messages_key, label_path}, metadata)
    if label is not _MISSING:
        metadata[LABEL] = label if isinstance(label, str | int | float | bool) else json.dumps(label, default=str)
    if DATA_SOURCE not in metadata and mapping.name:
        metadata[DATA_SOURCE] = mapping.name
    try:
        return PromptRecord(prompt_id=prompt_id, messages=messages, metadata=metadata)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def load_source(source: str, mapping: RowMapping, *, limit: int | None = None) -> list[PromptRecord]:
    """The records of one file (`.jsonl`, `.parquet`, or a `datasets` folder: `common.tasks.read_rows`), prompt_id =
    row index, the first `limit` rows only when given. Raises what `read_rows` and `record_from_row` raise, and
    ValueError for a source without rows."""
    records: list[PromptRecord] = []
    for where, row in read_rows(source, what="prompt source"):
        if limit is not None and len(records) >= limit:
            break
        records.append(record_from_row(row, len(records), where, mapping))
    if not records:
        raise ValueError(f"prompt source {source!r} has no rows")
    return records


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as the smallest integers in the same ratio, each read as the decimal it prints as (0.3 is 3/10,
    not the binary float's 5404319552844595/2**54): [0.3, 0.7] -> [3, 7], [2, 2, 4] -> [1, 1, 2]. Raises ValueError
    for a weight <= 0 or not finite."""
    if not weights or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be finite and > 0, got {list(weights)}")
    fractions = [Fraction(repr(float(w))) for w in weights]
    denominator = math.lcm(*(f.denominator for f in fractions))
    numerators = [int(f * denominator) for f in fractions]
    common = math.gcd(*numerators)
    return [n // common for n in numerators]


def weighted_round_robin(weights: Sequence[int]) -> list[int]:
    """One period of smooth weighted round-robin over integer weights: sum(weights) source indices, index i
    exactly weights[i] times. Each step adds every weight to its source's credit and takes the source with the
    most credit (the first on a tie), which pays sum(weights). Credits sum to 0 after each step and the taken one
    had the most (>= W / n > 0 before paying), so no credit falls to -W or below; credit_i = W * (t * w_i / W -
    count_i(t)) and the credits sum to 0, so -1 < t * w_i / W - count_i(t) < n - 1 for every prefix t."""
    total = sum(weights)
    credit = [0] * len(weights)
    order: list[int] = []
    for _ in range(total):
        credit = [c + w for c, w in zip(credit, weights, strict=True)]
        best = max(range(len(weights)), key=lambda i: (credit[i], -i))
        credit[best] -= total
        order.append(best)
    return order


def mix_plan(sizes: Sequence[int], weights: Sequence[float], seed: int) -> list[tuple[int, int]]:
    """One epoch of the mix as (source index, row index) pairs, in prompt_id order (see the module docstring):
    k = max over sources of ceil(size_i / w_i) periods of `weighted_round_robin(integer_weights(weights))`, so
    source i gives exactly k * w_i >= size_i records, reading its rows cycle after cycle, each cycle in the order
    of `default_rng((seed, i, cycle)).permutation(size_i)`. Raises ValueError when the epoch would exceed
    MAX_MIX_PROMPTS or the weights' period MAX_WEIGHT_PERIOD (saying which weights and sizes), or for an empty source."""
    if len(sizes) != len(weights) or any(size < 1 for size in sizes):
        raise ValueError(f"every source needs rows and a weight, got sizes {list(sizes)} and weights {list(weights)}")
    ints = integer_weights(weights)
    period = sum(ints)
    if period > MAX_WEIGHT_PERIOD:
        raise ValueError(
            f"env.sources: weights {list(weights)} reduce to the integer ratio {ints}, a period of {period} records "
            f"(at most {MAX_WEIGHT_PERIOD}): write them as small integers or short decimals (1, 2 or 0.25, 0.75)"
        )
    periods = max(math.ceil(size / w) for size, w in zip(sizes, ints, strict=True))
    if periods * period > MAX_MIX_PROMPTS:
        raise ValueError(
            f"env.sources: an epoch of this mix is {periods * period:,} prompts (sizes {list(sizes)}, weights "
            f"{list(weights)}: each source read at least once at its weight), more than {MAX_MIX_PROMPTS:,}: give "
            "small sources less weight or large ones more"
        )
    order = weighted_round_robin(ints)
    taken = [0] * len(sizes)
    orders: dict[tuple[int, int], np.ndarray] = {}
    plan: list[tuple[int, int]] = []
    for _ in range(periods):
        for source in order:
            cycle, position = divmod(taken[source], sizes[source])
            if (source, cycle) not in orders:
                orders[(source, cycle)] = np.random.default_rng((seed, source, cycle)).permutation(sizes[source])
            plan.append((source, int(orders[(source, cycle)][position])))
            taken[source] += 1
    return plan


def mix(sources: Sequence[Sequence[PromptRecord]], weights: Sequence[float], seed: int) -> list[PromptRecord]:
    """The records of several sources mixed by `mix_plan`, renumbered 0..L-1 (a row read twice is two records with
    the same chat and metadata objects, shared, not copied). Raises what `mix_plan` raises."""
    plan = mix_plan([len(records) for records in sources], weights, seed)
    return [
        PromptRecord(prompt_id=i, messages=sources[s][row].messages, metadata=sources[s][row].metadata)
        for i, (s, row) in enumerate(plan)
    ]


def env_row_mapping(env: Any) -> RowMapping:
    """The `[env]` column mapping (prompt_key, messages_key, label_key, prompt_template, system_prompt): how
    `env.source` is read, what each of `env.sources` starts from, and how evaluation reads a `file:` set."""
    return RowMapping(env.prompt_key, env.messages_key, env.label_key, env.prompt_template, env.system_prompt)


def source_mappings(env: Any) -> list[tuple[str, float, RowMapping]]:
    """(path, weight, mapping) of every source of an `[env]` section (`common.config.EnvConfig`): `env.sources`, each
    key a source leaves unset taken from `[env]`, its `name` (default: the file's stem) as the data_source of rows
    without one; or `env.source` alone (weight 1, no name)."""
    base = env_row_mapping(env)
    if not env.sources:
        return [(env.source, 1.0, base)]
    found = []
    for spec in env.sources:
        mapping = RowMapping(
            spec.prompt_key if spec.prompt_key is not None else base.prompt_key,
            base.messages_key,
            spec.label_key if spec.label_key is not None else base.label_key,
            spec.prompt_template if spec.prompt_template is not None else base.prompt_template,
            spec.system_prompt if spec.system_prompt is not None else base.system_prompt,
            source_name(spec),
        )
        found.append((spec.source, spec.weight, mapping))
    return found


def source_name(spec: Any) -> str:
    """A source's `name`, or by default its file's stem (`data/gsm8k.parquet` -> `gsm8k`; a folder's name)."""
    if spec.name:
        return spec.name
    path = Path(spec.source.rstrip("/"))
    return path.stem if path.suffix else path.name


def load_env_prompts(env: Any, seed: int, *, limit: int | None = None) -> list[PromptRecord]:
    """The prompts of `[env]` with kind = "file": `env.source` read alone (prompt_id = row index), or `env.sources`
    each read and mixed by weight (`mix`). `limit` reads only the first rows of each source, and skips the mix
    (the start-up check's use). Raises what `load_source` and `mix_plan` raise, and ValueError for rows no reward
    function would score (`check_routes`)."""
    loaded = [load_source(path, mapping, limit=limit) for path, _, mapping in source_mappings(env)]
    check_routes(env, loaded)
    if not env.sources or limit is not None:
        return [record for records in loaded for record in records]
    return mix(loaded, [spec.weight for spec in env.sources], seed)


def check_routes(env: Any, loaded: Sequence[Sequence[PromptRecord]]) -> None:
    """Raise ValueError when a source with its own reward_fn has rows of another data_source than its name (they
    would be scored by another function: route them by env.reward_fns instead), or, with env.reward_fn empty, when
    rows carry a data_source that no route names (`common.reward_routing`)."""
    from common.reward_routing import reward_routes

    routes = reward_routes(env)
    for i, (spec, records) in enumerate(zip(env.sources, loaded, strict=False)):
        others = data_sources(records) - {source_name(spec)}
        if spec.reward_fn and others:
            raise ValueError(
                f"env.sources[{i}] ({spec.source}): its reward_fn scores data_source {source_name(spec)!r}, but its "
                f"rows carry data_source {sorted(others)[:3]}: route those by env.reward_fns = "
                f"{{{json.dumps(min(others))} = {json.dumps(spec.reward_fn)}}} instead of a reward_fn here"
            )
    if not env.reward_fn and not env.reward_url and not env.environment and not env.reward_model:
        found = set().union(*(data_sources(r) for r in loaded))
        if any(DATA_SOURCE not in record.metadata for records in loaded for record in records):
            found.add("(none)")
        unrouted = sorted(found - set(routes))
        if unrouted:
            raise ValueError(
                f"env.reward_fn: empty, and no route scores rows of data_source {unrouted[:3]}: add them to "
                "env.reward_fns, or set env.reward_fn"
            )


def data_sources(records: Iterable[PromptRecord]) -> set[str]:
    """The distinct `metadata["data_source"]` values of these records (as strings)."""
    return {str(r.metadata[DATA_SOURCE]) for r in records if DATA_SOURCE in r.metadata}
