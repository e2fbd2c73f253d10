#!/usr/bin/env python3
"""SVG plots (hand-written, stdlib only) from benches/compare.sh results.

Usage: plot.py RESULTS(.jsonl from the script, or the -o .json) OUT_DIR
Writes OUT_DIR/http.svg (req/s at c=1 and c=64, CPU us/request per target) and
OUT_DIR/ttft_cdf.svg (time to first token per target, from the load generator's quantiles).
"""
import json
import math
import os
import sys
from html import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]
FONT = 'font-family="sans-serif"'


def nice_max(v):
    if v <= 0:
        return 1
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * e:
            return m * e
    return 10 * e


def bar_panel(x0, y0, w, h, title, targets, series):
    """series: [(label, color, {target: value})]. Returns SVG elements."""
    out = [f'<text x="{x0 + w / 2}" y="{y0 - 8}" text-anchor="middle" {FONT} font-size="13" font-weight="bold">{escape(title)}</text>']
    vmax = nice_max(max([v for _, _, d in series for v in d.values() if v is not None] or [1]))
    out.append(f'<line x1="{x0}" y1="{y0 + h}" x2="{x0 + w}" y2="{y0 + h}" stroke="#333"/>')
    for i in range(5):
        v = vmax * i / 4
        y = y0 + h - h * i / 4
        out.append(f'<line x1="{x0}" y1="{y}" x2="{x0 + w}" y2="{y}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 4}" y="{y + 4}" text-anchor="end" {FONT} font-size="10">{v:g}</text>')
    gw = w / max(len(targets), 1)
    bw = gw * 0.8 / max(len(series), 1)
    for ti, t in enumerate(targets):
        gx = x0 + ti * gw + gw * 0.1
        for si, (_, color, d) in enumerate(series):
            v = d.get(t)
            if v is None:
                continue
            bh = h * v / vmax
            bx = gx + si * bw
            out.append(f'<rect x="{bx:.1f}" y="{y0 + h - bh:.1f}" width="{bw - 1:.1f}" height="{bh:.1f}" fill="{color}"><title>{escape(t)}: {v:.1f}</title></rect>')
            out.append(f'<text x="{bx + bw / 2:.1f}" y="{y0 + h - bh - 2:.1f}" text-anchor="middle" {FONT} font-size="8">{v:.0f}</text>')
        out.append(f'<text x="{x0 + ti * gw + gw / 2:.1f}" y="{y0 + h + 14}" text-anchor="middle" {FONT} font-size="10">{escape(t)}</text>')
    lx = x0 + w - 90
    for si, (label, color, _) in enumerate(series):
        out.append(f'<rect x="{lx}" y="{y0 + 4 + si * 14}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{lx + 14}" y="{y0 + 13 + si * 14}" {FONT} font-size="10">{escape(label)}</text>')
    return out


def svg(w, h, body, subtitle):
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">',
                      f'<rect width="{w}" height="{h}" fill="white"/>', *body,
                      f'<text x="{w - 6}" y="{h - 6}" text-anchor="end" {FONT} font-size="9" fill="#666">{escape(subtitle)}</text>',
                      "</svg>\n"])


def http_svg(doc, subtitle):
    rows = [r for r in doc.get("http", []) if "rps" in r]
    targets = list(dict.fromkeys(r["target"] for r in rows))
    by = lambda c, k: {r["target"]: r.get(k) for r in rows if r["connections"] == c}
    pw, ph = 560, 220
    body = []
    body += bar_panel(60, 40, pw, ph, "req/s, 64 connections", targets, [("c=64", COLORS[0], by(64, "rps"))])
    body += bar_panel(60, 40 + ph + 70, pw, ph, "req/s, 1 connection", targets, [("c=1", COLORS[1], by(1, "rps"))])
    body += bar_panel(60, 40 + 2 * (ph + 70), pw, ph, "proxy CPU us per request (user+system)",
                      [t for t in targets if t != "direct"],
                      [("c=1", COLORS[1], by(1, "cpu_us_per_req")), ("c=64", COLORS[0], by(64, "cpu_us_per_req"))])
    return svg(pw + 90, 3 * (ph + 70) + 30, body, subtitle)


def ttft_svg(doc, subtitle):
    rows = [r for r in doc.get("sse", []) if r.get("ttft")]
    qs = [("min_ms", 0.0), ("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99), ("p999_ms", 0.999), ("max_ms", 1.0)]
    vals = [r["ttft"][k] * 1000 for r in rows for k, _ in qs if r["ttft"][k] > 0]
    lo = 10 ** math.floor(math.log10(min(vals))) if vals else 10
    hi = 10 ** math.ceil(math.log10(max(vals))) if vals else 10000
    x0, y0, w, h = 70, 40, 620, 380
    X = lambda us: x0 + w * (math.log10(max(us, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    Y = lambda q: y0 + h - h * q
    body = [f'<text x="{x0 + w / 2}" y="24" text-anchor="middle" {FONT} font-size="13" font-weight="bold">'
            "SSE time to first token, c=1 (CDF through min, p50, p90, p99, p99.9, max)</text>",
            f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#333"/>']
    d = lo
    while d <= hi * 1.0001:
        for m in (1, 2, 5):
            v = d * m
            if v > hi * 1.0001:
                break
            body.append(f'<line x1="{X(v):.1f}" y1="{y0}" x2="{X(v):.1f}" y2="{y0 + h}" stroke="#eee"/>')
            body.append(f'<text x="{X(v):.1f}" y="{y0 + h + 14}" text-anchor="middle" {FONT} font-size="10">{v:g}</text>')
        d *= 10
    for q in (0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0):
        body.append(f'<line x1="{x0}" y1="{Y(q):.1f}" x2="{x0 + w}" y2="{Y(q):.1f}" stroke="#eee"/>')
        body.append(f'<text x="{x0 - 4}" y="{Y(q) + 4:.1f}" text-anchor="end" {FONT} font-size="10">{q:g}</text>')
    body.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 32}" text-anchor="middle" {FONT} font-size="11">TTFT, microseconds (log scale)</text>')
    for i, r in enumerate(rows):
        c = COLORS[i % len(COLORS)]
        pts = [(r["ttft"][k] * 1000, q) for k, q in qs]
        path = []
        for j, (us, q) in enumerate(pts):  # a step CDF: flat until the next quantile's value
            if j == 0:
                path.append(f"M{X(us):.1f},{Y(0):.1f}")
            else:
                path.append(f"H{X(us):.1f}")
            path.append(f"V{Y(q):.1f}")
        body.append(f'<path d="{" ".join(path)}" fill="none" stroke="{c}" stroke-width="2"><title>{escape(r["target"])}</title></path>')
        for us, q in pts:
            body.append(f'<circle cx="{X(us):.1f}" cy="{Y(q):.1f}" r="2.5" fill="{c}"/>')
        ly = y0 + h - 20 - 15 * (len(rows) - 1 - i)
        body.append(f'<rect x="{x0 + w - 210}" y="{ly - 9}" width="10" height="10" fill="{c}"/>')
        body.append(f'<text x="{x0 + w - 196}" y="{ly}" {FONT} font-size="10">{escape(r["target"])}: p50 '
                    f'{r["ttft"]["p50_ms"] * 1000:.0f} us, p99 {r["ttft"]["p99_ms"] * 1000:.0f} us</text>')
    return svg(x0 + w + 20, y0 + h + 60, body, subtitle)


def main():
    src, out = sys.argv[1], sys.argv[2]
    if src.endswith(".jsonl"):
        doc = report.load(src)
        report.derive(doc)
    else:
        doc = json.load(open(src))
    m = doc.get("meta", {})
    subtitle = f"benches/compare.sh {m.get('date', '')} commit {m.get('commit', '')}, load {m.get('load_start', '')}"
    os.makedirs(out, exist_ok=True)
    for name, text in (("http.svg", http_svg(doc, subtitle)), ("ttft_cdf.svg", ttft_svg(doc, subtitle))):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
        print(f"written: {os.path.join(out, name)}")


if __name__ == "__main__":
    main()
