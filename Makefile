# The two commands of the README:
#   make demo   set up, then run the embedded default (SmolLM2-135M-Instruct, arithmetic, async GRPO)
#   make test   set up, lint (ruff check, ruff format --check), then run the whole test suite
# and, while working: make test-fast (the unit tests, under a minute), make lint
.PHONY: setup demo lint test test-fast bench clean

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/tandem demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Two pytest-xdist workers: the suite waits on processes and engines more than it computes (one worker kept a 2-core
# machine 77% busy, two 117%), so two overlap those waits. Three were 8% faster (13:43 against 14:58 of tests) but
# 141% busy, and a vLLM test whose weight update must land mid-sample failed under that load. A module's tests, and
# all of Ray's, share a worker (tests/conftest.py, worker_scope), and modules go out in the order tests/conftest.py
# sorts them (Ray, then engines, then processes, then the rest), not xdist's (most tests first, which left
# single-test vLLM modules to the end).
TEST_WORKERS ?= 2

test: lint
	.venv/bin/python -m pytest tests -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-fast: setup
	.venv/bin/python -m pytest tests -q -ra -m "not integration"

bench: setup
	.venv/bin/python -m benchmarks.run_all

clean:
	rm -rf .venv runs
