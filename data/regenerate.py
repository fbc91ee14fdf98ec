"""Target-regenerated responses (self-distillation data): the target answers every prompt itself.

A drafter learns to predict the target, so the best training replies are the target's own. For each
conversation the trailing assistant message(s) are dropped, the rest is rendered with the generation
prompt (`render_prompt`), and the target answers through draftsmith's runtime (`SpeculativeDecoder`;
a proposer only makes it faster: greedy output is identical, sampled output identically distributed).

Each output row stores exactly what the target produced:

    input_ids    prompt ids + generated ids (a stop token, if one was hit, is the last id)
    loss_mask    0 on the prompt, 1 on every generated id
    prompt_len   len(prompt ids)
    messages     prompt messages + {"role": "assistant", "content": decoded reply}
    finish_reason  "stop" or "length"; plus id, category and reference from the input

The ids are not re-rendered from the decoded text: a reply can re-tokenize differently, and a reply
cut off by max_new_tokens must not gain an end-of-turn token it never produced.

On disk (`out_dir`), written so that a crash or Ctrl-C loses nothing already finished:

    manifest.json              settings (target, tokenizer, sampling, shard size, input hash) and the
                               completed shards; a rerun with other settings is refused
    shards/shard-00000.jsonl   shard_size output rows each, in input order
    dataset/                   the whole result (`Dataset.save_to_disk`), once every shard is done

Every file is written to a temporary name beside its place and renamed into it. Row r is sampled
with its own seed, derived from (seed, r), so outputs do not depend on batch size or composition.

Answers already written: `reuse` names other regeneration directories (finished or not, for example
the other `regen-*` caches of a recipe's data.cache_dir). A greedy answer depends only on the target, its
tokenizer, the rendered prompt ids and max_new_tokens, so a record whose prompt ids one of them answered
greedily with the same target and limit takes that answer instead of being decoded again: adding prompts
to a recipe answers only the new ones. A sampled row depends on its seed as well (`row_seed`, from the
run's seed and the row's index), so it takes an earlier sampled row with the same prompt, seed and
sampling settings: `self:N` prompts grown to a larger N write only the new ones.

The dtype the target runs in is recorded when it is not float32 (bfloat16 roughly doubles the decoding
throughput of a CPU with bf16 arithmetic at regeneration's batch sizes). A lower-precision target's
answers are its own, not the float32 target's token for token, so they are cached apart; a run in
bfloat16 or float16 still takes float32 answers already written for the same prompts (the target's own
text, which the lower-precision answers approximate), never the reverse.

Throughput: one engine (speculative/engine.py) answers every shard with at most batch_size rows; a
finished row leaves at once and a waiting prompt joins in its place, and prompts are queued shard by
shard in order of length, so the batch neither drains to its longest row nor pads short prompts to long
ones (`_generate_shards`). A shard is written when its last row finishes, so shards finish in any order.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from hashlib import sha256
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from draftsmith.data.manifest import open_run_dir, read_manifest, shard_range, write_manifest
from draftsmith.data.render import TOKEN_FEATURES, render_prompt, render_user_turn
from draftsmith.speculative.dtypes import dtype_name
from draftsmith.speculative.errors import InvalidInputError, first_line
from draftsmith.speculative.fileio import atomic_directory, atomic_write_text
from draftsmith.speculative.engine import Engine
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import LoadedModel, tokenizer_hash
from draftsmith.speculative.prompts import stop_token_ids
from draftsmith.speculative.proposers import Proposer
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.speculative.options import DecodeOptions, Request

KIND = "draftsmith-regenerated"
OUTPUT_FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "category": datasets.Value("string"),
    "reference": datasets.Value("string"),
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    **TOKEN_FEATURES,
    "finish_reason": datasets.Value("string"),
})


def regenerate(
    target: LoadedModel,
    conversations: datasets.Dataset,
    out_dir: Path,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    shard_size: int = 64,
    proposer: Proposer | None = None,
    draft_len: int = 4,
    progress: bool = True,
    role: str = "assistant",
    desc: str = "regenerating",
    reuse: Iterable[Path] = (),
) -> datasets.Dataset:
    """Answer every conversation with `target` into `out_dir` (see the module docstring); resumable.

    batch_size, proposer and draft_len change speed only, so a rerun may change them freely.
    role="user" makes the target write the next user turn instead of an answer (the conversations may
    then be empty; see draftsmith.data.self_prompts); the new message gets that role. `reuse`: other
    regeneration directories whose rows stand in for decoding the same prompts (module docstring). The
    target decodes in the dtype its model is in (recorded in the manifest when not float32).
    """
    _check_args(conversations, max_new_tokens, batch_size, shard_size, draft_len)
    SamplingParams(temperature=temperature, top_p=top_p, seed=0)  # validates the sampling settings
    if role not in ("assistant", "user"):
        raise InvalidInputError(f"regenerate writes assistant or user turns, not {role!r}")
    _check_prompts(conversations, target.tokenizer, need_user=role == "assistant")
    out_dir = Path(out_dir)
    settings = {
        "target": target.name,
        "target_weight_hash": target.weight_hash(),
        "tokenizer_hash": tokenizer_hash(target.tokenizer),
        "max_new_tokens": max_new_tokens,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "seed": seed,
        "shard_size": shard_size,
        "num_records": len(conversations),
        "input_hash": conversations_hash(conversations),
    }
    if role != "assistant":  # (absent for answers, so the manifests written before this option still match)
        settings["role"] = role
    dtype = model_dtype(target.model)
    if dtype != FULL_PRECISION:  # (absent for float32, likewise)
        settings["dtype"] = dtype
    num_shards = math.ceil(len(conversations) / shard_size)
    manifest = open_run_dir(out_dir, KIND, settings, num_shards)
    if manifest["complete"] and (out_dir / "dataset").is_dir():
        return _load(out_dir, progress)

    shard_dir = out_dir / "shards"
    shard_dir.mkdir(exist_ok=True)
    done = {s for s in manifest["shards_done"] if (shard_dir / shard_name(s)).is_file()}
    if done:
        print(f"regenerate: resuming, {len(done)}/{num_shards} shards done in {out_dir}", file=sys.stderr)
    donors = _donor_answers(reuse, settings, out_dir)
    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=stop_token_ids(target.model, target.tokenizer))
    done_records = sum(len(shard_range(s, shard_size, len(conversations))) for s in done)
    with tqdm(total=len(conversations), initial=done_records, unit="rec", desc=desc,
              disable=not progress, file=sys.stderr) as bar:
        todo = [shard for shard in range(num_shards) if shard not in done]
        reused = [0]
        for shard, rows in _generate_shards(decoder, target.tokenizer, conversations, todo, settings, batch_size,
                                            draft_len, bar, role, donors, reused):
            _write_shard(shard_dir / shard_name(shard), rows)
            done.add(shard)
            manifest["shards_done"] = sorted(done)
            write_manifest(out_dir, manifest)
    if reused[0]:
        print(f"regenerate: {reused[0]} of {len(conversations) - done_records} answers taken from earlier runs "
              f"(the same prompts and seeds, decoded by the same target)", file=sys.stderr)
    return _finish(out_dir, manifest, num_shards, len(conversations), progress)


def load_regenerated(out_dir: Path) -> datasets.Dataset:
    """The dataset a finished `regenerate` run wrote to `out_dir`."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir, KIND)
    if not manifest["complete"] or not (out_dir / "dataset").is_dir():
        raise InvalidInputError(
            f"regeneration in {out_dir} is unfinished ({len(manifest['shards_done'])}/{manifest['num_shards']} "
            "shards); rerun it with the same settings to finish"
        )
    return _load(out_dir, progress=False)


def conversations_hash(conversations: datasets.Dataset) -> str:
    """sha256 over the id, messages, category and reference of every row, in order."""
    digest = sha256()
    columns = [c for c in ("id", "messages", "category", "reference") if c in conversations.column_names]
    for batch in conversations.select_columns(columns).iter(batch_size=1000):
        digest.update(json.dumps(batch, sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()


def row_seed(seed: int, index: int) -> int:
    """The sampling seed of record `index`: a 63-bit hash of (seed, index)."""
    return int.from_bytes(sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.jsonl"


# --- generating the shards ---------------------------------------------------------------------


def _generate_shards(decoder, tokenizer, conversations, shards: list[int], settings: dict, batch_size: int,
                     draft_len: int, bar, role: str, donors: dict | None = None,
                     reused: list[int] | None = None) -> Iterator[tuple[int, list[dict]]]:
    """(shard, its output rows in record order) for every shard in `shards`, as each one's last row finishes.

    One engine runs at most `batch_size` rows; a row that finishes leaves at once and a waiting one joins
    in its place, so the batch stays full instead of draining to its longest row. Each shard's requests are
    queued in order of prompt length (length bucketing: rows that join together are prefilled with little
    padding), and the next shard's as soon as fewer than `batch_size` wait, so shard ends do not drain it
    either. Outputs do not depend on this schedule: a greedy row is the target's greedy decoding of it
    alone, a sampled row draws from its own seed (`row_seed`). A row whose prompt and seed are in `donors`
    (`_donor_key` -> (generated ids, finish reason), `_donor_answers`) takes that answer without decoding;
    `reused` counts them.
    """
    reused = [0] if reused is None else reused
    # Rows join in groups of a quarter batch: each join copies the running cache (engine.py, min_join).
    engine = Engine(decoder, DecodeOptions(max_new_tokens=settings["max_new_tokens"], draft_len=draft_len),
                    max_batch=batch_size, min_join=max(1, batch_size // 4))
    render = render_prompt if role == "assistant" else render_user_turn
    pending = deque(shards)
    running: dict[int, _ShardRun] = {}
    owner: dict[int, tuple[int, int]] = {}  # request id -> (shard, row in the shard)
    while pending or engine.busy:
        while pending and engine.queued < batch_size:
            shard = pending.popleft()
            records = shard_range(shard, settings["shard_size"], settings["num_records"])
            rows = [_prompt_row(conversations[r], r, need_user=role == "assistant") for r in records]
            run = running[shard] = _ShardRun(rows, [render(tokenizer, row["messages"]) for row in rows])
            for k, prompt in enumerate(run.prompts):
                answer = donors.get(_donor_key(prompt, _seed_of(settings, records[k]))) if donors else None
                if answer is not None:
                    _complete_row(run.rows[k], tokenizer, prompt, answer[0], answer[1], role)
                    run.answered.add(k)
                    run.left -= 1
                    reused[0] += 1
                    bar.update(1)
            if run.left == 0:
                yield shard, running.pop(shard).rows
                continue
            for k in sorted(set(range(len(rows))) - run.answered, key=lambda k: len(run.prompts[k])):
                sampling = SamplingParams(temperature=settings["temperature"], top_p=settings["top_p"],
                                          seed=row_seed(settings["seed"], records[k]))
                owner[engine.add(Request(run.prompts[k], sampling, settings["max_new_tokens"]))] = (shard, k)
        for emission in engine.step():
            shard, k = owner[emission.request_id]
            run = running[shard]
            run.outputs[k] += emission.tokens
            if emission.finish_reason is None:
                continue
            _complete_row(run.rows[k], tokenizer, run.prompts[k], run.outputs[k], emission.finish_reason, role)
            del owner[emission.request_id]
            run.left -= 1
            bar.update(1)
            if run.left == 0:
                yield shard, running.pop(shard).rows


class _ShardRun:
    """A shard being answered: its rows, rendered prompts, tokens so far, and rows not yet finished."""

    def __init__(self, rows: list[dict], prompts: list[list[int]]):
        self.rows, self.prompts = rows, prompts
        self.outputs: list[list[int]] = [[] for _ in rows]
        self.left = len(rows)
        self.answered: set[int] = set()  # rows that took an earlier run's answer


def model_dtype(model: torch.nn.Module) -> str:
    """The name of the floating-point dtype `model`'s parameters are in (float32 for one with none)."""
    return next((dtype_name(p.dtype) for p in model.parameters() if p.is_floating_point()), FULL_PRECISION)


def _seed_of(settings: dict, index: int) -> int | None:
    """Record `index`'s sampling seed, or None for a greedy run (whose answers do not depend on it)."""
    return None if settings["temperature"] == 0 else row_seed(settings["seed"], index)


def _donor_key(prompt: list[int], seed: int | None) -> bytes:
    return sha256(json.dumps([list(prompt), seed]).encode()).digest()


FULL_PRECISION = "float32"
REUSE_SETTINGS = ("target_weight_hash", "tokenizer_hash", "max_new_tokens", "temperature", "role")
SAMPLED_REUSE_SETTINGS = ("top_p",)  # besides the seed, which is per row


def _donor_answers(dirs: Iterable[Path], settings: dict, out_dir: Path) -> dict[bytes, tuple[list[int], str]]:
    """(prompt, seed) key -> (generated ids, finish reason) from every finished shard of the regeneration
    runs in `dirs` that decoded with the same target, tokenizer, max_new_tokens, temperature and role (and
    top_p, for sampled runs, whose rows are keyed by their seeds too), in the same dtype or in float32.
    Directories that are not such runs (other settings, another kind, unreadable) give nothing; `out_dir`
    itself is skipped."""
    sampled = settings["temperature"] != 0
    wanted = REUSE_SETTINGS + (SAMPLED_REUSE_SETTINGS if sampled else ())
    dtype = settings.get("dtype", FULL_PRECISION)
    answers: dict[bytes, tuple[list[int], str]] = {}
    for directory in dirs:
        directory = Path(directory)
        if not directory.is_dir() or directory.resolve() == Path(out_dir).resolve():
            continue
        try:
            manifest = read_manifest(directory, KIND)
        except InvalidInputError:
            continue
        stored = manifest["settings"]
        if (any(stored.get(key) != settings.get(key) for key in wanted)
                or stored.get("dtype", FULL_PRECISION) not in (dtype, FULL_PRECISION)):
            continue
        for shard in manifest["shards_done"]:
            path = directory / "shards" / shard_name(shard)
            records = shard_range(shard, stored["shard_size"], stored["num_records"])
            try:
                rows = _read_shard(path, len(records))
            except InvalidInputError:
                continue
            for index, row in zip(records, rows):
                cut = row["prompt_len"]
                key = _donor_key(row["input_ids"][:cut], _seed_of(stored, index))
                answers.setdefault(key, (row["input_ids"][cut:], row["finish_reason"]))
    return answers


def _check_prompts(conversations: datasets.Dataset, tokenizer, need_user: bool) -> None:
    """Refuse unanswerable records before anything is written (a run dir is tied to its input)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError("regeneration renders prompts with a chat template; this tokenizer has none")
    if not need_user:
        return
    index = 0
    for batch in conversations.select_columns(["messages"]).iter(batch_size=1000):
        for messages in batch["messages"]:
            if not any(m["role"] != "assistant" for m in messages or []):
                raise InvalidInputError(f"record {index} has no user message to answer")
            index += 1


def _prompt_row(record: dict, index: int, need_user: bool) -> dict:
    messages = list(record["messages"] or [])
    while need_user and messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if need_user and not messages:
        raise InvalidInputError(f"record {index} has no user message to answer")
    return {
        "id": str(record["id"]) if record.get("id") is not None else str(index),
        "category": str(record.get("category") or ""),
        "reference": str(record.get("reference") or ""),
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
    }


def _complete_row(row: dict, tokenizer, prompt: list[int], generated: list[int], reason: str, role: str) -> None:
    reply = tokenizer.decode(generated, skip_special_tokens=True)
    row["messages"].append({"role": role, "content": reply})
    row["input_ids"] = list(prompt) + list(generated)
    row["loss_mask"] = [0] * len(prompt) + [1] * len(generated)
    row["prompt_len"] = len(prompt)
    row["finish_reason"] = reason


def _write_shard(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _read_shard(path: Path, expected: int) -> list[dict]:
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"corrupt shard {path}: {first_line(exc)}; delete it and rerun") from exc
    if len(rows) != expected:
        raise InvalidInputError(f"corrupt shard {path}: {len(rows)} rows, expected {expected}; delete it and rerun")
    return rows


def _finish(out_dir: Path, manifest: dict, num_shards: int, total: int, progress: bool) -> datasets.Dataset:
    shard_size = manifest["settings"]["shard_size"]
    rows = []
    for shard in range(num_shards):
        rows += _read_shard(out_dir / "shards" / shard_name(shard), len(shard_range(shard, shard_size, total)))
    dataset = datasets.Dataset.from_list(rows, features=OUTPUT_FEATURES)
    with datasets_progress(progress):
        save_dataset_atomic(dataset, out_dir / "dataset")
    manifest["complete"] = True
    write_manifest(out_dir, manifest)
    return _load(out_dir, progress)


def _load(out_dir: Path, progress: bool) -> datasets.Dataset:
    with datasets_progress(progress):
        return datasets.load_from_disk(str(out_dir / "dataset"))


def _check_args(conversations, max_new_tokens, batch_size, shard_size, draft_len) -> None:
    if not isinstance(conversations, datasets.Dataset) or "messages" not in conversations.column_names:
        raise InvalidInputError("regenerate needs a Dataset with a messages column (see data.prompts)")
    if len(conversations) == 0:
        raise InvalidInputError("no conversations to regenerate")
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size), ("shard_size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(draft_len, int) or draft_len < 0:
        raise InvalidInputError(f"draft_len must be >= 0, got {draft_len!r}")


# --- writing the dataset ------------------------------------------------------------------------


def save_dataset_atomic(dataset: datasets.Dataset, path: Path) -> None:
    """`dataset.save_to_disk(path)` through a temporary directory, so `path` is whole or absent.
    An existing `path` is replaced: an earlier run died between saving and marking itself complete."""
    with atomic_directory(path, overwrite=True) as scratch:
        dataset.save_to_disk(str(scratch))


@contextlib.contextmanager
def datasets_progress(enabled: bool):
    was_disabled = datasets.are_progress_bars_disabled()
    if not enabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            datasets.enable_progress_bars()
