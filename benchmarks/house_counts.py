"""The house's counts (issue 34 and `../shared/reviews/house-review.md`), from the source alone; seconds, no model.

    .venv/bin/python -m benchmarks.house_counts
    git worktree add /tmp/before <commit> && .venv/bin/python -m benchmarks.house_counts --repo /tmp/before --out house_counts_before

What it counts, over the role packages actors/ buffers/ learners/ common/ launch/:
  eval_methods        per role, the methods of its main class that mention evaluation: a method's source has a
                      word starting with `eval` (eval, evaluation, _on_eval_grant, eval_set; not retrieval) in its
                      name, code, comments or docstring. The classes: actors/generator.py `Generator`,
                      buffers/core.py `BufferCore`, and the learner's loop: learners/learner.py `Learner` when it is
                      a class, else the module's functions (the loop is then the function `run`)
  learner_loop_lines  lines of learners/learner.py `run` (the learner's loop, as the generator's is its `run`)
  generator_loop_lines lines of actors/generator.py's `run`, for comparison
  largest_file        the longest source file and its lines; files_over_400 how many pass 400 lines
  modules_per_folder  .py modules directly in each folder (sub-packages counted as their own folders)
  source_lines        all lines of the role packages' .py files
The review's own counts (on 2026-12-01's tree) were 11 of the generator's 18 methods, 8 of BufferCore's 23 and 1
learner function; its rule was read by hand, this one is a regular expression, so compare like with like: the
figures this script saved before a change against those it saves after.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.common import save

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "buffers", "learners", "common", "launch")
MENTIONS_EVAL = re.compile(r"(?<![A-Za-z])eval", re.IGNORECASE)  # `_eval` and `eval` count, `retrieval` does not
LONG_FILE = 400
ROLE_CLASSES = {"generator": ("actors/generator.py", "Generator"), "buffer_core": ("buffers/core.py", "BufferCore")}


def _functions(body: list[ast.stmt]) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)


def eval_mentions(path: Path, class_name: str | None) -> dict[str, Any]:
    """{methods, mentioning, names}: the methods of `class_name` in `path` (the module's functions when
    `class_name` is None or absent) and which of them mention evaluation."""
    source = path.read_text()
    tree = ast.parse(source)
    owner = _class(tree, class_name) if class_name else None
    functions = _functions(owner.body if owner is not None else tree.body)
    names = [f.name for f in functions if MENTIONS_EVAL.search(ast.get_source_segment(source, f) or "")]
    return {
        "where": f"{path.name}:{owner.name if owner else 'module'}",
        "methods": len(functions),
        "mentioning": len(names),
        "names": names,
    }


def function_lines(path: Path, name: str) -> int | None:
    """Lines of the module-level function (or `Learner` method) `name` in `path`, decorators and docstring included."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    return None


def counts(repo: Path = REPO) -> dict[str, Any]:
    files = sorted(p for package in PACKAGES for p in (repo / package).rglob("*.py"))
    lines = {str(p.relative_to(repo)): len(p.read_text().splitlines()) for p in files}
    folders: dict[str, int] = {}
    for p in files:
        folder = str(p.parent.relative_to(repo))
        folders[folder] = folders.get(folder, 0) + (p.name != "__init__.py")
    learner = repo / "learners" / "learner.py"
    has_class = _class(ast.parse(learner.read_text()), "Learner") is not None
    eval_methods = {role: eval_mentions(repo / path, name) for role, (path, name) in ROLE_CLASSES.items()}
    eval_methods["learner"] = eval_mentions(learner, "Learner" if has_class else None)
    largest = max(lines, key=lines.__getitem__)
    return {
        "eval_methods": eval_methods,
        "learner_loop_lines": function_lines(learner, "run"),
        "generator_loop_lines": function_lines(repo / "actors" / "generator.py", "run"),
        "largest_file": {"path": largest, "lines": lines[largest]},
        "files_over_400": sorted(path for path, n in lines.items() if n > LONG_FILE),
        "modules_per_folder": dict(sorted(folders.items())),
        "source_lines": sum(lines.values()),
        "lines": lines,
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "eval_methods": {role: f"{c['mentioning']} of {c['methods']}" for role, c in result["eval_methods"].items()},
        "largest_file_lines": result["largest_file"]["lines"],
        "files_over_400": len(result["files_over_400"]),
        "learner_loop_lines": result["learner_loop_lines"],
        "modules_per_folder": result["modules_per_folder"],
    }


def _commit(repo: Path) -> str | None:
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    )
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to count (default this one)")
    parser.add_argument("--out", default="house_counts", help="results/<OUT>.json")
    args = parser.parse_args(argv)
    result = counts(args.repo.resolve())
    result["commit"] = _commit(args.repo)
    result["headline"] = headline(result)
    for key, value in result["headline"].items():
        print(f"{key}: {value}")
    print(f"largest file: {result['largest_file']['path']}")
    save(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
