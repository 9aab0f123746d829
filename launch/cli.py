"""The `tandem` command. It parses and validates the config first and imports torch/vLLM/DeepSpeed after,
so `tandem --help` and config errors answer at once.

    tandem demo                                   # the embedded default run (examples/demo.toml)
    tandem run CONFIG [--section.key VALUE ...]   # every role on this machine
    tandem buffer CONFIG                          # one role alone (fleets launched separately)
    tandem generator CONFIG --generator.index 1
    tandem learner CONFIG                         # one rank per process; torchrun sets RANK/WORLD_SIZE
    tandem ray CONFIG                             # the fleets on a Ray cluster
    tandem ray scale RUN --generators N           # ... add or retire generators of a running fleet
    tandem ray status RUN | tandem ray stop RUN
    tandem prepare-model [--check]                # build the embedded SmolLM2 model in the cache
    tandem config CONFIG                          # print the resolved config as JSON
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from common.config import ConfigError, load_config

# role -> "module:function" taking the validated TandemConfig; imported only when that role runs.
ROLES = {
    "run": "launch.local:run",
    "buffer": "buffers.service:run",
    "generator": "actors.generator:run",
    "learner": "learners.learner:run",
    "ray": "launch.ray_launch:run",
}
RAY_ACTIONS = ("scale", "status", "stop")  # `tandem ray ACTION RUN ...` (launch.ray_control), not a config
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "demo.toml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Asynchronous actor-learner RL for language models (vLLM generators, a staleness-bounded "
        "replay buffer, DeepSpeed learners). Any config key can be overridden: --section.key VALUE.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="run the embedded default (SmolLM2-135M on arithmetic, async GRPO)")
    for role, text in [
        ("run", "start the buffer, generator(s) and learner rank(s) on this machine"),
        ("buffer", "start the buffer service alone"),
        ("generator", "start one generator alone (--generator.index I)"),
        ("learner", "start one learner rank alone"),
        (
            "ray",
            (
                "place the fleets on a Ray cluster (RAY_ADDRESS, or a local one); then "
                "`tandem ray scale RUN --generators N`, `tandem ray status RUN`, `tandem ray stop RUN`"
            ),
        ),
        ("config", "print the resolved config"),
    ]:
        cmd = sub.add_parser(role, help=text)
        cmd.add_argument("config", type=Path, help="TOML run config")
    prep = sub.add_parser("prepare-model", help="prepare the embedded SmolLM2-135M-Instruct model in the cache")
    prep.add_argument("--check", action="store_true", help="also load it with transformers and vLLM")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ray"] and argv[1:2] and argv[1] in RAY_ACTIONS:
        from launch.ray_control import main as ray_control

        return ray_control(argv[1:])
    args, overrides = _parser().parse_known_args(argv)
    if args.command == "prepare-model":
        from common.model_prep import check_model, prepare_smollm2

        path = prepare_smollm2()
        print(path)
        if args.check:
            print(check_model(path))
        return 0
    config_path = DEMO_CONFIG if args.command == "demo" else args.config
    try:
        config = load_config(config_path, overrides)
    except ConfigError as error:
        print(f"tandem: config error in {config_path}:\n{error}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(config.model_dump_json(indent=2))
        return 0
    module, function = ROLES["run" if args.command == "demo" else args.command].split(":")
    result = getattr(importlib.import_module(module), function)(config)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
