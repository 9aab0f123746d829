"""benchmarks/house_counts on a hand-made tree: which methods mention evaluation, the loop's length, the folders."""

from __future__ import annotations

from pathlib import Path

from benchmarks.house_counts import counts, headline

GENERATOR = '''
class Generator:
    def __init__(self):
        self.evaluation = None          # mentions it

    def run(self):
        while self.step():
            pass

    def step(self):
        return self.retrieval()         # "retrieval" is not evaluation

    def report(self):
        """Counts eval rows."""         # a docstring counts
'''
CORE = """
class Helper:
    def eval_thing(self): ...           # another class: not counted

class BufferCore:
    def _on_eval_grant(self): ...       # its name counts

    def tick(self): ...
"""
LEARNER_CLASS = """
def run(config):
    learner = Learner(config)
    while learner.step():
        pass
    return learner.finish()


class Learner:
    def step(self): ...

    def finish(self):
        wait_for_final_eval()
"""
LEARNER_FUNCTIONS = """
def run(config):
    for step in range(3):
        train()
    wait_for_final_eval()


def train(): ...
"""


def tree(root: Path, learner: str) -> Path:
    files = {
        "actors/generator.py": GENERATOR,
        "actors/__init__.py": "",
        "actors/weights/load.py": "x = 1\n" * 401,
        "buffers/core.py": CORE,
        "learners/learner.py": learner,
        "common/config.py": "",
        "launch/cli.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_counts_on_a_tree_whose_learner_is_a_class(tmp_path: Path) -> None:
    result = counts(tree(tmp_path, LEARNER_CLASS))
    methods = result["eval_methods"]
    assert methods["generator"]["names"] == ["__init__", "report"] and methods["generator"]["methods"] == 4
    assert methods["buffer_core"]["names"] == ["_on_eval_grant"] and methods["buffer_core"]["methods"] == 2
    assert methods["learner"] == {"where": "learner.py:Learner", "methods": 2, "mentioning": 1, "names": ["finish"]}
    assert result["learner_loop_lines"] == 5 and result["generator_loop_lines"] == 3
    assert result["largest_file"] == {"path": "actors/weights/load.py", "lines": 401}
    assert result["files_over_400"] == ["actors/weights/load.py"]
    # __init__.py is no module of its folder; a sub-package is a folder of its own
    assert result["modules_per_folder"] == {
        "actors": 1,
        "actors/weights": 1,
        "buffers": 1,
        "common": 1,
        "launch": 1,
        "learners": 1,
    }
    assert headline(result)["eval_methods"] == {"generator": "2 of 4", "buffer_core": "1 of 2", "learner": "1 of 2"}


def test_a_learner_without_a_class_is_counted_by_its_functions(tmp_path: Path) -> None:
    result = counts(tree(tmp_path, LEARNER_FUNCTIONS))
    assert result["eval_methods"]["learner"]["where"] == "learner.py:module"
    assert result["eval_methods"]["learner"]["names"] == ["run"]
    assert result["learner_loop_lines"] == 4
