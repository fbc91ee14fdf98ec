"""Peak memory of reading a large offline teacher cache the way training does.

    python benchmarks/teacher_cache_rss.py build DIR [--examples 17440] [--length 200] [--hidden-size 576]
                                                    [--top-k 8] [--shard-size 256]
    python benchmarks/teacher_cache_rss.py read DIR [--batch-size 8] [--steps 0] [--teacher-module FILE]
    python benchmarks/teacher_cache_rss.py write DIR [--target SPEC] [--examples 32] [--length 384]
                                                    [--batch-size 8] [--top-k 8] [--teacher-module FILE]

`build` writes a synthetic cache in the teacher cache's on-disk format (data/teacher.py: safetensors shards
and a manifest), without a model: the defaults are ten times the SmolLM2 EAGLE recipe's cache with its
extra samples (1,744 sequences of about 200 tokens, a 576-d hidden state in float16 and the top 8
log-probs), 4.2 GB. Values are a cheap pattern that `read` checks on every row it reads.

`read` opens the cache, reads random batches of rows as the training loop does (`padded_cache_field`:
each row's top-k log-probs, ids and hidden state, padded to the batch's longest row; an epoch is one
permutation of the rows, seeded), and reports rows/s and the process's peak resident memory
(`ru_maxrss`, which counts the file pages it has mapped and touched as well as its own). `--steps 0`
reads every row once. `--teacher-module FILE` reads with another version of data/teacher.py (for a
before/after comparison, e.g. `git show REV:data/teacher.py > /tmp/teacher_before.py`).

`write` caches the signals of `--examples` random sequences of `--length` tokens with a real target (the
embedded SmolLM2 by default; top-k log-probs and hidden states) through `cache_teacher_signals`, and
reports its time and the process's peak resident memory, the model's weights included.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.data.manifest import create_run_dir, write_manifest

FIELDS = ("topk_logprobs", "topk_ids", "hidden")


def build(out_dir: Path, examples: int, length: int, hidden_size: int, top_k: int, shard_size: int) -> None:
    """A finished cache of `examples` rows of `length` +- 25% tokens; row i's values encode i (see `expected`)."""
    lengths = [length * 3 // 4 + (i * 7919) % (length // 2 + 1) for i in range(examples)]
    settings = {"target": "synthetic", "target_weight_hash": "synthetic", "tokenizer_hash": "synthetic",
                "top_k": top_k, "hidden": True, "hidden_size": hidden_size, "vocab_size": 49152,
                "dtype": "float16", "shard_size": shard_size, "num_examples": examples,
                "num_tokens": sum(lengths), "dataset_fingerprint": "synthetic"}
    num_shards = -(-examples // shard_size)
    manifest = create_run_dir(out_dir, "draftsmith-teacher-cache", settings, num_shards)
    t0 = time.perf_counter()
    for shard in range(num_shards):
        rows = range(shard * shard_size, min((shard + 1) * shard_size, examples))
        sizes = torch.tensor([lengths[i] for i in rows])
        owner = torch.repeat_interleave(torch.tensor(list(rows)), sizes)  # [N_tok] the row of each token
        tensors = {
            "topk_logprobs": (-(owner % 7).float()[:, None] - torch.arange(top_k)).half(),
            "topk_ids": ((owner[:, None] * 8 + torch.arange(top_k)) % 49152).int(),
            "hidden": (owner % 1000).half()[:, None].expand(-1, hidden_size).contiguous(),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
        }
        save_file(tensors, str(out_dir / f"shard-{shard:05d}.safetensors"))
        manifest["shards_done"].append(shard)
    manifest["complete"] = True
    write_manifest(out_dir, manifest)
    size = sum(p.stat().st_size for p in out_dir.glob("shard-*.safetensors"))
    print(f"built {out_dir}: {examples:,} rows, {sum(lengths):,} tokens, {num_shards} shards, "
          f"{size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")


def expected(i: int, name: str) -> float:
    return {"topk_logprobs": -(i % 7), "topk_ids": (i * 8) % 49152, "hidden": i % 1000}[name]


def read(cache_dir: Path, batch_size: int, steps: int, teacher_module: str | None, seed: int) -> dict:
    module = _load_module(teacher_module)
    t0 = time.perf_counter()
    cache = module.TeacherCache(cache_dir)
    opened_s = time.perf_counter() - t0
    order = torch.randperm(len(cache), generator=torch.Generator().manual_seed(seed)).tolist()
    if steps:
        order = order[: steps * batch_size]
    t0 = time.perf_counter()
    for begin in range(0, len(order), batch_size):
        indices = order[begin: begin + batch_size]
        batch = padded_fields(cache, indices)
        for b, i in enumerate(indices):  # the first position of each row holds what build() wrote for it
            for name in FIELDS:
                if batch[name][b, 0, 0].item() != expected(i, name):
                    raise SystemExit(f"row {i}: {name} reads {batch[name][b, 0, 0].item()}, not {expected(i, name)}")
    read_s = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"module": teacher_module or "draftsmith.data.teacher", "rows": len(order), "batch_size": batch_size,
            "open_s": round(opened_s, 2), "read_s": round(read_s, 1), "rows_per_s": round(len(order) / read_s, 1),
            "cache_gb": round(sum(p.stat().st_size for p in Path(cache_dir).glob("shard-*")) / 1e9, 2),
            "peak_rss_mb": round(peak_kb / 1024)}


def write(out_dir: Path, target_spec: str | None, examples: int, length: int, batch_size: int, top_k: int,
          teacher_module: str | None) -> dict:
    import datasets

    from draftsmith.speculative.loading import load_model

    module = _load_module(teacher_module)
    target = load_model(target_spec)
    vocab = target.model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, vocab, (length,), generator=g).tolist()} for _ in range(examples)]
    loaded_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    module.cache_teacher_signals(target, datasets.Dataset.from_list(rows), out_dir, top_k=top_k, hidden=True,
                                 batch_size=batch_size, progress=False)
    return {"module": teacher_module or "draftsmith.data.teacher", "target": target.name, "examples": examples,
            "length": length, "batch_size": batch_size, "write_s": round(time.perf_counter() - t0, 1),
            "rss_after_loading_mb": round(loaded_kb / 1024),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def padded_fields(cache, indices: list[int]) -> dict[str, torch.Tensor]:
    """What the training loop builds from the cache for one batch: [B, L, width] per field."""
    if hasattr(cache, "padded"):  # a reader that pads itself
        return {name: cache.padded(indices, name) for name in FIELDS}
    rows = [cache[i] for i in indices]
    length = max(r["topk_ids"].shape[0] for r in rows)
    out = {}
    for name in FIELDS:
        field = torch.zeros(len(rows), length, rows[0][name].shape[-1], dtype=rows[0][name].dtype)
        for b, row in enumerate(rows):
            field[b, : row[name].shape[0]] = row[name]
        out[name] = field
    return out


def _load_module(path: str | None):
    if path is None:
        import draftsmith.data.teacher as module
        return module
    spec = importlib.util.spec_from_file_location("teacher_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write a synthetic cache")
    b.add_argument("dir", type=Path)
    b.add_argument("--examples", type=int, default=17_440)
    b.add_argument("--length", type=int, default=200)
    b.add_argument("--hidden-size", type=int, default=576)
    b.add_argument("--top-k", type=int, default=8)
    b.add_argument("--shard-size", type=int, default=256)
    r = sub.add_parser("read", help="read it as training does; print rows/s and peak RSS as JSON")
    r.add_argument("dir", type=Path)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--steps", type=int, default=0, help="batches to read; 0 = every row once")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--teacher-module", default=None, help="a data/teacher.py file to read with instead")
    w = sub.add_parser("write", help="cache a real target's signals; print time and peak RSS as JSON")
    w.add_argument("dir", type=Path)
    w.add_argument("--target", default=None, help="a model spec (default: the embedded SmolLM2)")
    w.add_argument("--examples", type=int, default=32)
    w.add_argument("--length", type=int, default=384)
    w.add_argument("--batch-size", type=int, default=8)
    w.add_argument("--top-k", type=int, default=8)
    w.add_argument("--teacher-module", default=None, help="a data/teacher.py file to write with instead")
    args = parser.parse_args(argv)
    if args.command == "write":
        print(json.dumps(write(args.dir, args.target, args.examples, args.length, args.batch_size, args.top_k,
                               args.teacher_module)))
    elif args.command == "build":
        build(args.dir, args.examples, args.length, args.hidden_size, args.top_k, args.shard_size)
    else:
        print(json.dumps(read(args.dir, args.batch_size, args.steps, args.teacher_module, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
