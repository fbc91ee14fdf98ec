"""The drafter checkpoint format: Hugging Face style directories that say what they were trained for.

    draft LM   a normal `save_pretrained` directory (config.json, model.safetensors, tokenizer files);
               config.json carries an extra "draftsmith" record, so the directory also loads with
               `AutoModelForCausalLM` and works as `assistant_model` in Hugging Face `generate`.
    medusa     config.json {"draftsmith": record, "medusa": head config}, heads.safetensors (the heads
               only; a shared lm_head is the target's and is not stored), tokenizer files.
    eagle      config.json {"draftsmith": record, "eagle": {num_layers, hidden_size, vocab_size,
               draft_vocab_size}}, eagle.safetensors (projection, decoder layers, final norm, the draft
               vocabulary's token ids if any; the embeddings and lm_head are the target's), tokenizer
               files. The layers take the target's architecture.

The "draftsmith" record (`DrafterInfo`): format version, drafter kind, the target's name and weight
identity hash, the tokenizer hash, the recipe, a training summary, and for a re-tuned drafter its
lineage. `load_drafter` refuses a drafter whose target hash is not the target's (a drafter trained for
another target) unless told to allow it, and always refuses a different tokenizer.

Checkpoints are written to a temporary directory beside the destination and renamed into place, so a
crash never leaves a half-written drafter, and an existing non-empty directory is never overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.speculative.errors import DraftsmithError, InvalidInputError, ModelLoadError
from draftsmith.speculative.loading import LoadedModel, check_same_tokenizer, load_model, tokenizer_hash
from draftsmith.speculative.eagle import EagleDrafter, EagleProposer
from draftsmith.speculative.medusa import MedusaHeads, MedusaProposer
from draftsmith.speculative.proposers import DraftModelProposer, Proposer

FORMAT_VERSION = 1
RECORD_KEY = "draftsmith"
MEDUSA_WEIGHTS = "heads.safetensors"
EAGLE_WEIGHTS = "eagle.safetensors"
KINDS = ("draft-lm", "medusa", "eagle")


class TargetMismatchError(DraftsmithError):
    """A drafter trained for another target."""


@dataclass
class DrafterInfo:
    kind: str  # "draft-lm" | "medusa" | "eagle"
    target_name: str
    target_hash: str
    tokenizer_hash: str
    recipe: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    lineage: dict | None = None
    format_version: int = FORMAT_VERSION
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @classmethod
    def for_target(cls, kind: str, target: LoadedModel, **extra) -> "DrafterInfo":
        return cls(kind=kind, target_name=target.name, target_hash=target.weight_hash(),
                   tokenizer_hash=tokenizer_hash(target.tokenizer), **extra)

    @classmethod
    def from_dict(cls, record: dict, path) -> "DrafterInfo":
        try:
            info = cls(**record)
        except TypeError as exc:
            raise ModelLoadError(f"corrupt drafter record in {path}/config.json: {exc}") from None
        if info.kind not in KINDS:
            raise ModelLoadError(f"{path} holds an unknown drafter kind '{info.kind}' (known: {', '.join(KINDS)})")
        if info.format_version > FORMAT_VERSION:
            raise ModelLoadError(f"{path} was written by a newer draftsmith (format {info.format_version})")
        return info


# --- writing ------------------------------------------------------------------------------------


def save_draft_lm(out_dir: Path, model, tokenizer, info: DrafterInfo, *, overwrite: bool = False) -> Path:
    def write(scratch: Path) -> None:
        setattr(model.config, RECORD_KEY, asdict(info))
        try:
            model.save_pretrained(scratch)
        finally:
            delattr(model.config, RECORD_KEY)
        tokenizer.save_pretrained(scratch)

    return _atomic_write(Path(out_dir), write, overwrite)


def save_medusa(out_dir: Path, heads: MedusaHeads, tokenizer, info: DrafterInfo, *, overwrite: bool = False) -> Path:
    return _save_module(out_dir, heads, MEDUSA_WEIGHTS, {"medusa": heads.config()}, tokenizer, info, overwrite)


def save_eagle(out_dir: Path, drafter: EagleDrafter, tokenizer, info: DrafterInfo, *, overwrite: bool = False) -> Path:
    return _save_module(out_dir, drafter, EAGLE_WEIGHTS, {"eagle": drafter.spec()}, tokenizer, info, overwrite)


def _save_module(out_dir: Path, module, weights: str, spec: dict, tokenizer, info: DrafterInfo, overwrite: bool) -> Path:
    """A drafter whose weights are one safetensors file beside a config.json of its record and spec."""
    def write(scratch: Path) -> None:
        state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(scratch / weights))
        record = {RECORD_KEY: asdict(info), **spec}
        (scratch / "config.json").write_text(json.dumps(record, indent=2) + "\n")
        tokenizer.save_pretrained(scratch)

    return _atomic_write(Path(out_dir), write, overwrite)


def _atomic_write(out_dir: Path, write, overwrite: bool) -> Path:
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidInputError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise InvalidInputError(f"{out_dir} already holds files; choose another output directory")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    except OSError as exc:
        raise InvalidInputError(f"cannot write to {out_dir.parent}: {exc.strerror or exc}") from None
    try:
        write(scratch)
        if out_dir.is_dir():  # empty, or overwrite asked for: move the old one aside, then drop it
            old = out_dir.with_name(f".{out_dir.name}-old-{os.getpid()}")
            os.rename(out_dir, old)
            os.rename(scratch, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(scratch, out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


# --- reading ------------------------------------------------------------------------------------


def read_drafter_info(path: str | Path) -> DrafterInfo | None:
    """The drafter record of a directory, or None for a plain model directory (no record)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        record = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"corrupt {config}: {exc}") from None
    if not isinstance(record, dict) or RECORD_KEY not in record:
        return None
    return DrafterInfo.from_dict(record[RECORD_KEY], path)


def check_target(info: DrafterInfo, target: LoadedModel, path, *, allow_mismatch: bool = False) -> None:
    if info.tokenizer_hash != tokenizer_hash(target.tokenizer):
        raise TargetMismatchError(f"drafter {path} was trained with another tokenizer than {target.name}'s")
    if info.target_hash != target.weight_hash() and not allow_mismatch:
        raise TargetMismatchError(
            f"drafter {path} was trained for target '{info.target_name}' (weights {info.target_hash[:12]}), "
            f"not for '{target.name}' (weights {target.weight_hash()[:12]}); re-tune it with `draftsmith retune` "
            "or pass --allow-target-mismatch to use it anyway"
        )


def load_drafter(path: str | Path, target: LoadedModel, *, allow_target_mismatch: bool = False,
                 device=None, dtype=None) -> tuple[Proposer, DrafterInfo | None]:
    """A proposer from a drafter directory: a draftsmith checkpoint (checked against the target) or a
    plain Hugging Face causal LM with the target's tokenizer (no record, so no target check)."""
    path = Path(path)
    device = device or target.model.device
    dtype = dtype or target.model.dtype
    info = read_drafter_info(path)
    if info is not None:
        check_target(info, target, path, allow_mismatch=allow_target_mismatch)
    if info is not None and info.kind == "medusa":
        return MedusaProposer(load_medusa_heads(path, target, device=device, dtype=dtype)), info
    if info is not None and info.kind == "eagle":
        return EagleProposer(load_eagle(path, target, device=device, dtype=dtype)), info
    drafter = load_model(str(path), device=device, dtype=dtype)
    check_same_tokenizer(target.tokenizer, drafter.tokenizer, target.name, str(path))
    return DraftModelProposer(drafter.model), info


def load_medusa_heads(path: Path, target: LoadedModel, *, device=None, dtype=None) -> MedusaHeads:
    record = json.loads((path / "config.json").read_text())
    try:
        heads = MedusaHeads(**record["medusa"])
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"corrupt medusa config in {path}/config.json: {exc}") from None
    lm_head = target.model.get_output_embeddings()
    if (heads.hidden_size, heads.vocab_size) != (lm_head.weight.shape[1], lm_head.weight.shape[0]):
        raise ModelLoadError(f"medusa heads in {path} are {heads.hidden_size}x{heads.vocab_size}, the target is "
                             f"{lm_head.weight.shape[1]}x{lm_head.weight.shape[0]}")
    _load_weights(heads, Path(path) / MEDUSA_WEIGHTS, "medusa")
    heads.attach_lm_head(lm_head)
    return heads.to(device=device or lm_head.weight.device, dtype=dtype or lm_head.weight.dtype).eval()


def load_eagle(path: Path, target: LoadedModel, *, device=None, dtype=None) -> EagleDrafter:
    record = json.loads((Path(path) / "config.json").read_text())
    try:
        spec = record["eagle"]
        num_layers = int(spec["num_layers"])
        sizes = (int(spec["hidden_size"]), int(spec["vocab_size"]))
        draft_vocab_size = int(spec["draft_vocab_size"]) if spec.get("draft_vocab_size") else None
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"corrupt eagle config in {path}/config.json: {exc!r}") from None
    lm_head = target.model.get_output_embeddings()
    if sizes != (lm_head.weight.shape[1], lm_head.weight.shape[0]):
        raise ModelLoadError(f"eagle drafter in {path} is {sizes[0]}x{sizes[1]}, the target is "
                             f"{lm_head.weight.shape[1]}x{lm_head.weight.shape[0]}")
    drafter = EagleDrafter(target.model.config, num_layers, draft_vocab_size)
    _load_weights(drafter, Path(path) / EAGLE_WEIGHTS, "eagle")
    drafter.attach_target(target.model)
    return drafter.to(device=device or lm_head.weight.device, dtype=dtype or lm_head.weight.dtype).eval()


def _load_weights(module, weights: Path, kind: str) -> None:
    """All of `module`'s weights from one safetensors file, or a one-line ModelLoadError."""
    try:
        module.load_state_dict(load_file(str(weights)), strict=True)
    except (OSError, SafetensorError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {kind} weights from {weights.parent}: {str(exc).splitlines()[0]}") from None
