"""``gpu.json`` -> ``gpu.md``: the GPU device kit's report, and the summaries measure.py keeps of
each step's own JSON (e2e, serve-load, policy). ``python bench gpu-report gpu.json [gpu.md]``
renders a returned (or sample) file again."""
from __future__ import annotations

import json
import pathlib
import sys
from typing import Dict, List

#: batch sizes shown in the curve table (c(k) = t(k) / t(1))
SHOW_KS = (2, 4, 8, 16, 32, 64)


def e2e_summary(e2e: dict) -> Dict[str, dict]:
    """Per family and configuration: tokens/s, measured and modeled ratio to plain, same text."""
    keep = ("tps", "vs_plain", "modeled_vs_plain", "all_match")
    return {"per_family": {fam: {name: {k: row.get(k) for k in keep} for name, row in cfg.items()}
                           for fam, cfg in e2e["per_family"].items()},
            "settings": {k: e2e["settings"].get(k) for k in
                         ("n_code", "n_chat", "n_reasoning", "n_predict", "runs", "threads")}}


def serve_summary(load: dict) -> dict:
    keep = ("clients", "system", "requests_per_s", "tokens_per_s", "draft_n",
            "draft_n_accepted", "x_plain_wall", "same_text")
    return {"summary": [{k: row.get(k) for k in keep} for row in load["summary"]],
            "settings": {k: load["settings"].get(k) for k in
                         ("slots", "clients", "requests", "max_tokens", "rounds", "threads")}}


def policy_summary(policy: dict) -> dict:
    return {"cost_model": policy["cost_model"], "names": policy["names"],
            "outputs": policy["outputs"], "summary": policy["summary"]}


def _c(curve: dict, k: int, row: int) -> str:
    ks, secs = curve["ks"], curve["seconds"][row]
    if k not in ks:
        return "—"
    return f"{secs[ks.index(k)] / secs[0]:.2f}"


def _f(value, spec=".2f") -> str:
    return "—" if value is None else format(value, spec)


def curves_table(curves: Dict[str, dict]) -> List[str]:
    lines = ["| model | type | KV | t(1) ms | " + " | ".join(f"c({k})" for k in SHOW_KS) + " |",
             "|---|---|---|---|" + "---|" * len(SHOW_KS)]
    for key, curve in curves.items():
        meta = curve.get("meta", {})
        for row, n_past in enumerate(curve["n_past"]):
            lines.append(f"| {meta.get('shape', key)} | {meta.get('type', '')} | {n_past} | "
                         f"{curve['seconds'][row][0] * 1e3:.2f} | "
                         + " | ".join(_c(curve, k, row) for k in SHOW_KS) + " |")
    return lines


def _section(title: str, intro: str, columns, rows) -> List[str]:
    """A titled markdown table."""
    return ([f"## {title}", "", intro, "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""])


def _driver_rows(drv):
    return [(name, _f(r["tokens_per_s"], ".1f"), r["n_decodes"],
             _f(r["decode_ms_per_step"], ".3f"), _f(r["driver_ms_per_step"], ".3f"))
            for name, r in ((n, drv.get(n)) for n in ("plain", "speculative")) if r]


def _e2e_rows(e2e):
    return [(fam, name, _f(r["tps"], ".1f"), _f(r["vs_plain"]), _f(r["modeled_vs_plain"]),
             r["all_match"]) for fam, cfg in e2e["per_family"].items() for name, r in cfg.items()]


def _load_rows(load):
    return [(r["clients"], r["system"], _f(r["requests_per_s"], ".3f"),
             _f(r["tokens_per_s"], ".1f"), _f(r["x_plain_wall"]),
             f"{r['draft_n_accepted']} / {r['draft_n']}") for r in load["summary"]]


#: gpu.json key -> (title, intro, columns, rows) of its table in gpu.md
SECTIONS = [
    ("driver", "The Python driver's time per step",
     lambda d: f"README's code edit, {d['n_predict']} tokens, second run of each (llama.cpp's "
               "perf counters for the decodes):",
     ("run", "tokens/s", "decodes", "llama_decode ms/step", "driver ms/step"), _driver_rows),
    ("e2e", "Live generation (`bench e2e`: generate's comparisons, embedded model)",
     lambda d: f"settings: {d['settings']}",
     ("family", "configuration", "tokens/s", "vs plain", "modeled", "same text"), _e2e_rows),
    ("serve_load", "Server under load (`bench serve-load`, ngramspec serve)",
     lambda d: f"settings: {d['settings']}",
     ("clients", "mode", "req/s", "tokens/s", "vs plain", "accepted / drafted"), _load_rows),
]


def render(res: dict) -> str:
    dev = res.get("device", {})
    dry = res.get("dry_run")
    out = ["# ngramspec on a GPU" + (" — CPU dry run (no GPU: the kit's pipeline only)"
                                     if dry else ""), ""]
    out += [f"- device: {dev.get('gpu') or 'none (CPU)'}; host CPU {dev.get('cpu')}, "
            f"{dev.get('cores')} cores",
            f"- build: llama-cpp-python {dev.get('llama_cpp_python')} ({dev.get('build')}), "
            f"{dev.get('build_seconds')} s; CMAKE_ARGS `{dev.get('cmake_args')}`; "
            f"n_gpu_layers {dev.get('n_gpu_layers')}",
            f"- system info: {dev.get('system_info')}",
            f"- date {dev.get('date')}, ngramspec revision {dev.get('revision')}, Python "
            f"{dev.get('python')}; phases (s): {res.get('phases')}", ""]
    if res.get("curves"):
        out += ["## Verify cost c(k, L) = t(k) / t(1) (`ngramspec calibrate`)", "",
                "Random-weight models of each shape (bench/gpu/shapes.py) and the embedded "
                "SmolLM2-135M; every layer on the device.", ""]
        out += curves_table(res["curves"]) + [""]
    for key, title, intro, columns, rows in SECTIONS:
        if res.get(key):
            out += _section(title, intro(res[key]), columns, rows(res[key]))
    rep = res.get("replay")
    if rep:
        fams = list(rep["summary"])
        out += ["## Modeled speed-up on the traces (`bench policy --recorded`)", "",
                f"Priced by: {rep['cost_model']}; {rep['outputs']}. Geomean per family "
                "(min in brackets).", "",
                "| configuration | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
        for name in ["oracle", *rep["names"]]:
            cells = [rep["summary"][f].get(name) for f in fams]
            out.append(f"| {name} | " + " | ".join(
                f"{c['geomean']:.3f} ({c['min']:.3f})" if c else "—" for c in cells) + " |")
        out.append("")
    out += ["## Steps", "", "| step | phase | rc | seconds |", "|---|---|---|---|"]
    for name, s in res.get("steps", {}).items():
        out.append(f"| {name} | {s.get('phase')} | {s.get('rc', s.get('skipped'))} | "
                   f"{s.get('seconds', '—')} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python bench gpu-report GPU_JSON [OUT_MD]  (default: beside the JSON)")
        return 0 if argv else 2
    src = pathlib.Path(argv[0])
    res = json.loads(src.read_text())
    if res.get("format") != "ngramspec-gpu/1":
        raise SystemExit(f"{src}: not a GPU kit result (format {res.get('format')!r})")
    dst = pathlib.Path(argv[1]) if len(argv) > 1 else src.with_suffix(".md")
    dst.write_text(render(res))
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
