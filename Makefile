# The two commands of the README:
#   make demo   set up, then run the embedded default (SmolLM2-135M-Instruct, arithmetic, async GRPO)
#   make test   set up, then run the test suite
.PHONY: setup demo test bench clean

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/tandem demo

test: setup
	.venv/bin/python -m pytest tests -q -ra --durations=15

bench: setup
	.venv/bin/python -m benchmarks.run_all

clean:
	rm -rf .venv runs
