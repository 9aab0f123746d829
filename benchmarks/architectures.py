"""Every tiny architecture family (common.tiny_models) through the whole loop on the CPU, one family at a time:

    .venv/bin/python -m benchmarks.architectures                   # all families -> results/architectures.json
    .venv/bin/python -m benchmarks.architectures --only qwen3 mixtral --no-vllm

Per family, in one process, with one vLLM engine (the project's `VllmEngine`, model.dtype float32):
  sample   the engine loads the tiny model and samples greedily (a few fixed prompts);
  zero1    the project's `Trainer` takes one step with DeepSpeed ZeRO-1 (lr 1e-2: the weights move well past the
           tolerances below), then its HF export (`save_state` -> hf/) reloads with AutoModelForCausalLM and gives
           the trainer's logits bit for bit (same float32 weights, same transformers kernels, same process);
  zero3    the same with ZeRO-3 (the export is a gather);
  update   the ZeRO-3 trainer's weights published by the project's ZeroMQ publisher (`weight_layout`,
           `full_weights`), fetched by the generator's source, loaded in place by `VllmEngine.load_weights`; the
           engine's greedy log-probs then match transformers' on the exported weights within `logprob_tolerance`,
           and differ from transformers' on the old weights by more than 10x that (so a lost update fails).
A part that fails records the error's first line (vLLM's own for an engine that cannot run a family) and the
family's later parts that need it are skipped. Each part is timed; `headline` says which parts pass for how many
families and the matrix's wall time. tests/benchmarks/test_architectures.py runs the cheap parts for every family
and the whole path for two (docs/models.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

PARTS = ("sample", "zero1", "zero3", "update")
PROMPTS = [[1, 17, 300, 42, 9, 1024], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2000, 3000, 4000]]
MAX_TOKENS = 8
LR = 1e-2
# float32 unit roundoff, the longest dot product of the tiny models (MLP 128; experts the same or less), the
# vocabulary the log-softmax normalises over, and the reductions in series from the embedding to a logit (2 layers
# x q/k/v, scores, softmax sum, weighted sum, o, norm, gate/up, down; + final norm and the head): see logprob_tolerance
UNIT_ROUNDOFF = 2.0**-24
LONGEST_DOT = 128
VOCAB = 49152
SERIAL_REDUCTIONS = 20


def logprob_tolerance(logprob: float) -> float:
    """Bound on |log p_engine - log p_transformers| for one token, both in float32 on the same weights.

    The two compute the same function with different kernels (oneDNN and vLLM's CPU attention vs torch's), so they
    differ only in the order and blocking of float32 sums. Reordering a sum of n terms moves it by ~sqrt(n) u of its
    scale (u = 2^-24; n u is the worst case, which random-sign terms do not reach); a logit goes through
    SERIAL_REDUCTIONS such sums of <= LONGEST_DOT terms, each error relative to the scale of what flows through, and
    log p = z_t - logsumexp(z) adds the log-sum-exp over VOCAB terms, whose relative reorder error sqrt(V) u is an
    absolute one in log space. Hence (SERIAL_REDUCTIONS sqrt(LONGEST_DOT) + sqrt(VOCAB)) u (1 + |log p|):
    (20 x 11.3 + 222) x 6e-8 = 2.7e-5 relative, ~3.2e-4 at log p = -11 (a random tiny model's typical value).
    A bf16 engine would need eps_bf16 = 2^-8 in place of u: this check runs float32 on purpose."""
    per_unit = SERIAL_REDUCTIONS * math.sqrt(LONGEST_DOT) + math.sqrt(VOCAB)
    return per_unit * UNIT_ROUNDOFF * (1.0 + abs(logprob))


def first_line(error: BaseException) -> str:
    """The error as one line: its type and the last non-empty line of its message (vLLM puts the cause last)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:400]


# ------------------------------------------------------------------------------------------------ parts


def start_engine(model_dir: Path) -> Any:
    """The project's vLLM engine on `model_dir` (float32, greedy, max_model_len 256, 1 GiB of KV cache)."""
    from actors.engine.api import SamplingSettings
    from actors.engine.vllm import VllmEngine, configure_cpu_environment
    from common.config import GeneratorConfig, ModelConfig

    configure_cpu_environment(GeneratorConfig(kv_cache_gib=1.0))
    settings = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=0)
    model = ModelConfig(path=str(model_dir), dtype="float32", max_model_len=256)
    return VllmEngine(model_dir, model, settings, 8, True)


def greedy(engine: Any) -> list[tuple[list[int], list[float]]]:
    """(tokens, behaviour log-probs) of PROMPTS sampled greedily, in PROMPTS order."""
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"{engine.policy_version}:{i}:0", prompt)
    finished = {}
    while engine.num_unfinished():
        for sample in engine.step():
            finished[sample.request_id] = sample
    ordered = [finished[f"{engine.policy_version}:{i}:0"] for i in range(len(PROMPTS))]
    return [(s.completion_tokens.tolist(), s.behaviour_logprobs.tolist()) for s in ordered]


def transformers_logprobs(model_dir: Path, samples: list[tuple[list[int], list[float]]]) -> list[list[float]]:
    """log p(token) of each sample's completion tokens under the HF model in `model_dir` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    out = []
    with torch.no_grad():
        for prompt, (tokens, _) in zip(PROMPTS, samples):
            ids = torch.tensor([prompt + tokens])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [T, V]
            positions = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))  # each predicts the next token
            out.append([float(logprobs[p, t]) for p, t in zip(positions, tokens)])
    return out


def make_trainer(model_dir: Path, zero_stage: int, dist: Any) -> Any:
    from common.config import load_config
    from learners.trainer import Trainer

    values = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "algo.group_size": 4,
        "algo.max_staleness": 1,
        "learner.groups_per_step": 2,
        "learner.micro_batch_size": 4,
        "learner.lr": LR,
        "learner.zero_stage": zero_stage,
    }
    return Trainer.from_config(load_config(None, values), dist)


def synthetic_batch() -> tuple[list, list]:
    """2 groups of 4 samples of random tokens, varied lengths, rewards with a spread (common.types.RolloutGroup)."""
    import numpy as np

    from common.types import RolloutGroup

    rng = np.random.default_rng(0)
    groups = []
    for g in range(2):
        lengths = rng.integers(2, 7, 4)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        total = int(offsets[-1])
        groups.append(
            RolloutGroup(
                lease_id=0,
                prompt_id=g,
                epoch=0,
                generator_id=0,
                prompt_tokens=rng.integers(3, 4000, int(rng.integers(4, 9))).astype(np.int32),
                offsets=offsets,
                completion_tokens=rng.integers(3, 4000, total).astype(np.int32),
                behaviour_logprobs=np.full(total, -10.8, dtype=np.float32),  # ~ log(1 / 49152): a near-uniform model
                loss_mask=np.ones(total, dtype=np.uint8),
                token_versions=np.zeros(total, dtype=np.int32),
                versions=np.zeros(4, dtype=np.int32),
                rewards=rng.random(4).astype(np.float32),
                finish_reasons=["length"] * 4,
            )
        )
    return groups, [np.zeros(group.size, dtype=np.int32) for group in groups]


def train_and_export(model_dir: Path, zero_stage: int, out: Path, dist: Any) -> Any:
    """One step of a fresh trainer, its HF export reloaded and its logits compared bit for bit. Returns the trainer
    (its export in `out/hf`). Raises AssertionError when the step is not finite, moves nothing, or the export's
    logits differ."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(model_dir, zero_stage, dist)
    groups, staleness = synthetic_batch()
    stats = trainer.train_step(groups, staleness)
    assert math.isfinite(stats["loss/policy"]), f"a non-finite loss: {stats['loss/policy']}"
    assert stats["learner/steps_skipped_nonfinite"] == 0, "the step was skipped as not finite"
    trainer.save_state(out)
    exported = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32, local_files_only=True)
    ids = torch.tensor([PROMPTS[0]])
    module = trainer.policy.module
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(module.parameters())):
        mine, theirs = module.eval()(input_ids=ids).logits, exported.eval()(input_ids=ids).logits
        module.train()
    original = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        before = original.eval()(input_ids=ids).logits
    assert not torch.equal(before, theirs), "the step moved no weight the logits depend on"
    assert torch.equal(mine, theirs), f"export logits differ by {float((mine - theirs).abs().max()):.3g}"
    return trainer


def publish_to_engine(trainer: Any, engine: Any, version: int) -> str:
    """The trainer's full weights through the learner's ZeroMQ publisher to the generator's source (star), loaded
    into `engine`; returns the engine's load path: "in_place" (every tiny family on CPU, the fused-MoE experts
    included: actors/weights/in_place_load.py), or "layerwise" (vLLM's layerwise reload, which `actors.engine.vllm.WeightLoader`
    takes elsewhere, e.g. on a GPU)."""
    from actors.weights.updates import ZmqWeightsSource
    from common.sockets import SocketSecurity
    from launch.testing import free_port
    from learners.publisher import ZmqWeightsPublisher

    port = free_port()
    publisher = ZmqWeightsPublisher("127.0.0.1", port, SocketSecurity())
    source = ZmqWeightsSource(f"127.0.0.1:{port}", SocketSecurity(), generator_id=0, timeout_s=60)
    try:
        publisher.publish(version, trainer.weight_layout(), trainer.full_weights())
        update = source.fetch(0)
        assert not isinstance(update, int), f"the publisher answered 'nothing newer' ({update})"
        engine.load_weights(update, inflight=False)
    finally:
        source.close()
        publisher.close()
    assert engine.policy_version == version, f"the engine is at version {engine.policy_version}, not {version}"
    assert engine.last_load_path in ("in_place", "layerwise"), engine.last_load_path
    return engine.last_load_path


def compare_logprobs(samples: list, new: list[list[float]], old: list[list[float]]) -> dict[str, float]:
    """Max |engine - transformers(new)| over its tolerance (must be <= 1), and the least max |engine -
    transformers(old)| over the tolerance (must be > 10: the engine runs the new weights, not the old)."""
    worst_new = worst_old = 0.0
    for (_, engine_lp), new_lp, old_lp in zip(samples, new, old):
        worst_new = max(worst_new, max(abs(e - n) / logprob_tolerance(n) for e, n in zip(engine_lp, new_lp)))
        worst_old = max(worst_old, max(abs(e - o) / logprob_tolerance(o) for e, o in zip(engine_lp, old_lp)))
    return {"new_over_tolerance": worst_new, "old_over_tolerance": worst_old}


# ------------------------------------------------------------------------------------------------ matrix


def check_family(family: str, work: Path, dist: Any, vllm: bool = True, parts: tuple[str, ...] = PARTS) -> dict:
    """Run `parts` for `family` in `work` (its model, exports); a record per part: status passed / failed /
    skipped, seconds, error (one line), figures. Never raises for a family's failure: the matrix goes on."""
    from common.tiny_models import make_tiny_family

    record: dict[str, Any] = {"family": family, "parts": {}}
    started = time.perf_counter()
    model_dir = make_tiny_family(work / family / "model", family, seed=0)
    record["build_s"] = round(time.perf_counter() - started, 2)
    engine, trainer3, before = None, None, None

    def run(part: str, needs: bool, body: Any) -> Any:
        if part not in parts:
            return None
        if not needs:
            record["parts"][part] = {"status": "skipped", "error": "a part it needs failed or was not run"}
            return None
        start = time.perf_counter()
        try:
            value, figures = body(), {}
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
                value, figures = value
            record["parts"][part] = {"status": "passed", **figures}
        except Exception as error:  # noqa: BLE001  # one family's failure is a row of the matrix, not its end
            traceback.print_exc()
            value = None
            record["parts"][part] = {"status": "failed", "error": first_line(error)}
        record["parts"][part]["seconds"] = round(time.perf_counter() - start, 2)
        return value

    try:
        if vllm:

            def sample() -> tuple[Any, dict[str, float]]:
                started_engine = start_engine(model_dir)
                nonlocal before
                before = greedy(started_engine)
                # the fresh engine against transformers on the same weights, no update involved (a figure only)
                fresh = compare_logprobs(before, transformers_logprobs(model_dir, before), [[0.0] * MAX_TOKENS] * 3)
                return started_engine, {"fresh_over_tolerance": fresh["new_over_tolerance"]}

            engine = run("sample", True, sample)
        run("zero1", True, lambda: train_and_export(model_dir, 1, work / family / "zero1", dist))
        trainer3 = run("zero3", True, lambda: train_and_export(model_dir, 3, work / family / "zero3", dist))

        def update() -> tuple[None, dict[str, Any]]:
            load_path = publish_to_engine(trainer3, engine, 1)
            after = greedy(engine)
            figures: dict[str, Any] = compare_logprobs(
                after,
                transformers_logprobs(work / family / "zero3" / "hf", after),
                transformers_logprobs(model_dir, after),
            )
            assert figures["new_over_tolerance"] <= 1.0, f"engine vs transformers: {figures}"
            assert figures["old_over_tolerance"] > 10.0, f"the engine's log-probs are the old model's: {figures}"
            figures["tokens_changed"] = [t for t, _ in after] != [t for t, _ in before]
            figures["load_path"] = load_path
            return None, figures

        run("update", vllm and engine is not None and trainer3 is not None, update)
    finally:
        if engine is not None:
            engine.shutdown()
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per part, the families that pass it; the matrix's wall time (every family's seconds, summed: build, engine
    start, steps, exports, update)."""
    rows = result["families"]
    passed = {part: [r["family"] for r in rows if r["parts"].get(part, {}).get("status") == "passed"] for part in PARTS}
    return {
        "families": len(rows),
        **{f"{part}_passed": len(names) for part, names in passed.items()},
        "failed": sorted(
            {f"{r['family']}:{p}" for r in rows for p, v in r["parts"].items() if v["status"] == "failed"}
        ),
        "wall_s": result["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    from common.tiny_models import TINY_FAMILIES

    parser = argparse.ArgumentParser(prog="python -m benchmarks.architectures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(TINY_FAMILIES), help="these families (default: all)")
    parser.add_argument("--no-vllm", action="store_true", help="leave out the engine (sample, update)")
    parser.add_argument("--no-save", action="store_true", help="print, write nothing to results/")
    parser.add_argument(
        "--merge", action="store_true", help="with --only: replace those families' rows in the saved results"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from learners.engine import init_distributed

    dist = init_distributed()
    started, families = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="tandem-architectures-") as tmp:
        for family in args.only or list(TINY_FAMILIES):
            record = check_family(family, Path(tmp), dist, vllm=not args.no_vllm)
            print(f"{family}: {record}", flush=True)
            families.append(record)
    from benchmarks.common import RESULTS, save

    if args.merge and args.only:  # the other families' rows as saved; wall_s: every family's seconds, summed
        ran = {record["family"] for record in families}
        saved = json.loads((RESULTS / "architectures.json").read_text())["families"]
        order = list(TINY_FAMILIES)
        families = sorted(
            [r for r in saved if r["family"] not in ran] + families, key=lambda r: order.index(r["family"])
        )
    result: dict[str, Any] = {"families": families, "wall_s": round(sum(r["seconds"] for r in families), 1)}
    result["headline"] = headline(result)
    print(result["headline"], f"(this run: {time.perf_counter() - started:.0f} s)", flush=True)
    if not args.no_save and (args.merge or not args.only):
        save("architectures", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
