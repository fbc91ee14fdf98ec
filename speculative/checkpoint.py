"""The drafter checkpoint format: Hugging Face style directories that say what they were trained for.

Each kind writes and reads its own directory layout (its `DrafterKind.save` / `load`, kinds.py);
this module holds what they share: the record, the target check, atomic writes and the one-file
weights layout. The layouts of draftsmith's own kinds:

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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.speculative import formats, kinds
from draftsmith.speculative.errors import DraftsmithError, ModelLoadError, first_line
from draftsmith.speculative.fileio import atomic_directory
from draftsmith.speculative.loading import LoadedModel, tokenizer_hash
from draftsmith.speculative.proposers import Proposer

FORMAT_VERSION = 1
RECORD_KEY = "draftsmith"


class TargetMismatchError(DraftsmithError):
    """A drafter trained for another target."""


@dataclass
class DrafterInfo:
    kind: str  # a kind with checkpoints in the registry (kinds.py): "draft-lm", "medusa", "eagle", ...
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
        known = kinds.names(has_checkpoint=True)
        if info.kind not in known:
            raise ModelLoadError(f"{path} holds an unknown drafter kind '{info.kind}' (known: {', '.join(known)})")
        if info.format_version > FORMAT_VERSION:
            raise ModelLoadError(f"{path} was written by a newer draftsmith (format {info.format_version})")
        return info


# --- writing ------------------------------------------------------------------------------------


def save_drafter(out_dir: Path, drafter, tokenizer, info: DrafterInfo) -> Path:
    """Write `drafter` as a checkpoint of its kind (`info.kind`) into a new directory `out_dir`."""
    return kinds.get(info.kind).save(drafter, Path(out_dir), tokenizer, info)


def save_module(out_dir: Path, module, weights: str, spec: dict, tokenizer, info: DrafterInfo,
                overwrite: bool = False) -> Path:
    """A drafter whose weights are one safetensors file beside a config.json of its record and spec."""
    def write(scratch: Path) -> None:
        state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(scratch / weights))
        record = {RECORD_KEY: asdict(info), **spec}
        (scratch / "config.json").write_text(json.dumps(record, indent=2) + "\n")
        tokenizer.save_pretrained(scratch)

    return atomic_write(Path(out_dir), write, overwrite)


def atomic_write(out_dir: Path, write, overwrite: bool = False) -> Path:
    """Call `write(scratch)` on a new directory beside `out_dir`, then rename it into place."""
    with atomic_directory(Path(out_dir), overwrite=overwrite) as scratch:
        write(scratch)
    return Path(out_dir)


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


def load_drafter_dir(path: str | Path, target: LoadedModel, *, allow_target_mismatch: bool = False,
                     device=None, dtype=None) -> tuple[Proposer, DrafterInfo | None]:
    """A proposer from a drafter directory: a draftsmith checkpoint of any kind (checked against the
    target), an EAGLE-3 drafter in the speculators or SGLang layout (formats.py), or a plain Hugging
    Face causal LM with the target's tokenizer (no record, so no target check: a draft LM)."""
    path = Path(path)
    if formats.recognise(path) is not None:  # an EAGLE-3 drafter trained elsewhere (no record to check)
        return kinds.get("eagle3").proposer(formats.load(path, target, device=device, dtype=dtype)), None
    info = read_drafter_info(path)
    if info is not None:
        check_target(info, target, path, allow_mismatch=allow_target_mismatch)
    kind = kinds.get(info.kind if info is not None else "draft-lm")
    drafter = kind.load(path, target, device=device, dtype=dtype)
    return kind.proposer(drafter), info


def read_spec(path: Path, key: str) -> dict:
    """The kind's own section of a checkpoint's config.json (`{"medusa": {...}}`), or ModelLoadError."""
    record = json.loads((Path(path) / "config.json").read_text())
    if not isinstance(record.get(key), dict):
        raise ModelLoadError(f"corrupt {key} config in {path}/config.json: no '{key}' section")
    return record[key]


def load_weights(module, weights: Path, kind: str) -> None:
    """All of `module`'s weights from one safetensors file, or a one-line ModelLoadError."""
    try:
        module.load_state_dict(load_file(str(weights)), strict=True)
    except (OSError, SafetensorError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {kind} weights from {weights.parent}: {first_line(exc)}") from None
