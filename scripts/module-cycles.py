#!/usr/bin/env python3
"""Lists module pairs of a crate that import each other (`crate::a` in b and `crate::b` in a),
test modules included. Exit status 1 when there is one. Usage: module-cycles.py [crate dir...]"""
import pathlib
import re
import sys


def modules(src: pathlib.Path):
    """Top-level module name -> text of all its files."""
    out = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src)
        if rel.parts[0] in ("bin",) or rel.name in ("lib.rs", "main.rs") and len(rel.parts) == 1:
            continue
        top = rel.parts[0].removesuffix(".rs")
        out[top] = out.get(top, "") + f.read_text()
    return out


def imports(text: str, names):
    # Doc links and comments name modules without importing them.
    text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))
    found = set()
    for m in re.finditer(r"\b(?:crate|super)::([a-z_0-9]+)", text):
        if m.group(1) in names:
            found.add(m.group(1))
    for m in re.finditer(r"use crate::\{([^}]*)\}", text):
        for part in re.split(r"[,\s]+", m.group(1)):
            head = part.split("::")[0]
            if head in names:
                found.add(head)
    return found


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    crates = sys.argv[1:] or [p.parent.name for p in root.glob("*/Cargo.toml")]
    bad = 0
    for crate in crates:
        src = root / crate / "src"
        if not src.is_dir():
            continue
        mods = modules(src)
        edges = {m: imports(t, mods) - {m} for m, t in mods.items()}
        for a in sorted(edges):
            for b in sorted(edges[a]):
                if a < b and a in edges.get(b, set()):
                    print(f"{crate}: {a} <-> {b}")
                    bad += 1
    sys.exit(1 if bad else 0)


main()
