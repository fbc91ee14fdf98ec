"""Evaluating drafters: acceptance, exactness, quality, speed, memory, draft-length advice, verdicts.

    run.evaluate(target, drafter_spec, prompts, settings, *, verifier=, out_dir=, baseline=) -> report.Report
    verdict.compare_reports(report, baseline) -> comparison with its keep / retune verdict
    settings.EvalSettings      what is swept and how the statistics are made
    decoding                   passes over the prompts with per-prompt bookkeeping
    acceptance / exactness / fidelity / quality / speed / memory / advice   one figure family each
    verdict                    baseline reports: the paired AL change and keep / retune
    report / markdown / plots / tracking   report.json, report.md, PNGs, W&B
    metrics/<name>/<name>.py   evaluate modules (NLL, ROUGE-L) loaded offline from their path

Modules are imported on use; this package imports nothing itself.
"""
