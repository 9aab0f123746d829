"""PrimeIntellect's `verifiers` environments (0.4, `verifiers.v1`) run unchanged through Tandem's episode driver.

    [env]                                                     # a verifiers taskset id, or its module
    environment = "verifiers:arith-feedback"                  # imported as verifiers does: module arith_feedback
    environment_args = { num_tasks = 200 }                    # the taskset's config fields (env_id: a paired Env)
    plugin_paths = ["verifiers_env"]                          # where that module lies (else: installed)
    kind = "file"
    source = "verifiers_env/data/arith_feedback.jsonl"         # python -m actors.environments.verifiers_env --export ...

What runs. `verifiers_factory` loads the environment as `vf-eval` would (`vf.resolve_env_config` +
`vf.load_environment`: the taskset, its Task class with its `@vf.reward` / `@vf.metric` / `@vf.stop` methods and
plugged judges, the taskset's own `Env` subclass if it exports one, else `SingleAgentEnv`) and iterates the taskset
once (its dataset). Each Tandem episode then runs the env's own `setup(agents)`, `run(task, agents)` and
`finalize(task, episode)` on the driver's event loop, with one change: the env's agent seat is Tandem's policy.
`agents.<seat>.run(task)` is one model turn on the task's prompt; `agents.<seat>.interaction(task)` gives an
interaction whose `turn(message)` sends the message to the model and returns its reply as a `vf.Segment`. Each
model turn is a Tandem step: the messages the env added since the model's last turn are the observation (the
driver renders them as a chat-template delta and keeps the sampled ids, so the trajectory is token-exact, the env's
tokens masked), and the model's text answers the pending `turn`. When the seat's trace closes, the task scores it
(`Task.score(trace)`: rewards, metrics, judges); the episode's reward is the trace's `reward` (the weighted sum)
and its components are the rubric's (`trace.rewards`, each `score * weight`), which reach the buffer beside
`turn_reward_sum`. A raising hook, a reward left unscored, or a protocol this adapter does not carry ends the
episode as `env_error` (actors.environments.episodes). What of verifiers is not supported: docs/environments.md.

The buffer's prompts are the taskset's rows, exported once (`python -m actors.environments.verifiers_env --export <id>
out.jsonl [key=value ...] [--path folder]`): each row's `vf_idx` metadata names the task it opens, so the group's episodes play it.
Importing this module is cheap; verifiers is imported when an environment is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
import sys
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from common.envs import EnvironmentFactory, Message, StepResult
from common.plugins import search_first

METADATA_KEY = "vf_idx"  # the prompt metadata that names a verifiers task (its position in the taskset)
ENV_ID_ARG = "env_id"  # environment_args key naming a verifiers Env to pair with the taskset (`--env.id`)


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ImportError(
            "env.environment 'verifiers:...' needs the verifiers package: install Tandem's verifiers extra "
            "(pip install -e '.[verifiers]'; scripts/setup.sh installs it)"
        ) from error
    return vf


@dataclass
class LoadedEnv:
    """One verifiers environment, loaded once per generator: the Env, its tasks by index, its one agent seat."""

    spec: str
    env: Any  # vf.Env
    tasks: dict[int, Any]  # vf.Task by its taskset position (TaskData.idx)
    seat: str

    def task(self, metadata: Mapping[str, Any]) -> Any:
        """The verifiers task a leased prompt opens (its `vf_idx` metadata); ValueError saying what to change."""
        idx = metadata.get(METADATA_KEY)
        if isinstance(idx, bool) or not isinstance(idx, int) or idx not in self.tasks:
            raise ValueError(
                f"prompt metadata {METADATA_KEY}={idx!r} names no task of verifiers env {self.spec!r} "
                f"({len(self.tasks)} tasks): export the prompts with python -m actors.environments.verifiers_env --export"
            )
        return self.tasks[idx]


def load_verifiers_env(spec: str, environment_args: Mapping[str, Any]) -> LoadedEnv:
    """Load `spec` (a verifiers taskset id or module) with `environment_args` as its taskset config fields
    (`env_id` pairs an Env); iterate its tasks. ValueError when it cannot run here (no tasks, an unbounded
    taskset, more than one agent seat)."""
    vf = _vf()
    from verifiers.v1.configs.agent import agent_config_fields

    args = dict(environment_args)
    env_id = str(args.pop(ENV_ID_ARG, ""))
    config = vf.resolve_env_config({"id": env_id, "taskset": {"id": spec, **args}})
    env = vf.load_environment(config)
    if not env.taskset.bounded:
        raise ValueError(f"verifiers env {spec!r}: its taskset is infinite; bound it in its config (a finite load)")
    tasks = {task.data.idx: task for task in env.taskset}
    if not tasks:
        raise ValueError(f"verifiers env {spec!r}: its taskset yielded no tasks")
    seats = list(agent_config_fields(env.config))
    if len(seats) != 1:
        raise ValueError(
            f"verifiers env {spec!r} declares {len(seats)} agent seats {seats}: Tandem plays one seat (the policy); "
            "multi-agent envs (user-sim, agentic judges, best-of-n) are not supported"
        )
    return LoadedEnv(spec, env, tasks, seats[0])


def opening_messages(task: Any) -> list[Any]:
    """The task's opening chat as verifiers messages: its system prompt, then its prompt (empty when the user
    opens)."""
    vf = _vf()
    data = task.data
    messages: list[Any] = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(data.prompt)
    return messages


def to_chat(message: Any) -> Message:
    """A verifiers message as Tandem's `{"role", "content"}`; ValueError for what Tandem does not carry here."""
    if message.role == "tool" or getattr(message, "tool_calls", None):
        raise ValueError("verifiers tool messages and tool calls are not supported by the Tandem adapter")
    content = message.content
    if not isinstance(content, str):
        if any(part.type != "text" for part in content or []):
            raise ValueError("verifiers multimodal content (image parts) is not supported by the Tandem adapter")
        content = "\n".join(part.text for part in content or [])
    return {"role": message.role, "content": content or ""}


class _Bridge:
    """The hand-over between the verifiers side (the env's coroutine, whose seat asks for model turns) and
    Tandem's reset/step: `events` carries ("turn", new messages), ("done", result) or ("error", exception)."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.reply: asyncio.Future[str] | None = None

    async def ask(self, new_messages: list[Message]) -> str:
        self.reply = asyncio.get_running_loop().create_future()
        self.events.put_nowait(("turn", new_messages))
        return await self.reply

    def answer(self, text: str) -> None:
        if self.reply is None or self.reply.done():
            raise RuntimeError("step() without a pending model turn of the verifiers env")
        self.reply.set_result(text)


@dataclass
class _Seat:
    """The env's agent seat, played by Tandem's policy (what `agents.<seat>` is inside the env's hooks)."""

    name: str
    config: Any  # vf.AgentConfig
    bridge: _Bridge
    traces: list[Any] = field(default_factory=list)
    trainable: bool = True

    def _open(self, task: Any) -> Any:
        vf = _vf()
        info = vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
        trace = vf.Trace(task=info, agent=vf.AgentInfo(config=self.config, name=self.name))
        self.traces.append(trace)
        return trace

    async def model_turn(self, task: Any, trace: Any, new_messages: list[Any]) -> Any | None:
        """One model turn after `new_messages`: the reply (a vf.AssistantMessage), or None when the seat's
        `max_turns` is spent (the trace stops). The task's `@vf.stop` predicates run on the trace after it."""
        vf = _vf()
        if self.config.max_turns is not None and trace.num_turns >= self.config.max_turns:
            trace.stop("max_turns")
            return None
        chat = [to_chat(message) for message in new_messages]
        for message in new_messages:
            trace.nodes.append(vf.MessageNode(parent=len(trace.nodes) - 1 if trace.nodes else None, message=message))
        text = await self.bridge.ask(chat)
        reply = vf.AssistantMessage(content=text)
        trace.nodes.append(
            vf.MessageNode(parent=len(trace.nodes) - 1 if trace.nodes else None, message=reply, sampled=True)
        )
        for predicate in task.hooks("stop"):
            if await _maybe_await(predicate(**_arguments(predicate, trace, task))):
                trace.stop(predicate.__name__)
        return reply

    async def close(self, task: Any, trace: Any) -> None:
        """The trace is over: the task scores it (rewards, metrics, judges that need no runtime)."""
        trace.is_completed = True
        await task.score(trace)
        trace.ok = not trace.errors

    async def run(self, task: Any, **_: Any) -> Any:
        """`agent.run(task)`: one segment on the task's prompt, i.e. one model turn (no harness tools here)."""
        opening = opening_messages(task)
        if not any(message.role == "user" for message in opening):
            raise ValueError("agent.run() on a prompt-less task: the user opens it, use agent.interaction(task)")
        trace = self._open(task)
        await self.model_turn(task, trace, opening)
        await self.close(task, trace)
        return trace

    @asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        """`agent.interaction(task)`: the rollout held open turn by turn; scored when the context closes."""
        trace = self._open(task)
        try:
            yield _Interaction(self, task, trace)
        finally:
            await self.close(task, trace)


class _Interaction:
    """What `agent.interaction(task)` yields: `turn(message)` -> `vf.Segment` (the verifiers user channel)."""

    def __init__(self, seat: _Seat, task: Any, trace: Any) -> None:
        self.seat, self.task, self.trace = seat, task, trace
        self.started = False

    async def turn(self, message: Any = None) -> Any:
        vf = _vf()
        if self.trace.is_completed:  # a limit or a @vf.stop ended the exchange: verifiers' terminated segment
            return vf.Segment(messages=[], terminated=True)
        prompted = self.task.data.prompt is not None
        new = opening_messages(self.task) if not self.started else []
        if message is None and (self.started or not prompted):
            raise ValueError("interaction.turn() needs a message: a bare turn() takes a prompted task's opening reply")
        if message is not None and not self.started and prompted:
            raise ValueError("a prompted task speaks first: take its opening reply with a bare turn() first")
        if isinstance(message, str):
            new.append(vf.UserMessage(content=message))
        elif message is not None:
            new.extend(message)
        self.started = True
        reply = await self.seat.model_turn(self.task, self.trace, new)
        if reply is None:
            return vf.Segment(messages=[], terminated=True)
        return vf.Segment(messages=[reply])


class _Agents:
    """The `agents` the env's `setup`/`run` hooks see: its one seat, by name."""

    def __init__(self, seat: _Seat) -> None:
        self._seat = seat

    def __getattr__(self, name: str) -> _Seat:
        if name == self.__dict__["_seat"].name:
            return self.__dict__["_seat"]
        raise AttributeError(f"the verifiers env has one agent seat, {self.__dict__['_seat'].name!r}, not {name!r}")


def _arguments(fn: Any, trace: Any, task: Any) -> dict[str, Any]:
    """A `@vf.stop` predicate's arguments, by name: `trace` and `task` (typed Request/Response ones are refused)."""
    available = {"trace": trace, "task": task.data}
    wanted = inspect.signature(fn).parameters
    missing = [name for name in wanted if name not in available]
    if missing:
        raise ValueError(f"@vf.stop {fn.__name__}: only trace/task predicates are supported here, not {missing}")
    return {name: available[name] for name in wanted}


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def episode_reward(traces: list[Any]) -> tuple[float, dict[str, float], dict[str, float]]:
    """The reward of the seat's traces (the sum of `trace.reward`), its components (each reward's `score *
    weight`, summed by name over the traces) and their metrics; ValueError for an unscored or non-finite one."""
    components: dict[str, float] = {}
    metrics: dict[str, float] = {}
    for trace in traces:
        for name, reward in trace.rewards.items():
            if reward is None or not math.isfinite(reward.value):
                raise ValueError(f"verifiers reward {name!r} is {reward!r}: it was not scored to a finite number")
            components[name] = components.get(name, 0.0) + float(reward.value)
        metrics.update({name: float(value) for name, value in trace.metrics.items() if value is not None})
    return float(sum(components.values())), components, metrics


class VerifiersEnvironment:
    """One Tandem episode of a loaded verifiers env (the contract: common/envs.py; the protocol: this module's
    docstring). reset -> the task's opening chat; step(text) -> the env's next messages, or done with the
    rubric's reward (its components in `info["components"]`, metrics in `info["metrics"]`)."""

    def __init__(self, loaded: LoadedEnv) -> None:
        self.loaded = loaded
        self.bridge = _Bridge()
        self.play: asyncio.Task[None] | None = None

    async def reset(self, task: Any) -> list[Message]:
        vf_task = self.loaded.task(task.metadata)
        seat_config = getattr(self.loaded.env.config, self.loaded.seat)
        seat = _Seat(self.loaded.seat, seat_config, self.bridge)
        self.play = asyncio.create_task(self._play(vf_task, seat))
        kind, value = await self.bridge.events.get()
        if kind == "done":
            raise ValueError(f"verifiers env {self.loaded.spec!r} ended its episode before the model's first turn")
        if kind == "error":
            raise value
        return value

    async def step(self, model_turn_text: str) -> StepResult:
        self.bridge.answer(model_turn_text)
        kind, value = await self.bridge.events.get()
        if kind == "error":
            raise value
        if kind == "turn":
            return StepResult(value)
        reward, components, metrics = value
        return StepResult([], reward=reward, done=True, info={"components": components, "metrics": metrics})

    async def _play(self, task: Any, seat: _Seat) -> None:
        """The env's own episode: setup, run, finalize (verifiers' Env hooks), then the reward."""
        vf = _vf()
        env = self.loaded.env
        try:
            agents = _Agents(seat)
            await env.setup(agents)
            await env.run(task, agents)
            if not seat.traces:
                raise ValueError(f"{type(env).__name__}.run() ran no agent: every episode must carry a run")
            info = vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
            episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id), task=info, traces=seat.traces)
            await env.finalize(task, episode)
            self.bridge.events.put_nowait(("done", episode_reward(seat.traces)))
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # close() cancelled the episode
                raise
            self.bridge.events.put_nowait(("error", RuntimeError("a verifiers hook raised CancelledError")))
        except BaseException as error:  # noqa: BLE001 - any failure of the env's hooks, SystemExit and
            # KeyboardInterrupt included (a rubric's), ends the episode as env_error, never the event loop
            self.bridge.events.put_nowait(("error", error))

    async def close(self) -> None:
        if self.play is not None and not self.play.done():
            self.play.cancel()


def verifiers_factory(spec: str, environment_args: Mapping[str, Any]) -> EnvironmentFactory:
    """The episode factory of `env.environment = "verifiers:<spec>"` (what common.envs.environment_factory
    returns for it): loads the env once, now, so a bad id or argument stops the generator at start-up."""
    loaded = load_verifiers_env(spec, environment_args)
    return lambda: VerifiersEnvironment(loaded)


def export_prompts(spec: str, environment_args: Mapping[str, Any], path: str) -> int:
    """Write the taskset's rows as Tandem prompts (common/tasks.py's jsonl: `messages` + metadata `vf_idx`)."""
    loaded = load_verifiers_env(spec, environment_args)
    rows = []
    for idx, task in sorted(loaded.tasks.items()):
        messages = [to_chat(message) for message in opening_messages(task)]
        if not any(message["role"] == "user" for message in messages):
            raise ValueError(f"verifiers task {idx}: prompt-less (the user opens it); Tandem prompts need a user turn")
        rows.append({"messages": messages, METADATA_KEY: idx, **({"vf_id": task.data.id} if task.data.id else {})})
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    return len(rows)


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a verifiers taskset as Tandem prompts (jsonl).")
    parser.add_argument("--export", nargs=2, metavar=("SPEC", "OUT"), required=True, help="taskset id and out file")
    parser.add_argument("args", nargs="*", metavar="KEY=VALUE", help="environment_args (taskset config fields)")
    parser.add_argument("--path", action="append", default=[], help="a folder to import the taskset from first")
    options = parser.parse_args(argv)
    search_first([os.path.abspath(folder) for folder in options.path])
    arguments = {}
    for item in options.args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"argument {item!r}: expected KEY=VALUE")
        arguments[key] = _scalar(value)
    spec, out = options.export
    print(f"wrote {export_prompts(spec, arguments, out)} prompts to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
