"""report.md: the report as readable tables (all figures are in report.json)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.eval.speed import MIN_PROMPTS_FOR_VERDICT


def render(r: dict, figures: dict[str, Path]) -> str:
    s = r["settings"]
    lines = [
        "# draftsmith eval",
        "",
        f"- target: `{r['target']['name']}` (weights {r['target']['weight_hash'][:12]}, "
        f"tokenizer {r['target']['tokenizer_hash'][:12]}, {r['target']['dtype']} on {r['target']['device']}; "
        f"verifier {r.get('verifier', 'verify_native')})",
        f"- drafter: `{r['drafter']['spec']}` ({r['drafter']['kind']}, weights "
        f"{'shared with the target' if r['drafter']['shares_target_weights'] else _short(r['drafter']['weight_hash'])}"
        ")",
        f"- prompts: {r['prompts']['count']} from `{r['prompts']['path']}`; modes {', '.join(s['modes'])}; "
        f"D in {s['draft_lens']}{_adaptive_setting(s)}; batch sizes {s['batch_sizes']}; "
        f"max_new_tokens {s['max_new_tokens']}; "
        f"chat {s['chat']}; seed {s['seed']}",
        f"- wall time: {r['wall_s']:.1f} s; exit code {r['exit_code']}",
        "",
    ]
    if r.get("comparison"):
        lines += [f"**Verdict: {r['comparison']['verdict']['reason']}**", ""]
    lines += (_exactness(r) + _acceptance(r, s) + _quality(r) + _speed(r) + _speed_by_category(r, s) + _memory(r)
              + _advice(r))
    if r.get("comparison"):
        lines += _comparison(r["comparison"], s)
    if figures:
        lines += ["## Plots", ""] + [f"![{name}]({Path(path).name})" for name, path in figures.items()] + [""]
    return "\n".join(lines)


def _acceptance(r: dict, s: dict) -> list[str]:
    ci = f"{s['confidence']:.0%} CI"
    out = ["## Acceptance (batch size 1, per prompt)", "",
           f"| mode | D | AL | {ci} | predicted AL | per-position acceptance | rounds | tokens/round histogram |",
           "|---|---|---|---|---|---|---|---|"]
    for a in r["acceptance"]:
        rates = ", ".join("-" if p["rate"] is None else f"{p['rate']:.2f}" for p in a["positions"])
        hist = " ".join(str(n) for n in a["emitted_hist"][1:])
        out.append(f"| {a['mode']} | {a['draft_len']} | {a['al']:.3f} | {_ci(a['al_ci'])} | {a['predicted_al']:.3f} "
                   f"| {rates} | {a['rounds']} | {hist} |")
    leaves = [a for a in r["acceptance"] if a.get("leaf_share")]
    if leaves:
        out += [""] + [f"Sibling leaves ({a['mode']}, D={a['draft_len']}): a leaf replaced a rejected draft token in "
                       f"{a['leaf_share']:.0%} of the rounds." for a in leaves]
    categories = [(a, name, c) for a in r["acceptance"] for name, c in a["by_category"].items()]
    if categories:
        out += ["", "By category:", "", f"| mode | D | category | prompts | AL | {ci} |", "|---|---|---|---|---|---|"]
        out += [f"| {a['mode']} | {a['draft_len']} | {name} | {c['prompts']} | {c['al']:.3f} | {_ci(c['al_ci'])} |"
                for a, name, c in categories]
    return out + [""]


def _exactness(r: dict) -> list[str]:
    e = r["exactness"]
    g = e["greedy"]
    out = ["## Exactness", ""]
    if g is not None:
        out.append(f"Greedy: {g['share_identical']:.1%} of outputs token-identical to plain greedy decoding "
                   f"({g['errors']} errors, {g['near_ties']} near-ties within {g['tie_tolerance']:g} logits): "
                   f"{'pass' if g['passed'] else 'FAIL'}.")
        for d in g["divergences"]:
            out.append(f"- prompt {d['prompt_id']} ({draft_label(d)}, B={d['batch_size']}): first difference at "
                       f"token {d['position']}, plain {d['plain_token']} vs {d['got_token']}, target margin "
                       f"{d['margin']:.3g} -> {d['kind']}")
    for f in e["sampling"]:
        out.append(f"Sampling {f['mode']} (D={f['draft_len']}): {len(f['contexts'])} contexts x "
                   f"{f['samples_per_side']} samples per side, first {f['tokens_per_sample']} tokens; "
                   f"mean TV {f['mean_tv']:.3f}, chi2 {f['chi2']:.1f} on {f['dof']} dof, p = {f['p_value']:.3g}: "
                   f"{'pass' if f['passed'] else 'FAIL'} (alpha {f['alpha']:g}).")
    return out + [""]


def _quality(r: dict) -> list[str]:
    out = ["## Quality", "", "| mode | decoder | D | NLL/token | CI | ROUGE-L F1 | CI |",
           "|---|---|---|---|---|---|---|"]
    for q in r["quality"]:
        ref = q["reference_metric"]
        ref_cells = f"{ref['value']:.3f} | {_ci(ref['ci'])}" if ref else "- | -"
        out.append(f"| {q['mode']} | {q['decoder']} | {_d(q)} | {q['nll_per_token']:.3f} | "
                   f"{_ci(q['nll_ci'])} | {ref_cells} |")
    return out + [""]


def _speed(r: dict) -> list[str]:
    out = ["## Speed", "", "| mode | B | decoder | D | tokens/s | speedup | TTFT p50 s | latency p50/p95/p99 ms "
           "| s per 1k tokens | AL |", "|---|---|---|---|---|---|---|---|---|---|"]
    for v in r["speed"]:
        lat = "/".join(_num(v["latency_ms"][q], 1) for q in ("p50", "p95", "p99"))
        out.append(f"| {v['mode']} | {v['batch_size']} | {v['decoder']} | {_d(v)} | {v['tokens_per_s']:.1f} "
                   f"| {_num(v.get('speedup'), 2)} | {_num(v['ttft_s']['p50'], 3)} | {lat} "
                   f"| {_num(v['compute_s_per_1k_tokens'], 1)} | {_num(v['al'], 2)} |")
    adaptive = [v for v in r["speed"] if v["decoder"] == "adaptive"]
    if adaptive:
        out += [""] + [f"Adaptive ({v['mode']}, B={v['batch_size']}): up to D={v['draft_len']}, "
                       f"{v['mean_draft_len']:.2f} tokens drafted per round; the draft length `draftsmith generate` "
                       f"and `serve` use by default." for v in adaptive]
    return out + [""]


def _speed_by_category(r: dict, s: dict) -> list[str]:
    """Each batch-size-1 decoder's speedup over plain decoding per prompt category, one column per decoder."""
    rows = r.get("speed_by_category") or []
    if not rows:
        return []
    ci = f"{s['confidence']:.0%} CI"
    out = ["## Speed against plain decoding, per category (batch size 1)", "",
           f"Speedup over plain decoding of the same prompts [{ci}, resampling prompts; the decoders took turns on "
           f"each prompt]; `slower` only where the whole CI lies below 1, no verdict under "
           f"{MIN_PROMPTS_FOR_VERDICT} prompts. One decode per prompt and decoder: the CI holds timing noise only as "
           "far as it varies from prompt to prompt.", ""]
    for mode in dict.fromkeys(row["mode"] for row in rows):
        columns = [row for row in rows if row["mode"] == mode]
        names = ["all", *columns[0]["categories"]]
        out += [f"| {mode}: category | prompts | plain tok/s | " + " | ".join(draft_label(c) for c in columns) + " |",
                "|---|---|---|" + "---|" * len(columns)]
        for name in names:
            cells = [c["all"] if name == "all" else c["categories"][name] for c in columns]
            out.append(f"| {name} | {cells[0]['prompts']} | {cells[0]['plain_tokens_per_s']:.1f} | "
                       + " | ".join(_speedup_cell(cell) for cell in cells) + " |")
        for c in columns:
            if c["decoder"] == "adaptive":
                out += ["", f"{mode}, {draft_label(c)} (the default): {slower_line(c)}."]
        out.append("")
    return out


def slower_line(c: dict) -> str:
    """Where one speed_by_category row is slower than plain decoding, and where it has too few prompts to say."""
    line = f"slower than plain decoding in: {', '.join(c['slower']) or 'none'}"
    few = c.get("too_few_prompts") or []
    if few:
        line += f" (too few prompts to tell in {len(few)} of {len(c['categories'])} categories: {', '.join(few)})"
    return line


def _speedup_cell(cell: dict) -> str:
    low, high = cell["speedup_ci"]
    mark = {"slower": " **slower**", "too few prompts": " (few)"}.get(cell["verdict"], "")
    return f"{cell['speedup']:.2f}x [{_num(low, 2)}, {_num(high, 2)}]{mark}"


def draft_label(row: dict) -> str:
    """How a report row (speed, speed_by_category, a divergence) names its draft length: D=4, or adaptive D<=4."""
    return f"adaptive D<={row['draft_len']}" if row.get("decoder") == "adaptive" else f"D={row['draft_len']}"


def _d(row: dict) -> str:
    return f"<={row['draft_len']}" if row.get("decoder") == "adaptive" else str(row["draft_len"])


def _adaptive_setting(s: dict) -> str:
    n = s.get("adaptive_draft_len", 0)
    return f" and adaptive up to {n}" if n else ""


def _memory(r: dict) -> list[str]:
    m = r["memory"]
    out = ["## Memory (MiB)", "", "| B | context | target weights | drafter weights | target KV | drafter KV | total "
           "| measured peak |", "|---|---|---|---|---|---|---|---|"]
    peaks = {p["batch_size"]: p["peak_bytes"] for p in m["measured"]["per_batch_size"]}
    for row in m["ledger"]:
        out.append(f"| {row['batch_size']} | {row['context_len']} | {_mib(row['target_weights'])} | "
                   f"{_mib(row['drafter_weights'])} | {_mib(row['target_kv'])} | {_mib(row['drafter_kv'])} | "
                   f"{_mib(row['total'])} | {_mib(peaks.get(row['batch_size']))} |")
    first = m["ledger"][0]
    per_request = (f" KV per active request (its {first['context_len']} reserved slots, as the serving engine "
                   f"counts them): target {_mib(first['target_kv_per_request'])}, drafter "
                   f"{_mib(first['drafter_kv_per_request'])}." if "target_kv_per_request" in first else "")
    return out + ["", f"Measured: {m['measured']['kind']}; drafter weights: {first['drafter_weights_note']}.{per_request}",
                  ""]


def _advice(r: dict) -> list[str]:
    out = ["## Draft-length advice", "", "| mode | B | recommended D | expected speedup | measured best D "
           "| agrees | expected tokens/s by D |", "|---|---|---|---|---|---|---|"]
    for a in r["advice"]:
        rec = next(e for e in a["expected"] if e["draft_len"] == a["recommended_draft_len"])
        by_d = ", ".join(f"{e['draft_len']}: {e['expected_tokens_per_s']:.1f}" for e in a["expected"])
        out.append(f"| {a['mode']} | {a['batch_size']} | {a['recommended_draft_len']} | {rec['expected_speedup']:.2f} "
                   f"| {a['measured_best_draft_len']} | {'yes' if a['agrees'] else 'no'} | {by_d} |")
    out += ["", "D = 0 means plain decoding."]
    for a in r["advice"]:
        m = a.get("adaptive")
        if m:
            out.append(f"Measured, {a['mode']} B={a['batch_size']}: the adaptive draft length "
                       f"(up to D={m['max_draft_len']}) {m['tokens_per_s']:.1f} tokens/s, {_num(m['speedup'], 2)}x plain, "
                       f"{_num(m['vs_best_fixed'], 2)}x the best fixed D of the sweep.")
    return out + [""]


def _comparison(c: dict, s: dict) -> list[str]:
    out = ["## Change against the baseline", "", f"Baseline: `{c['baseline']}` (target "
           f"{_short(c['baseline_target']['weight_hash'])}). Rule: {c['rule']}.", "",
           "| mode | D | AL old | AL new | change | CI | decision | per-position change |",
           "|---|---|---|---|---|---|---|---|"]
    for row in c["rows"]:
        al = row["al"]
        positions = ", ".join(_num(p["change"], 2) for p in row["positions"])
        out.append(f"| {row['mode']} | {row['draft_len']} | {al['old']:.3f} | {al['new']:.3f} | "
                   f"{_pct(al['relative'])} | {_pct(al['relative_ci'][0])} to {_pct(al['relative_ci'][1])} | "
                   f"{row['decision']} | {positions} |")
    for row in c["rows"]:
        for name, al in row["by_category"].items():
            out.append(f"- {row['mode']} D={row['draft_len']} {name}: {al['old']:.2f} -> {al['new']:.2f} "
                       f"({_pct(al['relative'])}, CI {_pct(al['relative_ci'][0])} to {_pct(al['relative_ci'][1])})")
    return out + [""]


def _ci(ci) -> str:
    return f"[{_num(ci[0], 3)}, {_num(ci[1], 3)}]" if ci else "-"


def _num(value, digits: int) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None or value != value else f"{value:+.1%}"


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _short(value) -> str:
    return value[:12] if value else "-"
