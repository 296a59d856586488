"""The Markdown report and the PNG charts, from the JSON data of one run."""
from __future__ import annotations

import os
import textwrap
from typing import Any, Optional

from benchmarks.harness import CLOCK_WORDS
from benchmarks.variants import LABELS, ORDER

UNIT_WORDS = {"us": "µs", "ns": "ns", "s": "s", "ms": "ms", "MiB": "MiB", "count": ""}

# How each case is charted: the value plotted, log scale, and the y label.
CHART_SPEC: dict[str, dict[str, Any]] = {
    "hook_tax": {"value": "median", "log": False},
    "per_call": {"value": "median", "log": True},
    "guard_check": {"value": "median", "log": True,
                    "variants": ["dynamo guard check", "ours state guards",
                                 "dynamo hit overhead", "ours hit overhead",
                                 "nn.Module call overhead"]},
    "lookup": {"value": "median", "log": False, "line": "entries"},
    "capture_time": {"value": "median", "log": True},
    "recaptures": {"value": "median", "log": False, "annotate": True},
    "steady_state": {"value": "ratio", "log": False},
    "memory": {"value": "median", "log": False},
}


def fmt(v: Optional[float]) -> str:
    if v is None:
        return "–"
    if float(v).is_integer() and abs(v) < 1e6:
        return f"{int(v)}"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def one_line(row: Any) -> str:
    r = row if isinstance(row, dict) else row.as_dict()
    unit = UNIT_WORDS.get(r["unit"], r["unit"])
    if r["status"] != "ok":
        return f"{r['bench']:<34} {r['variant']:<22} {r['status']}: {r['error']}"
    ratio = f"  x{r['ratio']:.2f}" if r.get("ratio") is not None else ""
    return (f"{r['bench']:<34} {r['variant']:<22} {fmt(r['median']):>9} {unit} "
            f"[{fmt(r['p10'])}..{fmt(r['p90'])}]{ratio}  (n={r['n']}, loops={r['loops']})")


def _variant_order(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["variant"] not in seen:
            seen.append(r["variant"])
    known = [v for v in ORDER if v in seen]
    return known + [v for v in seen if v not in known]


def _benches(rows: list[dict]) -> list[str]:
    out: list[str] = []
    for r in rows:
        if r["bench"] not in out:
            out.append(r["bench"])
    return out


def cell(r: Optional[dict], with_spread: bool = True) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return "skipped" if r["status"] == "skipped" else "n/a"
    text = fmt(r["median"])
    if with_spread and r["n"] > 1 and r["p10"] is not None:
        text += f" ({fmt(r['p10'])}–{fmt(r['p90'])})"
    if r.get("ratio") is not None and r["variant"] != r.get("baseline"):
        text += f" ×{r['ratio']:.2f}"
    return text


def wide_table(rows: list[dict]) -> str:
    variants = _variant_order(rows)
    index = {(r["bench"], r["variant"]): r for r in rows}
    units = sorted({UNIT_WORDS.get(r["unit"], r["unit"]) for r in rows} - {""})
    head = f"| {'/'.join(units) or 'value'} | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (len(variants) + 1)]
    for bench in _benches(rows):
        cells = [cell(index.get((bench, v))) for v in variants]
        lines.append(f"| {bench} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_table(rows: list[dict]) -> str:
    lines = ["| benchmark | variant | median | p10 | p90 | ratio | n | loops/repeat | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        unit = UNIT_WORDS.get(r["unit"], r["unit"])
        if r["status"] != "ok":
            lines.append(f"| {r['bench']} | {r['variant']} | {r['status']} | | | | | | "
                         f"{_md(r['error'])} |")
            continue
        ratio = f"{r['ratio']:.3f} vs {r['baseline']}" if r.get("ratio") is not None else ""
        lines.append(f"| {r['bench']} | {r['variant']} | {fmt(r['median'])} {unit} | "
                     f"{fmt(r['p10'])} | {fmt(r['p90'])} | {ratio} | {r['n']} | {r['loops']} | "
                     f"{_md(r.get('note') or '')} |")
    return "\n".join(lines)


def _md(text: Optional[str]) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def unavailable(rows: list[dict]) -> list[str]:
    """One line per distinct (variant, reason)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            seen.setdefault((r["variant"], r["error"] or ""), []).append(r["bench"])
    return [f"- **{v}** ({len(b)} figure(s), e.g. {b[0]}), {rows_status(rows, v, b[0])}: "
            f"{_md(e)}"
            for (v, e), b in seen.items()]


def unavailable_summary(rows: list[dict]) -> list[str]:
    """Distinct reasons across all cases, with the cases they hit."""
    seen: dict[tuple[str, str, str], set[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            key = (r["status"], r["variant"].split(" ")[0], r["error"] or "")
            seen.setdefault(key, set()).add(r["case"])
    return [f"- {status}, **{variant}**-family variants in {', '.join(sorted(cases))}: "
            f"{_md(error)}" for (status, variant, error), cases in seen.items()]


def rows_status(rows: list[dict], variant: str, bench: str) -> str:
    for r in rows:
        if r["variant"] == variant and r["bench"] == bench:
            return r["status"]
    return "not available"


def find(data: dict, case: str, bench: str, variant: str) -> Optional[dict]:
    for r in data["rows"]:
        if r["case"] == case and r["bench"] == bench and r["variant"] == variant:
            return r
    return None


def headline(data: dict) -> str:
    """The few numbers worth reading first."""
    lines = ["| figure | eager / baseline | Dynamo | ours | ours vs eager |",
             "|---|---|---|---|---|"]

    def val(r: Optional[dict]) -> str:
        if r is None:
            return "not run"
        if r["status"] != "ok":
            return "n/a"
        return f"{fmt(r['median'])} {UNIT_WORDS.get(r['unit'], r['unit'])}".strip()

    def ratio(r: Optional[dict]) -> str:
        return f"×{r['ratio']:.2f}" if r and r["status"] == "ok" and r.get("ratio") else ""

    for mode in ("no_grad", "grad"):
        b = f"nn.Linear(8,8), {mode}"
        e, d, o = (find(data, "per_call", b, v) for v in ("eager", "dynamo", "ours"))
        if e or o:
            over = ""
            if e and o and e["status"] == o["status"] == "ok":
                diff = o["median"] - e["median"]
                over = f"{'+' if diff >= 0 else '−'}{fmt(abs(diff))} µs ({ratio(o)})"
            lines.append(f"| per call, {b} | {val(e)} | {val(d)} | {val(o)} | {over} |")
    for b in ("gpt12, batch 8, no_grad", "gpt12, batch 8, fwd+bwd",
              "gpt12, batch 1, no_grad"):
        e, d, o = (find(data, "steady_state", b, v) for v in ("eager", "dynamo", "ours"))
        if e or o:
            lines.append(f"| steady state, {b} | {val(e)} | {val(d)} | {val(o)} | {ratio(o)} |")
    for v in ("imported", "armed (rewrite)"):
        n = find(data, "hook_tax", "fib(20)", "none")
        o = find(data, "hook_tax", "fib(20)", v)
        d = find(data, "hook_tax", "fib(20)", "dynamo run-only" if v != "imported"
                 else "dynamo alive")
        if o:
            lines.append(f"| hook tax, fib(20), {v} (per frame) | {val(n)} | {val(d)} "
                         f"{ratio(d)} | {val(o)} | {ratio(o)} vs none |")
    for b in ("depth 1, 1 input", "depth 12, 1 input", "depth 48, 1 input",
              "depth 1, 16 inputs"):
        d = find(data, "guard_check", b, "dynamo guard check")
        og = find(data, "guard_check", b, "ours state guards")
        o = find(data, "guard_check", b, "ours hit overhead")
        do = find(data, "guard_check", b, "dynamo hit overhead")
        if d or o:
            # check and state guards are not the same scope (Dynamo's check includes
            # its input-tensor guards, check_verbose() leaves out our per-call key): no
            # ratio between them; make bench-ir counts the same scope on both sides
            lines.append(f"| guards, {b} | | check with input guards {val(d)}; hit "
                         f"overhead {val(do)} | state guards without the input key "
                         f"{val(og)}; hit overhead {val(o)} {ratio(o)} | |")
    return "\n".join(lines) if len(lines) > 2 else "(no headline figures in this run)"


def markdown(data: dict, charts: list[str]) -> str:
    meta = data["meta"]
    out = [f"# nnscaler-eval benchmarks: {meta['date']} ({meta['mode']} run)", ""]
    out += [
        "| machine | |", "|---|---|",
        f"| CPU | {meta['cpu_model']} |",
        f"| cores / torch threads | {meta['cores']} / {meta['torch_num_threads']} |",
        f"| memory | {meta.get('memory_gib')} GiB |",
        f"| Python | {meta['python']} |",
        f"| torch | {meta['torch']} |",
        f"| platform | {meta['platform']} |",
        f"| git commit | {meta['git_commit']} ({meta['git_branch']}"
        f"{', dirty' if meta.get('git_dirty') else ''}) |",
        f"| nnscaler | {meta.get('nnscaler')} |",
        f"| load average at start / end | {meta.get('loadavg_start')} / "
        f"{meta.get('loadavg_end')} |",
        f"| run time | {meta['seconds']:.0f} s |",
        "",
        f"Clock: {CLOCK_WORDS.get(meta['settings'].get('clock', 'wall'))}; first calls "
        "(capture time) are wall-clock. "
        f"Every figure: median and p10–p90 over {meta['settings']['repeats']} interleaved "
        f"repeats (variant order rotated every repeat); each repeat times a loop of at "
        f"least {meta['settings']['min_time'] * 1000:.0f} ms unless a single iteration is "
        "longer. Ratios divide medians measured in the same process (`×1.00` = as fast "
        "as the baseline; higher is slower). Dynamo setting: "
        f"{meta['dynamo_config']}.",
        "",
        "Variants: " + "; ".join(f"`{k}` = {v}" for k, v in LABELS.items()) + ".",
        "",
        "## Headline",
        "",
        headline(data),
        "",
    ]
    missing = unavailable_summary(data["rows"])
    if missing:
        out += ["## Not available or skipped in this run", "", *missing, ""]
    for i, (name, case) in enumerate(data["cases"].items(), 1):
        rows = [r for r in data["rows"] if r["case"] == name]
        out += [f"## {i}. {case['title']}", ""]
        doc = case.get("doc", "")
        if doc:
            out += [_quote(doc), ""]
        out += [f"Time: {case['seconds']} s."]
        if case.get("error"):
            out += ["", f"**The case failed**: {_md(case['error'])}"]
        if rows:
            out += ["", wide_table(rows), ""]
            for chart in charts:
                if chart.startswith(f"{_stem(data)}-{name}"):
                    out += [f"![{name}]({chart})", ""]
            na = unavailable(rows)
            if na:
                out += ["Not available or skipped:", *na, ""]
            notes = sorted({r["note"] for r in rows if r.get("note") and r["status"] == "ok"})
            if notes:
                out += ["Notes:", *[f"- {_md(n)}" for n in notes], ""]
            out += ["<details><summary>all figures</summary>", "", long_table(rows), "",
                    "</details>", ""]
    return "\n".join(out) + "\n"


def _quote(doc: str) -> str:
    return "\n".join(("> " + line).rstrip() for line in doc.splitlines())


def _stem(data: dict) -> str:
    return data.get("stem", "")


def charts(data: dict, out_dir: str, stem: str) -> list[str]:
    """One PNG per case with figures; returns the file names (relative to out_dir)."""
    data["stem"] = stem
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # charts are optional; the tables are the report
        print(f"no charts: matplotlib unavailable ({exc})")
        return []
    names = []
    for name, case in data["cases"].items():
        spec = CHART_SPEC.get(name, {"value": "median", "log": False})
        rows = [r for r in data["rows"] if r["case"] == name and r["status"] == "ok"
                and (r["variant"] in spec.get("variants", [r["variant"]]))]
        if spec.get("log"):
            rows = [r for r in rows if r["median"] and r["median"] > 0]
        if not rows:
            continue
        fig = _bar_chart(plt, rows, case["title"], spec)
        file = f"{stem}-{name}.png"
        fig.savefig(os.path.join(out_dir, file), dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(file)
    return names


# Ours in warm colours, everything else in cool ones, wherever a variant appears.
COLORS = {"eager": "#7f7f7f", "dynamo": "#1f77b4", "aot_eager": "#17becf",
          "inductor": "#9467bd", "ours": "#d62728", "ours-inductor": "#ff7f0e",
          "none": "#7f7f7f", "imported": "#e377c2", "armed (rewrite)": "#d62728",
          "armed (capture)": "#ff7f0e", "dynamo alive": "#1f77b4",
          "dynamo run-only": "#17becf", "dynamo guard check": "#17becf",
          "dynamo hit overhead": "#1f77b4", "ours hit overhead": "#d62728",
          "ours state guards": "#ff7f0e",
          "nn.Module call overhead": "#7f7f7f"}
WARM = ["#d62728", "#ff7f0e", "#e377c2", "#8c564b"]
COOL = ["#1f77b4", "#17becf", "#2ca02c", "#9467bd", "#bcbd22", "#7f7f7f"]


def color_of(variant: str, index: int) -> str:
    if variant in COLORS:
        return COLORS[variant]
    family = WARM if variant.startswith(("ours", "armed")) else COOL
    return family[index % len(family)]


def _bar_chart(plt: Any, rows: list[dict], title: str, spec: dict) -> Any:
    benches = _benches(rows)
    variants = _variant_order(rows)
    use_ratio = spec["value"] == "ratio"
    n_b, n_v = len(benches), len(variants)
    width = 0.8 / max(1, n_v)
    fig_w = max(7.0, min(18.0, 1.2 + n_b * (0.25 + 0.16 * n_v)))
    fig, ax = plt.subplots(figsize=(fig_w, 4.8))
    index = {(r["bench"], r["variant"]): r for r in rows}
    for j, v in enumerate(variants):
        xs, ys, lo, hi = [], [], [], []
        for i, b in enumerate(benches):
            r = index.get((b, v))
            if r is None:
                continue
            if use_ratio:
                if r.get("ratio") is None:
                    continue
                y = r["ratio"]
                scale = y / r["median"] if r["median"] else 1.0
                p10, p90 = r["p10"] * scale, r["p90"] * scale
            else:
                y, p10, p90 = r["median"], r["p10"], r["p90"]
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(y)
            lo.append(max(0.0, y - (p10 if p10 is not None else y)))
            hi.append(max(0.0, (p90 if p90 is not None else y) - y))
        color = color_of(v, j)
        bars = ax.bar(xs, ys, width * 0.95, label=v, color=color,
                      yerr=[lo, hi] if any(lo) or any(hi) else None, capsize=2,
                      error_kw={"elinewidth": 0.8, "ecolor": "black"})
        if spec.get("annotate"):
            ax.bar_label(bars, labels=[fmt(y) for y in ys], fontsize=7, padding=1)
    ax.set_xticks(range(n_b))
    if n_b > 4:
        ax.set_xticklabels(benches, rotation=30, ha="right", fontsize=8)
    else:
        ax.set_xticklabels([textwrap.fill(b, 22) for b in benches], fontsize=8)
    unit = UNIT_WORDS.get(rows[0]["unit"], rows[0]["unit"])
    if use_ratio:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel("time / eager time (lower is faster)")
    else:
        ax.set_ylabel(f"median ({unit})" if unit else "count")
    if spec.get("log"):
        ax.set_yscale("log")
    ax.set_title(title + " — bars: median, whiskers: p10–p90", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)
    return fig


def write_latest(out_dir: str, stem: str) -> None:
    """latest.md: a copy of the newest report (its image links work from the same
    folder), with a line pointing at the dated files."""
    src = os.path.join(out_dir, f"{stem}.md")
    dst = os.path.join(out_dir, "latest.md")
    with open(src) as f:
        text = f.read()
    with open(dst, "w") as f:
        f.write(f"<!-- copy of {stem}.md; data in {stem}.json -->\n"
                f"Newest run: [{stem}.md]({stem}.md), data [{stem}.json]({stem}.json).\n\n")
        f.write(text)


def rerender(json_path: str) -> None:
    """Rewrite the Markdown report and charts of a results JSON (same folder, same
    stem): `python -m benchmarks.report benchmarks/results/<date>.json`."""
    import json

    out_dir, name = os.path.split(os.path.abspath(json_path))
    stem = name[:-len(".json")]
    with open(json_path) as f:
        data = json.load(f)
    names = charts(data, out_dir, stem)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown(data, names))


if __name__ == "__main__":
    import sys

    for path in sys.argv[1:]:
        rerender(path)
