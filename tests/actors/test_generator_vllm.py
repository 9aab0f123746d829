"""One real generator process (vLLM on the tiny model) against a fake buffer and the real weight publisher (relay
transport: chunks into a host copy that vLLM's workers map) on loopback.

One test runs the phases in order against the same process (starting vLLM costs ~20-40 s here; each phase needs
the state the ones before it left, so they are one test, which any `-k` selection runs whole or not at all):
  A  v0 groups are consistent, and their behaviour log-probs are those of a transformers forward pass;
  B  the "learner" publishes v1 (a sharpened copy of the weights) while the generator idles: later samples carry
     v1 and follow the new weights;
  C  v2 (another seed's weights, sharpened) is published while samples run: `inflight_weight_update` stamps each
     token with the weights that produced it; a raising reward function is survived;
  D  the buffer goes away and comes back on the same port: no group is lost;
  E  SIGTERM: every leased prompt is pushed or returned, the process and its vLLM children exit, status 0.

Log-prob tolerance. vLLM runs the model in bf16 (8 significant bits: a value x is off by up to |x| * 2^-9) and
returns log-probs of the distribution it sampled from (temperature applied, `processed_logprobs`). The reference is
the same bf16 weights run in float32 by transformers. The sharpened models' logits reach |x| ~ 20 (per-logit error
~0.04, over a temperature of 0.7 ~0.06) and two layers of bf16 activations add their own rounding, so a token's
log-prob may be off by ~0.1; we allow 0.25 per token and 0.05 on the median. The assertions that matter are much
coarser: the wrong weights, or a token shifted by one position, miss by several nats (checked too).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from common.metrics import read_metrics
from launch.testing import FakeBuffer, RelayPublisher, RoleUnderTest, arithmetic_items, run_config

pytestmark = pytest.mark.vllm

GROUP_SIZE = 4
MAX_TOKENS = 48
TEMPERATURE = 0.7
DOWN = "does not answer; reconnecting"  # the generator's log line when the buffer goes away (actors/outbox.py)
SHARPEN = 30.0  # final-norm scale of the published models: peaked distributions make log-prob checks sharp
ATOL, MEDIAN_TOL = 0.25, 0.05


def _checkpoint_arrays(model_dir: Path, sharpen: float) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The model's checkpoint tensors as publisher arrays (bf16 as raw words), final norm scaled by `sharpen`."""
    import torch
    from safetensors.torch import load_file

    arrays, dtypes = {}, {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name == "model.norm.weight":
            tensor = (tensor.float() * sharpen).to(torch.bfloat16)
        arrays[name] = tensor.contiguous().view(torch.uint16).numpy()
        dtypes[name] = "bfloat16"
    return arrays, dtypes


class Reference:
    """transformers forward passes in float32 of exactly the weights a version had."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_dir = model_dir
        self.models = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()}
        self._load = AutoModelForCausalLM.from_pretrained

    def add_version(self, version: int, arrays: dict[str, np.ndarray]) -> None:
        import torch

        model = self._load(self.model_dir, dtype="float32").eval()
        state = {name: torch.from_numpy(a.copy()).view(torch.bfloat16).float() for name, a in arrays.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        self.models[version] = model

    def logprobs(self, version: int, prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
        """log p(token_t | prefix) at TEMPERATURE, for every completion token, under `version`'s weights."""
        import torch

        ids = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))[None]
        with torch.no_grad():
            logits = self.models[version](ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
        picked = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(completion.astype(np.int64))[:, None])
        return picked[:, 0].numpy()


def _samples(group):
    for i in range(group.size):
        span = slice(group.offsets[i], group.offsets[i + 1])
        yield i, group.completion_tokens[span], group.behaviour_logprobs[span], group.token_versions[span]


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _groups_of(buffer: FakeBuffer, prompts, timeout_s: float) -> list:
    ids = {p.prompt_id for p in prompts}

    def all_arrived() -> bool:
        return ids <= {g.prompt_id for g in buffer.groups.values()}

    _wait(all_arrived, timeout_s, f"groups {sorted(ids)}")
    return [g for g in buffer.groups.values() if g.prompt_id in ids]


@pytest.fixture
def rig(tiny_model_dir: Path, tmp_path: Path):
    from common.model_prep import make_tiny_model

    tmp = tmp_path
    config = run_config(
        tmp / "runs",
        "gen",
        model={"path": str(tiny_model_dir), "max_model_len": 512},
        # η far above the run's groups: with no learner to train them, every group stays buffered and counts
        # against admission ((v + η + 1)·B), so with the default η = 2 the generator was refused "full" in phase C and
        # could load v2 idle, with no sample left to straddle the switch
        algo={"group_size": GROUP_SIZE, "max_staleness": 1000},
        env={"reward_fn": "tests.actors.reward_fns:explode_or_length", "failure_reward": -1.0},
        generator={
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "prompts_in_flight": 4,
            "inflight_weight_update": True,
            "drain_timeout_s": 0.5,
            "kv_cache_gib": 1.0,
            "reconnect_max_s": 0.5,
        },
    )
    buffer = FakeBuffer(config, arithmetic_items(4), lease_size=2, when_empty="full").start()
    publisher = RelayPublisher(config.learner.weights_port, bucket_bytes=4 << 20).start()
    process = RoleUnderTest(config, "generator").start()
    rig = {
        "buffer": buffer,
        "publisher": publisher,
        "process": process,
        "run_dir": tmp / "runs" / "gen",
        "reference": Reference(tiny_model_dir),
        "v1": _checkpoint_arrays(tiny_model_dir, SHARPEN),
        "v2": _checkpoint_arrays(make_tiny_model(tmp / "seed1", seed=1), SHARPEN),
    }
    try:
        yield rig
    finally:
        process.stop(grace_s=30)  # a phase failed before SIGTERM: stop it cleanly so vLLM frees its shared memory
        buffer.stop()
        publisher.stop()


def _check_logprobs(reference: Reference, group) -> list[float]:
    errors = []
    for _, tokens, logprobs, versions in _samples(group):
        for version in np.unique(versions):
            mine = versions == version
            expected = reference.logprobs(int(version), group.prompt_tokens, tokens)[mine]
            errors.extend(np.abs(expected - logprobs[mine]).tolist())
    assert max(errors) < ATOL and float(np.median(errors)) < MEDIAN_TOL, (max(errors), np.median(errors))
    return errors


def test_generator_samples_follows_weights_survives_a_buffer_restart_and_exits_on_sigterm(rig):
    """The phases A to E of the module docstring, in order (each needs the state the previous ones left)."""
    _phase_a_groups_are_consistent_and_logprobs_match_transformers(rig)
    _phase_b_published_weights_change_the_version_and_the_outputs(rig)
    _phase_c_inflight_update_stamps_each_token_with_its_weights(rig)
    _phase_d_buffer_restart_loses_no_group(rig)
    _phase_e_sigterm_returns_unfinished_leases_and_exits_zero(rig)


def _phase_a_groups_are_consistent_and_logprobs_match_transformers(rig):
    from common.tasks import render_prompt

    reference, prompts = rig["reference"], arithmetic_items(4)
    groups = _groups_of(rig["buffer"], prompts, timeout_s=240)
    for group in groups:
        prompt = prompts[group.prompt_id]
        assert group.prompt_tokens.tolist() == render_prompt(reference.tokenizer, prompt)
        assert group.size == GROUP_SIZE and set(group.finish_reasons) <= {"stop", "length"}
        assert np.all(np.diff(group.offsets) <= MAX_TOKENS) and group.loss_mask.all()
        assert (group.token_versions == 0).all() and (group.versions == 0).all()
        assert np.all(group.behaviour_logprobs <= 0)
        assert group.reward_components["length"].shape == (GROUP_SIZE,)
    _check_logprobs(reference, groups[0])
    rig["v0_groups"] = groups


def _phase_b_published_weights_change_the_version_and_the_outputs(rig):
    buffer, publisher, reference = rig["buffer"], rig["publisher"], rig["reference"]
    arrays, dtypes = rig["v1"]
    reference.add_version(1, arrays)
    publisher.publish(1, arrays, dtypes)
    _wait(lambda: any(h.policy_version == 1 for h in buffer.heartbeats), 30, "a heartbeat at v1")
    prompts = arithmetic_items(4, first_id=100)
    buffer.add_prompts(prompts)
    groups = _groups_of(buffer, prompts, timeout_s=60)
    for group in groups:
        assert (group.token_versions == 1).all() and (group.versions == 1).all()
        _check_logprobs(reference, group)
    # The new weights, not the old ones, produced these tokens: under v0 they would have other log-probs.
    _, tokens, logprobs, _ = next(_samples(groups[0]))
    old = reference.logprobs(0, groups[0].prompt_tokens, tokens)
    assert np.abs(old - logprobs).mean() > 1.0
    v0_mean = np.mean([g.behaviour_logprobs.mean() for g in rig["v0_groups"]])
    v1_mean = np.mean([g.behaviour_logprobs.mean() for g in groups])
    assert v1_mean > v0_mean + 2.0  # sharpened: far more confident than the near-uniform random model


def _phase_c_inflight_update_stamps_each_token_with_its_weights(rig):
    buffer, publisher, reference = rig["buffer"], rig["publisher"], rig["reference"]
    arrays, dtypes = rig["v2"]
    reference.add_version(2, arrays)
    prompts = arithmetic_items(12, explode_every=5, first_id=200)  # 200, 205 and 210 raise in the reward function
    buffer.add_prompts(prompts)
    # Publish once the first group is back: the generator has leased more prompts and is sampling them. The buffer is
    # topped up from the start of the phase until a group carries v2, so the generator never runs out of prompts (an
    # idle generator loads v2 with no sample to straddle the switch), whatever the speed of the machine.
    published = False
    deadline = time.monotonic() + 150
    while not any(g.prompt_id >= 200 and g.versions.max() == 2 for g in list(buffer.groups.values())):
        assert time.monotonic() < deadline, "no group carried v2 within 150 s of the phase's start"
        if not published and any(g.prompt_id >= 200 for g in list(buffer.groups.values())):
            publisher.publish(2, arrays, dtypes)
            published = True
        with buffer.lock:
            starving = len(buffer.queue) < 4
        if starving:
            assert len(prompts) < 96, "phase D's prompt ids start at 300"
            more = arithmetic_items(4, first_id=200 + len(prompts))  # none of these explode
            buffer.add_prompts(more)
            prompts += more
        time.sleep(0.05)
    groups = _groups_of(buffer, prompts, timeout_s=90)
    mixed = 0
    for group in groups:
        for i, _, _, versions in _samples(group):
            assert np.all(np.diff(versions) >= 0) and versions.min() == group.versions[i]
            mixed += len(np.unique(versions)) > 1
        _check_logprobs(reference, group)
        exploded = group.prompt_id in (200, 205, 210)
        assert (group.rewards == -1.0).all() == exploded
        assert all(r.startswith("env_error: reward: RuntimeError") for r in group.finish_reasons) == exploded
    assert mixed > 0, "no sample was running when v2 arrived"
    assert max(g.versions.max() for g in groups) == 2


def _phase_d_buffer_restart_loses_no_group(rig):
    buffer = rig["buffer"]
    prompts = arithmetic_items(4, first_id=300)
    leases_before = len(buffer.leases)
    buffer.add_prompts(prompts)
    _wait(lambda: len(buffer.leases) > leases_before, 30, "a lease of the new prompts")
    noticed = rig["process"].output().count(DOWN)
    buffer.stop()
    # the buffer stays away until the generator has noticed (a request timed out): it must keep its groups and reconnect
    _wait(lambda: rig["process"].output().count(DOWN) > noticed, 60, "the generator to notice the buffer is away")
    buffer.start()
    groups = _groups_of(buffer, prompts, timeout_s=60)
    assert len(groups) == 4
    assert rig["process"].poll() is None


def _descendants(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _phase_e_sigterm_returns_unfinished_leases_and_exits_zero(rig):
    buffer, process = rig["buffer"], rig["process"]
    prompts = arithmetic_items(8, first_id=400)
    leases_before = len(buffer.leases)
    buffer.add_prompts(prompts)
    _wait(lambda: len(buffer.leases) > leases_before, 30, "a lease of the new prompts")
    children = _descendants(process.pid)
    assert children, "vLLM runs its engine in child processes"
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    leased = {(lease, p.prompt_id) for lease, items in buffer.leases.items() for p in items if p.prompt_id >= 400}
    returned = {(r.lease_id, prompt_id) for r in buffer.returns for prompt_id in r.prompt_ids}
    delivered = {g.group_id for g in buffer.groups.values() if g.prompt_id >= 400}
    assert leased == returned | delivered and not returned & delivered
    _wait(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 10, "vLLM's processes to exit")

    records = read_metrics(rig["run_dir"] / "generator-0.jsonl")
    assert records[-1]["actor/reward_errors"] == 3 * GROUP_SIZE  # prompts 200, 205, 210
    assert records[-1]["actor/policy_version"] == 2
