# The two commands of the README:
#   make demo   set up, then run the embedded default (SmolLM2-135M-Instruct, arithmetic, async GRPO)
#   make test   set up, lint (ruff check, ruff format --check), then run the whole test suite
# and, while working: make test-fast (the unit tests, under a minute), make lint, make durations (the order of
# make test's units: tests/durations.json)
.PHONY: setup demo lint test test-fast durations bench clean

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/tandem demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Two pytest-xdist workers: the suite waits on processes and engines more than it computes (one worker kept a 2-core
# machine 77% busy, two 117%), so two overlap those waits. A module's tests, and all of Ray's, share a worker
# (tests/conftest.py, worker_scope). Measured in fresh clones on a 2-core AVX-512 EPYC: xdist's order (modules with
# most tests first) 14:58 of tests; the engines' modules first 15:45 (they slowed each other); three workers 13:43,
# but a vLLM test whose weight update must land mid-sample failed at that load. On a 2-core AVX2-only EPYC (Zen 3)
# the suite is CPU-bound: two workers 17:29-19:22 of tests, three 19:51 (1,964 CPU-seconds in 1,191 s: 1.65 cores).
# The units go out longest first, as measured in tests/durations.json (tests/conftest.py, costliest_scopes_first): on
# that AVX2 EPYC 16:29 -> 15:12 of tests, the two workers ending 1 s apart instead of 60 s (the Ray unit beside the
# engines' modules, not the engines' modules beside each other). `make durations` measures them again.
TEST_WORKERS ?= 2

test: lint
	.venv/bin/python -m pytest tests -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadscope

durations: setup
	.venv/bin/python -m pytest tests -q -n $(TEST_WORKERS) --dist loadscope --store-durations

test-fast: setup
	.venv/bin/python -m pytest tests -q -ra -m "not integration"

bench: setup
	.venv/bin/python -m benchmarks.run_all

clean:
	rm -rf .venv runs
