"""Logging a report to Weights & Biases: headline scalars, the plots as images, and the report tables.

The run is offline unless a WANDB_API_KEY is set (an explicit WANDB_MODE wins); its files go under the
report directory, so an offline run can be synced later with `wandb sync <out>/wandb/offline-run-*`.
"""

from __future__ import annotations

import os
from pathlib import Path

ACCEPTANCE_COLUMNS = ["mode", "draft_len", "al", "al_ci_lo", "al_ci_hi", "predicted_al", "rounds"]
SPEED_COLUMNS = ["mode", "batch_size", "decoder", "draft_len", "tokens_per_s", "speedup", "p50_ms", "p95_ms", "p99_ms"]


def wandb_mode() -> str:
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def log_to_wandb(report: dict, out_dir: Path, figures: dict[str, Path]) -> str:
    """Log `report` as one W&B run; returns the run's local directory."""
    import wandb

    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "draftsmith"), job_type="eval", name=Path(out_dir).name,
                     dir=str(out_dir), mode=wandb_mode(), config=report["settings"], reinit="finish_previous")
    try:
        run.log(scalars(report))
        run.log({name: wandb.Image(str(path)) for name, path in figures.items()})
        run.log({"acceptance": wandb.Table(columns=ACCEPTANCE_COLUMNS, data=acceptance_rows(report)),
                 "speed": wandb.Table(columns=SPEED_COLUMNS, data=speed_rows(report))})
        run.summary["exit_code"] = report["exit_code"]
        if report.get("comparison"):
            run.summary["verdict"] = report["comparison"]["verdict"]["decision"]
            run.summary["verdict_reason"] = report["comparison"]["verdict"]["reason"]
        return run.dir
    finally:
        run.finish()


def scalars(report: dict) -> dict:
    out = {}
    for a in report["acceptance"]:
        key = f"acceptance/{a['mode']}/D{a['draft_len']}"
        out[f"{key}/al"] = a["al"]
        out[f"{key}/predicted_al"] = a["predicted_al"]
        for p in a["positions"]:
            if p["rate"] is not None:
                out[f"{key}/alpha_{p['position']}"] = p["rate"]
    for v in report["speed"]:
        d = f"adaptive-D{v['draft_len']}" if v["decoder"] == "adaptive" else f"D{v['draft_len']}"
        key = f"speed/{v['mode']}/B{v['batch_size']}/{d}"
        out[f"{key}/tokens_per_s"] = v["tokens_per_s"]
        if v.get("speedup") is not None:
            out[f"{key}/speedup"] = v["speedup"]
    for c in report.get("speed_by_category") or []:
        if c["decoder"] == "adaptive":
            for name, cell in {"all": c["all"], **c["categories"]}.items():
                out[f"speed_by_category/{c['mode']}/adaptive-D{c['draft_len']}/{name}/speedup"] = cell["speedup"]
    greedy = report["exactness"]["greedy"]
    if greedy is not None:
        out["exactness/greedy_share_identical"] = greedy["share_identical"]
    for f in report["exactness"]["sampling"]:
        out[f"exactness/{f['mode']}/p_value"] = f["p_value"]
    return {k: v for k, v in out.items() if v is not None and v == v}


def acceptance_rows(report: dict) -> list[list]:
    return [[a["mode"], a["draft_len"], a["al"], a["al_ci"][0], a["al_ci"][1], a["predicted_al"], a["rounds"]]
            for a in report["acceptance"]]


def speed_rows(report: dict) -> list[list]:
    return [[v["mode"], v["batch_size"], v["decoder"], v["draft_len"], v["tokens_per_s"], v.get("speedup"),
             v["latency_ms"]["p50"], v["latency_ms"]["p95"], v["latency_ms"]["p99"]] for v in report["speed"]]
