"""EAGLE-3 drafters in the layouts serving engines read: export to them, import from them.

    speculators   what `vllm serve` loads (the speculators library's eagle3 format): config.json with
                  `speculators_model_type: eagle3`, `speculators_config` (algorithm, greedy proposal,
                  verifier), `transformer_layer_config` (the draft layers' config), `draft_vocab_size`,
                  `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`;
                  model.safetensors with fc, layers.N.*, norm, lm_head [Vd, H], d2t [Vd], t2d [V].
    sglang        what SGLang's LlamaForCausalLMEagle3 (and SpecForge, the EAGLE-3 repository) loads:
                  a Llama config with `architectures: [LlamaForCausalLMEagle3]`, one layer,
                  `draft_vocab_size`, `eagle_config` {eagle_aux_hidden_state_layer_ids,
                  use_aux_hidden_state}; model.safetensors with the layer under `midlayer.`.

The two engines number the captured layers differently. vLLM's id i (and draftsmith's `target_layers`)
is the state entering layer i, transformers' `hidden_states[i]`; SGLang's id j captures the output of
layer j, the state entering layer j + 1. An export writes each engine's own numbers, an import reads
them back. Neither format stores the token embeddings (the target's).

An import (`load`, which `--drafter DIR` reaches through checkpoint.load_drafter_dir) checks the
config against the tensors and against the target: widths, vocabulary, layer ids, draft vocabulary.
A directory trained elsewhere carries no draftsmith record, so no target hash can be checked.
Tie-breaks aside, d2t in any order is the same drafter: its ids are sorted on import, the lm_head rows
with them.

What a format cannot hold is refused before anything is written: another kind than eagle3,
`norm_before_residual` or more than one layer or the embeddings' state (layer 0) in SGLang's, an
architecture the engine has no EAGLE-3 layer for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from draftsmith.speculative.errors import InvalidInputError, ModelLoadError, first_line
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

SPECULATORS, SGLANG = "speculators", "sglang"
FORMATS = (SPECULATORS, SGLANG)
SPECULATORS_VERSION = "0.9.0"
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
SGLANG_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
WEIGHTS = "model.safetensors"
# The layer families each engine has an EAGLE-3 first layer for (speculators' model_definitions,
# SGLang's llama_eagle3.py).
ENGINE_MODEL_TYPES = {SPECULATORS: ("llama", "qwen3"), SGLANG: ("llama",)}
# The hub id a checkpoint's target goes by when draftsmith knew it under its own name.
KNOWN_VERIFIERS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# Generic PretrainedConfig fields that say nothing about the draft layer.
NOISE_KEYS = ("id2label", "label2id", "output_hidden_states", "output_attentions", "return_dict",
              "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "dtype", "torch_dtype")
# Optional parts of foreign formats draftsmith's drafter has no place for.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "use_aux_norm")


# --- export ---------------------------------------------------------------------------------------


def export(drafter_dir: str | Path, fmt: str, out: str | Path, *, verifier: str | None = None) -> Path:
    """Write the draftsmith eagle3 checkpoint `drafter_dir` into a new directory `out` in format `fmt`.
    `verifier`: the target's hub id or path recorded for the engine (default: the checkpoint's target)."""
    from draftsmith.speculative.checkpoint import (
        atomic_write,
        read_drafter_info,
        read_spec,
    )
    from draftsmith.speculative.eagle3 import SPEC_KEY
    from draftsmith.speculative.eagle3 import WEIGHTS as OWN_WEIGHTS

    if fmt not in FORMATS:
        raise InvalidInputError(f"unknown export format '{fmt}' (known: {', '.join(FORMATS)})")
    drafter_dir = Path(drafter_dir)
    info = read_drafter_info(drafter_dir) if drafter_dir.is_dir() else None
    if info is None:
        raise InvalidInputError(f"{drafter_dir} is not a draftsmith drafter directory")
    if info.kind != SPEC_KEY:
        raise InvalidInputError(f"{drafter_dir} holds a {info.kind} drafter; the {fmt} format holds EAGLE-3 "
                                "drafters only (kind eagle3)")
    spec = read_spec(drafter_dir, SPEC_KEY)
    try:
        tensors = load_file(str(drafter_dir / OWN_WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"cannot read {drafter_dir / OWN_WEIGHTS}: {first_line(exc)}") from None
    verifier = verifier or KNOWN_VERIFIERS.get(info.target_name, info.target_name)
    steps = int((info.recipe.get("loss") or {}).get("draft_steps") or 3)
    layout = speculators_layout if fmt == SPECULATORS else sglang_layout
    config, tensors = layout(spec, tensors, verifier, steps)

    def write(scratch: Path) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(scratch / WEIGHTS), metadata={"format": "pt"})
        (scratch / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return atomic_write(Path(out), write)


def _layer_config(spec: dict, fmt: str) -> dict:
    layer = dict(spec["layer_config"])
    model_type = layer.get("model_type")
    if model_type not in ENGINE_MODEL_TYPES[fmt]:
        raise InvalidInputError(f"the {fmt} format has no EAGLE-3 layer for {model_type} targets "
                                f"(it has: {', '.join(ENGINE_MODEL_TYPES[fmt])})")
    for key in ("architectures", "_name_or_path", "draftsmith", "quantization_config", *NOISE_KEYS):
        layer.pop(key, None)
    layer["num_hidden_layers"] = int(spec["num_layers"])
    layer["vocab_size"] = int(spec["vocab_size"])
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # for readers of the older top-level key
        layer.setdefault("rope_theta", rope["rope_theta"])
    return layer


def speculators_layout(spec: dict, tensors: dict, verifier: str, steps: int) -> tuple[dict, dict]:
    hidden = int(spec["hidden_size"])
    config = {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(spec.get("target_architectures") or [])},
        },
        "transformer_layer_config": _layer_config(spec, SPECULATORS),
        "draft_vocab_size": int(spec["draft_vocab_size"]),
        "norm_before_residual": bool(spec["norm_before_residual"]),
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in spec["target_layers"]],
        "torch_dtype": str(tensors["fc.weight"].dtype).removeprefix("torch."),
    }
    return config, _without_identity_maps(tensors, spec)


def sglang_layout(spec: dict, tensors: dict, verifier: str, steps: int) -> tuple[dict, dict]:
    if int(spec["num_layers"]) != 1:
        raise InvalidInputError(f"the sglang format holds one draft layer; this drafter has {spec['num_layers']}")
    if spec["norm_before_residual"]:
        raise InvalidInputError("SGLang's EAGLE-3 layer has no norm_before_residual: true")
    layers = [int(i) for i in spec["target_layers"]]
    if layers[0] < 1:
        raise InvalidInputError("the sglang format cannot name the embeddings' state (target layer 0) as an input")
    config = _layer_config(spec, SGLANG)
    config.update({
        "architectures": list(SGLANG_ARCHITECTURES),
        "draft_vocab_size": int(spec["draft_vocab_size"]),
        "tie_word_embeddings": False,
        "target_hidden_size": int(spec["hidden_size"]),
        # SGLang captures the output of layer j: the state entering layer j + 1.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True},
        "torch_dtype": str(tensors["fc.weight"].dtype).removeprefix("torch."),
    })
    renamed = {("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k: v
               for k, v in _without_identity_maps(tensors, spec).items()}
    return config, renamed


def _without_identity_maps(tensors: dict, spec: dict) -> dict:
    """A drafter over the whole vocabulary carries no d2t/t2d (as speculators and SGLang write it)."""
    if int(spec["draft_vocab_size"]) != int(spec["vocab_size"]):
        return dict(tensors)
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}


# --- import ---------------------------------------------------------------------------------------


def recognise(path: str | Path) -> str | None:
    """The foreign format of a drafter directory (SPECULATORS, SGLANG), or None for anything else."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        record = json.loads(config.read_text())
    except (OSError, ValueError):
        return None  # the caller's own reading reports a corrupt config
    if not isinstance(record, dict) or "draftsmith" in record:
        return None
    if "speculators_model_type" in record:
        return SPECULATORS
    if set(record.get("architectures") or ()) & set(SGLANG_ARCHITECTURES):
        return SGLANG
    return None


def load(path: str | Path, target, *, device=None, dtype=None):
    """The `Eagle3Drafter` of a speculators or SGLang-layout directory, checked against its tensors
    and the target (one-line ModelLoadError otherwise)."""
    from draftsmith.speculative.eagle3 import (
        Eagle3Drafter,
        default_target_layers,
        placed,
    )

    path = Path(path)
    fmt = recognise(path)
    if fmt is None:
        raise ModelLoadError(f"{path} is neither a speculators nor an SGLang EAGLE-3 drafter directory")
    config = json.loads((path / "config.json").read_text())
    try:
        layer, layers, vocab_size, residual = (
            _read_speculators(config) if fmt == SPECULATORS else _read_sglang(config))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"corrupt {fmt} config in {path}/config.json: {first_line(exc)}") from None
    _check_fits_target(layer, path, fmt, target)
    target_config = target.model.config
    if layers is None:
        try:
            layers = default_target_layers(target_config.num_hidden_layers)
        except InvalidInputError as exc:
            raise ModelLoadError(f"{path} names no target layers and {exc}") from None
    tensors = _read_tensors(path, fmt)
    if fmt == SGLANG:
        tensors = _from_sglang_names(tensors, layer.num_hidden_layers)
    tensors = _sorted_vocab(_with_vocab_maps(tensors, vocab_size, target_config.vocab_size, path))
    try:
        drafter = Eagle3Drafter(target_config, layers, layer.num_hidden_layers, vocab_size, residual,
                                layer_config=layer)
    except InvalidInputError as exc:
        raise ModelLoadError(f"{fmt} drafter in {path} does not fit {target.name}: {exc}") from None
    try:
        missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # shapes that are not the config's
        raise ModelLoadError(f"the config and tensors of {path} disagree: {first_line(exc)}") from None
    if missing or unexpected:
        what = f"no tensor {missing[0]}" if missing else f"an unexpected tensor {unexpected[0]}"
        raise ModelLoadError(f"the config and tensors of {path} disagree: {what}")
    return placed(drafter.attach_target(target.model), target, device, dtype).eval()


def _read_speculators(config: dict):
    if config["speculators_model_type"] != "eagle3":
        raise ValueError(f"a speculators {config['speculators_model_type']} drafter, not eagle3")
    _refuse_flags(config)
    layer_dict = dict(config["transformer_layer_config"])
    layer = AutoConfig.for_model(layer_dict.pop("model_type", "llama"), **layer_dict)
    target_hidden = config.get("target_hidden_size") or layer.hidden_size
    if int(target_hidden) != layer.hidden_size:
        raise ValueError(f"target_hidden_size {target_hidden} differs from the draft width {layer.hidden_size}")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return layer, ids, int(config["draft_vocab_size"]), bool(config.get("norm_before_residual", False))


def _read_sglang(config: dict):
    _refuse_flags(config, config.get("eagle_config") or {})
    if config.get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings: true (an EAGLE-3 drafter has its own lm_head)")
    layer_dict = {k: v for k, v in config.items() if k not in ("architectures", "eagle_config", "draft_vocab_size")}
    layer = AutoConfig.for_model(layer_dict.pop("model_type", "llama"), **layer_dict)
    target_hidden = config.get("target_hidden_size") or layer.hidden_size
    if int(target_hidden) != layer.hidden_size:
        raise ValueError(f"target_hidden_size {target_hidden} differs from the draft width {layer.hidden_size}")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vocab_size = config.get("draft_vocab_size") or layer.vocab_size
    return layer, None if ids is None else [int(i) + 1 for i in ids], int(vocab_size), False


def _refuse_flags(*sections: dict) -> None:
    for section in sections:
        for flag in UNSUPPORTED_FLAGS:
            if section.get(flag):
                raise ValueError(f"{flag}: true is not supported by draftsmith's EAGLE-3 drafter")


def _check_fits_target(layer, path: Path, fmt: str, target) -> None:
    config = target.model.config
    if layer.hidden_size != config.hidden_size:
        raise ModelLoadError(f"{fmt} drafter in {path} reads {layer.hidden_size}-wide states; the target "
                             f"{target.name} is {config.hidden_size} wide")
    if layer.vocab_size != config.vocab_size:
        raise ModelLoadError(f"{fmt} drafter in {path} is over {layer.vocab_size} tokens; the target {target.name} "
                             f"has {config.vocab_size}")


def _read_tensors(path: Path, fmt: str) -> dict:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {fmt} drafter {path}")
    tensors = {}
    try:
        for file in files:
            tensors.update(load_file(str(file)))
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"cannot load {fmt} weights from {path}: {first_line(exc)}") from None
    # The embeddings (some trainers save them) are the target's here; the verifier's copies are not ours.
    return {k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "verifier_"))}


def _from_sglang_names(tensors: dict, num_layers: int) -> dict:
    """SGLang's names -> the speculators names: `midlayer.` is layer 0; a later layer's pre-attention
    norm is its `hidden_norm` (SGLang) or `input_layernorm` (speculators, transformers)."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "layers" and parts[1] != "0" and parts[2] == "hidden_norm":
            name = ".".join(["layers", parts[1], "input_layernorm", *parts[3:]])
        elif len(parts) > 3 and parts[0] == "layers" and parts[1] != "0" and parts[2] == "input_layernorm":
            continue  # SGLang's later layers carry an unused input_layernorm
        out[name] = tensor
    return out


def _with_vocab_maps(tensors: dict, draft_vocab: int, vocab: int, path: Path) -> dict:
    """d2t and t2d, checked against each other and the lm_head; identity maps for a full vocabulary."""
    head = tensors.get("lm_head.weight")
    if head is None or head.shape[0] != draft_vocab:
        rows = None if head is None else head.shape[0]
        raise ModelLoadError(f"the config and tensors of {path} disagree: draft_vocab_size {draft_vocab}, "
                             f"lm_head rows {rows}")
    if "d2t" not in tensors and draft_vocab == vocab:
        tensors["d2t"] = torch.zeros(vocab, dtype=torch.int64)
        tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    if "d2t" not in tensors or "t2d" not in tensors:
        raise ModelLoadError(f"{path} drafts among {draft_vocab} of {vocab} tokens but has no d2t/t2d maps")
    d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    ids = d2t + torch.arange(len(d2t))
    if len(d2t) != draft_vocab or len(t2d) != vocab or bool((ids < 0).any() or (ids >= vocab).any()):
        raise ModelLoadError(f"the config and tensors of {path} disagree: d2t {tuple(d2t.shape)}, t2d "
                             f"{tuple(t2d.shape)} for {draft_vocab} of {vocab} tokens")
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[ids] = True
    if len(ids.unique()) != len(ids) or not torch.equal(inside, t2d):
        raise ModelLoadError(f"the config and tensors of {path} disagree: t2d is not the set d2t maps to")
    return {**tensors, "d2t": d2t, "t2d": t2d}


def _sorted_vocab(tensors: dict) -> dict:
    """The draft vocabulary in increasing target-id order (draftsmith's), lm_head rows with it."""
    ids = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
    order = torch.argsort(ids)
    if bool((order == torch.arange(len(order))).all()):
        return tensors
    return {**tensors, "d2t": ids[order] - torch.arange(len(order)), "lm_head.weight": tensors["lm_head.weight"][order]}
