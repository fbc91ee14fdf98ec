"""Typed training recipes: YAML files validated into pydantic models.

A recipe is a YAML mapping with the sections below. Unknown keys and wrong types are errors that name
the key; `key=value` overrides from the command line use dotted paths (`train.steps=50`,
`loss.kind=fkl`) and YAML syntax for values (`data.prompts=[a.jsonl,b.jsonl]`).

Relative paths in a recipe are relative to the working directory; `builtin:NAME` names a prompt set
that ships with draftsmith (data/prompts/, see its README.md), `hf:NAME[:CONFIG][@SPLIT]` a dataset
loaded by `datasets.load_dataset`, and a recipe name without a path (`tiny-medusa`) names a recipe
that ships in `recipes/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from draftsmith.speculative import kinds
from draftsmith.speculative.errors import InvalidInputError, first_line

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DrafterConfig(Section):
    kind: str = "draft-lm"
    """A trainable kind of the registry (speculative/kinds.py). draft-lm: a small causal LM with the
    target's tokenizer; medusa: heads on the target's hidden state; eagle: decoder layers reading the
    target's hidden states and the tokens after them (EAGLE-1); eagle3: EAGLE-3, reading three target layers'
    states and drafting from its own outputs (speculative/eagle3.py)."""
    init_from: str | None = None
    """Warm start: a draft-LM (any causal LM directory or hub id with the target's tokenizer) or a
    draftsmith Medusa or EAGLE directory to start from, instead of building a fresh drafter from the target."""
    num_layers: int = Field(2, ge=1)
    """draft-lm: decoder layers (the target's first layers are copied when the width matches);
    eagle, eagle3: decoder layers after the feature/token projection (1 in EAGLE and EAGLE-3)."""
    hidden_size: int | None = Field(None, ge=8)
    """draft-lm: a narrower width than the target's (random init then); None keeps the target's."""
    init_from_target: bool = True
    """draft-lm: copy embeddings, final norm, lm_head and the first layers from the target."""
    freeze_embeddings: bool = True
    """draft-lm: keep the input embeddings and lm_head frozen."""
    num_heads: int = Field(4, ge=1)
    """medusa: number of heads K (head k predicts the token k+1 positions after the next one)."""
    head_layers: int = Field(1, ge=1)
    """medusa: residual SiLU blocks per head."""
    own_lm_head: bool = False
    """medusa: give each head a trainable copy of the lm_head instead of sharing the frozen one."""
    draft_vocab: int | None = Field(None, ge=1)
    """eagle, eagle3: draft only among this many tokens, the most frequent in the training answers (a draft step
    then multiplies only their rows of the lm_head); None drafts from the whole vocabulary."""
    target_layers: list[int] | None = None
    """eagle3: the target states the drafter reads, as indices into transformers' `hidden_states`
    (the states entering those layers), strictly increasing; None = EAGLE-3's [2, L//2, L-3]."""
    norm_before_residual: bool = False
    """eagle3: the first layer's residual stream starts from hidden_norm(h) instead of h."""

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        trainable = kinds.names(trainable=True)
        if kind not in trainable:
            raise ValueError(f"unknown drafter kind '{kind}' (trainable kinds: {', '.join(trainable)})")
        return kind


class DataColumns(Section):
    """Which column holds what, for data whose column names do not say (None: inferred; see
    draftsmith.data.prompts). At most one of prompt, conversation and turns."""

    prompt: str | None = None
    """A single user message (inferred from prompt, instruction, question, text, input)."""
    conversation: str | None = None
    """A list of {role, content} or ShareGPT {from, value} messages (inferred from messages, conversations)."""
    turns: str | None = None
    """A list of user turns, MT-Bench style (inferred from turns)."""
    category: str | None = None
    """A grouping for per-category figures (inferred from category, cluster, motivation_app)."""
    reference: str | None = None
    """A reference answer (inferred from reference, answer, output, canonical_solution)."""
    id: str | None = None
    """A stable record id (inferred from id, question_id, uid, task_id; else the record's index)."""

    @model_validator(mode="after")
    def _one_text_column(self) -> "DataColumns":
        given = [name for name in ("prompt", "conversation", "turns") if getattr(self, name)]
        if len(given) > 1:
            raise ValueError(f"name one of data.columns.prompt, .conversation and .turns, not {' and '.join(given)}")
        return self


class PromptSource(Section):
    """A data.prompts entry written as a mapping, for settings of its own; a plain string entry (and
    any setting left out here) takes the data section's."""

    source: str
    """A file, builtin:NAME, hf:NAME[:CONFIG][@SPLIT] or self:N, as a plain entry."""
    regenerate: bool | None = None
    """true: the target answers the prompts itself; false: train on the source's own conversations as
    they are (rendered with the target's chat template, loss on the assistant turns only; teacher
    signals, when offline, from one teacher-forced target pass); None: data.regenerate."""
    columns: DataColumns | None = None
    """This source's columns; None: data.columns."""
    limit: int | None = Field(None, ge=1)
    """Records taken from this source; None: data.limit."""


class DataConfig(Section):
    prompts: list[str | PromptSource] = Field(default_factory=lambda: ["builtin:quickstart"])
    """Prompt / conversation sources: files (jsonl, json, parquet, csv, saved dataset dirs), builtin:NAME
    (a set that ships with draftsmith), hf:NAME[:CONFIG][@SPLIT] (datasets.load_dataset: a hub id or a
    local dataset repository), or self:N (N prompts the target writes itself, Magpie-style; see
    draftsmith.data.self_prompts); or a mapping {source: ..., regenerate, columns, limit} for settings
    of its own (see PromptSource)."""
    prompt_column: str | None = None
    """Column holding the prompt, when it is not inferred (prompt, instruction, question, turns, messages...);
    the same as data.columns.prompt."""
    columns: DataColumns = Field(default_factory=DataColumns)
    """Which columns hold the prompt or conversation, category, reference and id, where inference cannot tell."""
    limit: int | None = Field(None, ge=1)
    """Use at most this many records per source (the first ones, or a random sample with data.shuffle)."""
    shuffle: bool = False
    """Shuffle each source (with data.seed) before data.limit takes its records; a streamed source
    shuffles its shard order and a buffer of data.stream_buffer records."""
    seed: int | None = None
    """Seed of the shuffles: each source's (data.shuffle) and the combined records', whose first
    data.heldout are held out; None = train.seed. The same seed gives the same records and held-out split."""
    streaming: bool = False
    """Read hf: sources as streams: only the records used are fetched (data.limit of them), written in
    resumable shards under data.cache_dir and read back memory-mapped; for sets too large to download whole."""
    stream_buffer: int = Field(10_000, ge=1)
    """Records in the shuffle buffer of a streamed source (with data.shuffle)."""
    heldout: int = Field(16, ge=1)
    """Records held out (never trained on) for the periodic acceptance-length evaluation."""
    regenerate: bool = True
    """Replace the answers with the target's own (self-distillation); False trains on the data's assistant turns."""
    max_new_tokens: int = Field(128, ge=1)
    """Length of regenerated answers."""
    temperature: float = Field(0.0, ge=0.0)
    """Regeneration temperature (0 = greedy)."""
    extra_samples: int = Field(0, ge=0)
    """More answers per training prompt, sampled at `sample_temperature` (each pass its own seed), beside
    the main one: more and more varied target text from the same prompts. Needs `regenerate`."""
    sample_temperature: float = Field(0.7, gt=0.0)
    """Temperature of the extra sampled answers."""
    regen_batch_size: int = Field(8, ge=1)
    """Prompts per regeneration batch."""
    regen_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """The dtype the target writes `self:N` prompts and answers in. bfloat16 about doubles the throughput
    of a CPU with bf16 arithmetic (AVX512-BF16, AMX) at regeneration's batch sizes, and of a GPU, but is
    slower than float32 where the CPU emulates it; `auto` takes bfloat16 where the target's device does
    bf16 arithmetic, else float32. bf16 answers are the bf16 target's, cached apart from float32 ones
    (float32 answers already cached for the same prompts are taken). The teacher signals and the
    evaluation keep the target as loaded."""
    max_length: int = Field(512, ge=8)
    """Training sequences are truncated to this many tokens."""
    cache_dir: str | None = None
    """Where regenerated data and teacher caches go; default <output_dir>/data. Reused across runs."""


class TeacherConfig(Section):
    mode: Literal["online", "offline"] = "online"
    """online: the target runs inside each training step; offline: cached top-k log-probs / hidden states."""
    top_k: int = Field(32, ge=1)
    """offline: log-probabilities kept per position."""
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """offline: how the cache stores log-probs and hidden states; float16 halves float32's disk and
    page cache, bfloat16 keeps float32's range (for targets whose hidden states overflow float16)."""


class LossConfig(Section):
    kind: Literal["ce", "fkl", "rkl", "jsd", "tv"] = "fkl"
    """ce: hard labels (the target's tokens); fkl/rkl: forward/reverse KL; jsd: JSD(beta); tv: total variation."""
    beta: float = Field(0.5, gt=0.0, lt=1.0)
    """JSD mixing weight of the target distribution."""
    temperature: float = Field(1.0, gt=0.0)
    """Both distributions are softened by this temperature in the divergence."""
    head_weights: list[float] | None = None
    """medusa: per-head loss weights; default head_decay**k."""
    head_decay: float = Field(0.8, gt=0.0, le=1.0)
    """medusa: weight of head k is head_decay**k unless head_weights is given; eagle, eagle3: weight of
    draft step k+1 (see draft_steps)."""
    feature_weight: float = Field(1.0, ge=0.0)
    """eagle: weight of the smooth-L1 regression of the predicted feature on the target's, added to the
    token loss (EAGLE trains both)."""
    draft_steps: int = Field(1, ge=1, le=8)
    """eagle, eagle3: draft steps trained (training-time test, as HASS and EAGLE-3, which uses 3): step k
    reads the drafter's own guesses of the k-1 features before it, as drafting does, so later draft
    positions are trained on what they will see. Step k costs about k passes of the drafter's layers."""
    feature_noise: float = Field(0.0, ge=0.0)
    """eagle: uniform noise U(-a, a) added to the target features the drafter reads in training (EAGLE-1
    uses 0.1), so that slightly-off features, as its own guesses are, do not throw it."""
    prompt_positions: bool = False
    """eagle3: train at the prompts' positions too, not only the answers' (the target's distribution is
    known at every position of a row; drafting happens in answers only): more, and more varied, text
    per row where answers are few. The held-out AL is measured on answers either way."""


class OnPolicyConfig(Section):
    fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of training sequences whose answer is sampled from the drafter itself and scored by the target."""
    temperature: float = Field(1.0, ge=0.0)
    """Drafter sampling temperature for on-policy answers."""
    max_new_tokens: int = Field(64, ge=1)


class LoraConfig(Section):
    enabled: bool = False
    """Train LoRA adapters (peft) on the draft LM instead of all its weights; merged into the saved drafter."""
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class TrainConfig(Section):
    steps: int = Field(100, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(8, ge=1)
    """Sequences per micro-batch per process."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup, then cosine decay to zero at `steps` (or at the steps the time budget allows)."""
    time_budget_min: float | None = Field(None, gt=0.0)
    """Wall-clock minutes for training: its steps, its held-out evaluations (before, during and after) and
    checkpoints, not loading the target or preparing the data. Once the first steps are timed
    (train/loop.py, BUDGET_PROBE_STEPS) the run takes min(`steps`, what fits) and the cosine schedule ends
    there: a recipe keeps its time on a slower machine (fewer steps) and its step count on a faster one.
    The step count chosen is kept in checkpoints and the summary (`planned_steps`)."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    mixed_precision: Literal["auto", "bf16-if-native", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 autocast on a GPU that supports it, else full precision. bf16 on a CPU pays where the CPU has
    bf16 arithmetic (AVX512-BF16, AMX, Arm BF16; elsewhere a warning: emulated, it trained at 0.34x float32's
    rate); bf16-if-native: bf16 on such a CPU or GPU, full precision elsewhere. The drafter's weights and
    optimizer stay float32 either way."""
    seed: int = 0
    eval_every: int = Field(50, ge=0)
    """Steps between acceptance-length evaluations on the held-out prompts (0 = only before and after)."""
    eval_prompts: int = Field(8, ge=1)
    eval_draft_len: int = Field(4, ge=1)
    eval_max_new_tokens: int = Field(64, ge=1)
    checkpoint_every: int = Field(50, ge=0)
    """Steps between resumable checkpoints (0 = none)."""
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(10, ge=1)
    stop_at_al: float | None = Field(None, gt=1.0)
    """Finish early once a periodic held-out evaluation reaches this acceptance length (re-tuning)."""
    keep_best: bool = False
    """Write the weights of the best held-out evaluation (periodic or final), not the last ones (re-tuning)."""

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        # YAML reads a bare `no` (and `false`) as the boolean false: `train.mixed_precision=no` means "no".
        return "no" if value is False else value


class TrackingConfig(Section):
    report_to: Literal["wandb", "tensorboard", "none"] = "wandb"
    """W&B runs offline when no API key is set."""
    project: str = "draftsmith"
    run_name: str | None = None


class Recipe(Section):
    name: str
    """Recipe name (recorded in the drafter)."""
    target: str | None = None
    """Target model spec; None = the embedded default smollm2-135m-instruct."""
    output_dir: str
    """Run directory: checkpoints, logs, data caches, and the final drafter in <output_dir>/drafter."""
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    on_policy: OnPolicyConfig = Field(default_factory=OnPolicyConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        generating = kinds.get(self.drafter.kind).generates_text
        if self.on_policy.fraction > 0 and not generating:
            raise ValueError("on_policy.fraction > 0 needs drafter.kind: draft-lm (heads do not generate)")
        if self.on_policy.fraction > 0 and self.teacher.mode != "online":
            raise ValueError("on_policy.fraction > 0 needs teacher.mode: online (on-policy answers are scored live)")
        if self.lora.enabled and not generating:
            raise ValueError("lora.enabled needs drafter.kind: draft-lm")
        if self.loss.head_weights is not None and len(self.loss.head_weights) != self.drafter.num_heads:
            raise ValueError(f"loss.head_weights has {len(self.loss.head_weights)} entries for "
                             f"{self.drafter.num_heads} heads")
        return self

    def head_weights(self) -> list[float]:
        if self.loss.head_weights is not None:
            return list(self.loss.head_weights)
        return [self.loss.head_decay ** k for k in range(self.drafter.num_heads)]


def resolve_recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = RECIPES_DIR / (name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml")
    if "/" not in name_or_path and shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
    raise InvalidInputError(f"no such recipe file: {name_or_path} (shipped recipes: {known})")


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> Recipe:
    raw, path = load_raw_recipe(name_or_path, overrides)
    return validate_recipe(raw, str(path))


def load_raw_recipe(name_or_path: str, overrides: list[str] = ()) -> tuple[dict, Path]:
    """The recipe's YAML mapping with the overrides applied, not yet validated."""
    path = resolve_recipe_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"recipe {path} is not valid YAML: {first_line(exc)}") from None
    if not isinstance(raw, dict):
        raise InvalidInputError(f"recipe {path} must be a YAML mapping of sections")
    for override in overrides:
        apply_override(raw, override)
    return raw, path


def apply_override(raw: dict, override: str) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise InvalidInputError(f"override '{override}' must look like key=value (e.g. train.steps=50)")
    try:
        parsed = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        parsed = value
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise InvalidInputError(f"override '{override}': '{part}' is not a section")
    node[parts[-1]] = parsed


def validate_recipe(raw: dict, source: str, schema: type[BaseModel] | None = None) -> Recipe:
    try:
        return (schema or Recipe).model_validate(raw)
    except ValidationError as exc:
        raise InvalidInputError(f"recipe {source}: {describe_validation_error(exc)}") from None


def describe_validation_error(exc: ValidationError) -> str:
    """The first problem, naming the key: 'unknown key train.stepz', 'train.steps: Input should be ...'."""
    errors = exc.errors()
    error = errors[0]
    if error["loc"][-1:] == ("str",):  # a string-or-mapping entry (data.prompts): the mapping's problem says more
        error = next((e for e in errors[1:] if len(e["loc"]) > len(error["loc"])), error)
    # Union members appear in the path under their class names (CamelCase); keys are lower case.
    where = ".".join(str(part) for part in error["loc"] if not (isinstance(part, str) and part[:1].isupper())
                     and part != "str")
    if error["type"] == "extra_forbidden":
        return f"unknown key '{where}'"
    if error["type"] == "missing":
        return f"missing required key '{where}'"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
