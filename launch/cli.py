"""The `tandem` command. It parses and validates the config first and imports torch/vLLM/DeepSpeed after,
so `tandem --help` and config errors answer at once.

    tandem demo                                   # the embedded default run (= tandem run demo)
    tandem run CONFIG [--section.key VALUE ...]   # every role on this machine
    tandem buffer CONFIG                          # one role alone (fleets launched separately)
    tandem generator CONFIG --generator.index 1
    tandem learner CONFIG                         # one rank per process; torchrun sets RANK/WORLD_SIZE
    tandem sft CONFIG                             # supervised fine-tuning ([sft]) -> <run_dir>/model
    tandem rm CONFIG                              # a reward model on preference pairs ([rm]) -> <run_dir>/model
    tandem dpo CONFIG                             # DPO against a frozen reference ([dpo]) -> <run_dir>/model
    tandem reward CONFIG                          # the reward service of env.reward_model (reward.port)
    tandem ray CONFIG                             # the fleets on a Ray cluster
    tandem ray scale RUN --generators N           # ... add or retire generators of a running fleet
    tandem ray status RUN | tandem ray stop RUN
    tandem prepare-model [--check]                # build the embedded SmolLM2 model in the cache
    tandem eval MODEL [MODEL ...] [--sets ...]    # offline vLLM evaluation of models/checkpoints (launch.evaluate)
    tandem plot RUN_DIR [--out FILE.png]          # a run's eval curves vs version and wall time (launch.plot)
    tandem config CONFIG                          # print the resolved config as JSON, after checking the paths
                                                  # a run needs here (--no-path-checks: a config for elsewhere);
                                                  # on stderr, what model.dtype "auto" chooses on this machine
    tandem keys DIR                               # CurveZMQ keys: the server's and one per role (run.curve_keys_dir)

CONFIG is a TOML file, or the name of a config shipped in the package (`launch/configs/`, installed with the
wheel): `demo` (the embedded default) or `gpu_cluster` (a `tandem ray` fleet on GPU nodes). A file of that
name in the working directory wins over the packaged one.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from pathlib import Path
from typing import Any

from common.config import ConfigError, load_config, override_spellings
from common.teardown import skip_exit_gc
from launch.config_checks import missing_paths

# role -> "module:function" taking the validated TandemConfig; imported only when that role runs.
ROLES = {
    "run": "launch.local:run",
    "buffer": "buffers.service:run",
    "generator": "actors.generator:run",
    "learner": "learners.learner:run",
    "reward": "actors.rewards.service:run",
    "ray": "launch.ray.launcher:run",
    "sft": "learners.offline.loop:run_sft",
    "rm": "learners.offline.loop:run_rm",
    "dpo": "learners.offline.loop:run_dpo",
}
# Commands that stop on a GPU install whose torch sees no GPU (common.devices.require_gpu_if_expected), instead of
# training or sampling on the CPU; not in SIMULATION mode, which uses no engine.
NEEDS_GPU = ("demo", "run", "learner", "generator", "sft", "rm", "dpo")
# command -> its own flags (each a store_true) -> help; every other `--section.key VALUE` is a config override.
FLAGS = {
    "prepare-model": {"--check": "also load it with transformers and vLLM"},
    "slurm": {"--submit": "also submit the jobs (sbatch, on a Slurm login node)"},
    "config": {
        "--no-path-checks": "do not check the paths a run needs on this machine (model.path, env.source and its "
        "first rows, run.curve_keys_dir): for a config of other machines, e.g. a Ray cluster's"
    },
}
TAKES_OVERRIDES = (
    "demo",
    *ROLES,
    "config",
    "slurm",
)  # `keys` and `prepare-model` take none: any other argument is refused
RAY_ACTIONS = ("scale", "status", "stop")  # `tandem ray ACTION RUN ...` (launch.ray.control), not a config
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


def config_error(
    config_path: Path, problems: list[str], arguments: list[str], written: dict[str, str] | None = None
) -> int:
    """Print each problem as one line on stderr: `tandem: --section.key VALUE: what to change` when a command-line
    override is the mistake (the problem starts with an override, or one of the `arguments` left for overrides, or
    names a key that an override set: `written`, dotted key -> the override as written), else `tandem: config
    error in PATH: key: what to change`. Returns the exit code of a usage error (2, as argparse's)."""
    hint = "" if config_path.exists() else f" (packaged configs by name: {', '.join(packaged_configs())})"
    for problem in problems:
        key, _, rest = problem.partition(": ")
        if written and key in written:
            problem = f"{written[key]}: {rest}"
        if problem.startswith("--") or key in arguments:
            print(f"tandem: {problem}", file=sys.stderr)
        else:
            print(
                f"tandem: config error in {config_path}: {problem.removeprefix(f'{config_path}: ')}{hint}",
                file=sys.stderr,
            )
    return USAGE_ERROR


def unknown_flag(command: str, flag: str) -> int:
    """`tandem COMMAND --chek`: one line naming the flag, the close one (`did you mean --check?`) or the flags
    COMMAND takes; the exit code of a usage error."""
    known = [*FLAGS.get(command, {}), "--help"]
    close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1, cutoff=0.6)
    if close:
        print(f"tandem {command}: unknown flag {flag}; did you mean {close[0]}?", file=sys.stderr)
    else:
        print(f"tandem {command}: unknown argument {flag} (it takes {', '.join(known)})", file=sys.stderr)
    return USAGE_ERROR


def _misspelled_flag(command: str, extra: list[str]) -> str | None:
    """The first argument left over by argparse that COMMAND cannot take: any, for a command without overrides;
    for one with overrides, a dotless `--word` close to one of its own flags (`--no-path-check`); the rest are
    overrides, judged by load_config."""
    for arg in extra:
        if command not in TAKES_OVERRIDES:
            return arg
        word = arg.split("=", 1)[0]
        if word.startswith("--") and "." not in word and difflib.get_close_matches(word, FLAGS.get(command, {})):
            return arg
    return None


OVERRIDES_HELP = """overrides: any config key, as --section.key VALUE (or --section.key=VALUE); VALUE parses as TOML
(1e-6, true, [0, 2], "text"), else it is the text as written. For example:
  tandem {command} {config}--learner.total_steps 10 --generator.temperature 0.7 --run.name try-1
The keys, their defaults and what each allows: docs/config.md; a config's resolved values: tandem config CONFIG."""


def _role_parser(sub: Any, command: str, text: str, config_example: str) -> argparse.ArgumentParser:
    """The subcommand COMMAND, whose usage and epilog show the override syntax (`tandem run --help`)."""
    flags = "".join(f" [{flag}]" for flag in FLAGS.get(command, {}))
    return sub.add_parser(
        command,
        help=text,
        usage=f"%(prog)s [-h]{flags} {'config ' if config_example else ''}[--section.key VALUE ...]",
        description=text[0].upper() + text[1:] + ".",
        epilog=OVERRIDES_HELP.format(command=command, config=config_example),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Asynchronous actor-learner RL for language models (vLLM generators, a staleness-bounded "
        "replay buffer, DeepSpeed learners). Any config key can be overridden: --section.key VALUE "
        "(`tandem run --help` shows how).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _role_parser(sub, "demo", "run the embedded default (SmolLM2-135M on arithmetic, async GRPO)", "")
    for role, text in [
        ("run", "start the buffer, generator(s) and learner rank(s) on this machine"),
        ("buffer", "start the buffer service alone"),
        ("generator", "start one generator alone (--generator.index I)"),
        ("learner", "start one learner rank alone"),
        ("sft", "supervised fine-tuning on chats ([sft]); the model goes to <run_dir>/model"),
        ("rm", "train a reward model on preference pairs ([rm], Bradley-Terry); exported to <run_dir>/model"),
        ("dpo", "DPO of the policy against a frozen reference on preference pairs ([dpo]); to <run_dir>/model"),
        ("reward", "start the reward service alone (scores env.reward_model for the generators)"),
        (
            "ray",
            (
                "place the fleets on a Ray cluster (RAY_ADDRESS, or a local one); then "
                "`tandem ray scale RUN --generators N`, `tandem ray status RUN`, `tandem ray stop RUN`"
            ),
        ),
        (
            "slurm",
            (
                "write a run's Slurm jobs (buffer, generator array, learner nodes) as sbatch scripts under "
                "<run_dir>/slurm (--submit: and submit them)"
            ),
        ),
        ("config", "print the resolved config (JSON), after checking the paths a `tandem run` needs here"),
    ]:
        cmd = _role_parser(sub, role, text, "demo ")
        names = ", ".join(packaged_configs())
        cmd.add_argument(
            "config", type=resolve_config_path, help=f"TOML run config, or a packaged one by name ({names})"
        )
        for flag, flag_help in FLAGS.get(role, {}).items():
            cmd.add_argument(flag, action="store_true", help=flag_help)
    keys = sub.add_parser(
        "keys",
        help="write CurveZMQ keys for run.curve_keys_dir: the server's and one per role (generator, learner, reward, "
        "eval, monitor), secrets 0600 in a 0700 directory",
    )
    keys.add_argument("dir", type=Path, help="directory to create (or an empty one); existing keys are never replaced")
    # `tandem eval ...` is parsed by launch.evaluate (its own flags, no config overrides); listed here for --help.
    sub.add_parser("eval", help="evaluate models or checkpoints with vLLM: accuracy, pass@k, reward (tandem eval -h)")
    # `tandem plot ...` likewise (launch.plot).
    sub.add_parser("plot", help="plot a run's eval curves against policy version and wall time (tandem plot -h)")
    prep = sub.add_parser("prepare-model", help="prepare the embedded SmolLM2-135M-Instruct model in the cache")
    for flag, flag_help in FLAGS["prepare-model"].items():
        prep.add_argument(flag, action="store_true", help=flag_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    skip_exit_gc()  # role processes hold torch and vLLM: exit without automatic collections (common/teardown.py)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ray"] and argv[1:2] and argv[1] in RAY_ACTIONS:
        from launch.ray.control import main as ray_control

        return ray_control(argv[1:])
    if argv[:1] == ["eval"]:
        from launch.evaluate import main as evaluate

        return evaluate(argv[1:])
    if argv[:1] == ["plot"]:
        from launch.plot import main as plot

        return plot(argv[1:])
    args, overrides = _parser().parse_known_args(argv)
    misspelled = _misspelled_flag(args.command, overrides)
    if misspelled is not None:
        return unknown_flag(args.command, misspelled)
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
        return config_error(config_path, str(error).splitlines(), overrides)
    problems = missing_paths(config, _checked_as(args))
    if problems:
        if args.command == "config":  # one line each: the flag for a config meant for other machines
            problems = [f"{problem} (for a config of other machines: --no-path-checks)" for problem in problems]
        return config_error(config_path, problems, overrides, override_spellings(overrides))
    if args.command == "slurm":
        from launch.slurm import run as write_slurm_jobs

        return write_slurm_jobs(config, submit=args.submit)
    if args.command == "config":
        from common.dtypes import machine_summary, read_cpu_flags

        print(config.model_dump_json(indent=2))
        print(machine_summary(config.model.dtype, read_cpu_flags()), file=sys.stderr)  # stdout stays JSON
        return 0
    if args.command in NEEDS_GPU and not config.run.simulate:
        from common.devices import require_gpu_if_expected

        require_gpu_if_expected()
    module, function = ROLES["run" if args.command == "demo" else args.command].split(":")
    try:
        result = getattr(importlib.import_module(module), function)(config)
    finally:
        from common.sockets import release_context

        release_context()  # no zero-copy frame may outlive the memory it points into (see release_context)
    return int(result or 0)


def _checked_as(args: argparse.Namespace) -> str:
    """The role whose paths `tandem COMMAND` checks on this machine (config_checks.NEEDS): `tandem demo` and
    `tandem config` those of a `tandem run` (`config` none with --no-path-checks); `tandem ray` and `tandem slurm`
    none (the nodes check their own as each role starts)."""
    if args.command == "demo" or (args.command == "config" and not args.no_path_checks):
        return "run"
    return args.command


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
