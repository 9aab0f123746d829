"""The `tandem` command. It parses and validates the config first and imports torch/vLLM/DeepSpeed after,
so `tandem --help` and config errors answer at once.

    tandem demo                                   # the embedded default run (= tandem run demo)
    tandem run CONFIG [--section.key VALUE ...]   # every role on this machine
    tandem buffer CONFIG                          # one role alone (fleets launched separately)
    tandem generator CONFIG --generator.index 1
    tandem learner CONFIG                         # one rank per process; torchrun sets RANK/WORLD_SIZE
    tandem ray CONFIG                             # the fleets on a Ray cluster
    tandem ray scale RUN --generators N           # ... add or retire generators of a running fleet
    tandem ray status RUN | tandem ray stop RUN
    tandem prepare-model [--check]                # build the embedded SmolLM2 model in the cache
    tandem config CONFIG                          # print the resolved config as JSON
    tandem keys DIR                               # CurveZMQ keys: the server's and one per role (run.curve_keys_dir)

CONFIG is a TOML file, or the name of a config shipped in the package (`launch/configs/`, installed with the
wheel): `demo` (the embedded default) or `gpu_cluster` (a `tandem ray` fleet on GPU nodes). A file of that
name in the working directory wins over the packaged one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from common.config import ConfigError, load_config
from launch.config_checks import missing_paths

# role -> "module:function" taking the validated TandemConfig; imported only when that role runs.
ROLES = {
    "run": "launch.local:run",
    "buffer": "buffers.service:run",
    "generator": "actors.generator:run",
    "learner": "learners.learner:run",
    "ray": "launch.ray_launch:run",
}
RAY_ACTIONS = ("scale", "status", "stop")  # `tandem ray ACTION RUN ...` (launch.ray_control), not a config
# Package data (pyproject: [tool.setuptools.package-data]); examples/demo.toml and examples/gpu_cluster.toml in the
# repository are symbolic links to these files.
PACKAGED_CONFIGS = Path(__file__).resolve().parent / "configs"
DEMO_CONFIG = PACKAGED_CONFIGS / "demo.toml"
USAGE_ERROR = 2  # the exit code of a config error, as argparse's for a usage error


def packaged_configs() -> dict[str, Path]:
    """Name -> path of every config shipped with the package (`demo`, `gpu_cluster`)."""
    return {path.stem: path for path in sorted(PACKAGED_CONFIGS.glob("*.toml"))}


def resolve_config_path(argument: str) -> Path:
    """The config that CONFIG names: an existing file, else a packaged config of that name (with or without
    `.toml`), else the path as given (loading it then fails with "no such config file")."""
    path = Path(argument)
    if path.exists():
        return path
    return packaged_configs().get(argument.removesuffix(".toml"), path)


def config_error(config_path: Path, problems: list[str]) -> int:
    """Print each problem as one line `tandem: config error in PATH: key: what to change` on stderr; return the
    exit code of a usage error (2, as argparse's)."""
    hint = "" if config_path.exists() else f" (packaged configs by name: {', '.join(packaged_configs())})"
    for problem in problems:
        print(
            f"tandem: config error in {config_path}: {problem.removeprefix(f'{config_path}: ')}{hint}", file=sys.stderr
        )
    return USAGE_ERROR


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
        names = ", ".join(packaged_configs())
        cmd.add_argument(
            "config", type=resolve_config_path, help=f"TOML run config, or a packaged one by name ({names})"
        )
    keys = sub.add_parser(
        "keys",
        help="write CurveZMQ keys for run.curve_keys_dir: the server's and one per role (generator, learner, reward, "
        "eval, monitor), secrets 0600 in a 0700 directory",
    )
    keys.add_argument("dir", type=Path, help="directory to create (or an empty one); existing keys are never replaced")
    prep = sub.add_parser("prepare-model", help="prepare the embedded SmolLM2-135M-Instruct model in the cache")
    prep.add_argument("--check", action="store_true", help="also load it with transformers and vLLM")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ray"] and argv[1:2] and argv[1] in RAY_ACTIONS:
        from launch.ray_control import main as ray_control

        return ray_control(argv[1:])
    args, overrides = _parser().parse_known_args(argv)
    if args.command == "keys":
        return _write_keys(args.dir)
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
        return config_error(config_path, str(error).splitlines())
    problems = missing_paths(config, "run" if args.command == "demo" else args.command)
    if problems:
        return config_error(config_path, problems)
    if args.command == "config":
        print(config.model_dump_json(indent=2))
        return 0
    module, function = ROLES["run" if args.command == "demo" else args.command].split(":")
    try:
        result = getattr(importlib.import_module(module), function)(config)
    finally:
        from common.sockets import release_context

        release_context()  # no zero-copy frame may outlive the memory it points into (see release_context)
    return int(result or 0)


def _write_keys(directory: Path) -> int:
    from common.keys import SecurityError, write_keys

    try:
        written = write_keys(directory)
    except SecurityError as error:
        print(f"tandem keys: {error}", file=sys.stderr)
        return 2
    print(f'wrote {len(written)} key files to {directory} (secrets 0600). Set run.curve_keys_dir = "{directory}".')
    print("Servers (buffer, learner rank 0) need server.key_secret and every ROLE.key; a client of role R needs")
    print("R.key_secret and server.key: copy to each machine only the secrets of the roles it runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
