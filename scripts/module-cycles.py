#!/usr/bin/env python3
"""Lists module pairs that import each other, at every level of a crate: top-level modules
(`crate::a` in b and `crate::b` in a) and the sub-modules of each module directory (`super::a`,
or the absolute `crate::m::a`, in m's sub-module b and the other way round); test modules
included. Exit status 1 when there is one. Usage: module-cycles.py [crate dir...]"""
import pathlib
import re
import sys


def children(directory: pathlib.Path, top: bool):
    """Child module name -> list of (file, depth below the child) for the module directory
    `directory` (a crate's src/ when `top`)."""
    out = {}
    for f in directory.rglob("*.rs"):
        rel = f.relative_to(directory)
        if top and (rel.parts[0] == "bin" or rel.name in ("lib.rs", "main.rs") and len(rel.parts) == 1):
            continue
        if not top and len(rel.parts) == 1 and rel.name == "mod.rs":
            continue
        name = rel.parts[0].removesuffix(".rs")
        # foo.rs and foo/mod.rs are foo's own file (depth 0); foo/bar.rs is one below.
        depth = len(rel.parts) - 1 - (1 if rel.name == "mod.rs" else 0)
        out.setdefault(name, []).append((f, depth))
    return out


def code(f: pathlib.Path) -> str:
    # Doc links and comments name modules without importing them.
    return "\n".join(l for l in f.read_text().splitlines() if not l.lstrip().startswith("//"))


def imports(files, names, prefix: str):
    """The sibling modules (of `names`) that the given files import: `crate::<prefix>name`, or
    `super::name` from a module's own file (`super::super::name` one level down)."""
    found = set()
    for f, depth in files:
        text = code(f)
        for head in (rf"crate::{re.escape(prefix)}", r"super::" * (depth + 1)):
            for m in re.finditer(rf"\b{head}([a-z_0-9]+)", text):
                if m.group(1) in names:
                    found.add(m.group(1))
            for m in re.finditer(rf"\b{head}\{{([^}}]*)\}}", text):
                for part in re.split(r"[,\s]+", m.group(1)):
                    if part.split("::")[0] in names:
                        found.add(part.split("::")[0])
    return found


def check(label: str, directory: pathlib.Path, prefix: str, top: bool) -> int:
    """Prints the pairs among `directory`'s child modules; recurses into module directories."""
    mods = children(directory, top)
    edges = {m: imports(fs, mods, prefix) - {m} for m, fs in mods.items()}
    bad = 0
    for a in sorted(edges):
        for b in sorted(edges[a]):
            if a < b and a in edges.get(b, set()):
                print(f"{label}: {a} <-> {b}")
                bad += 1
    for sub in sorted(p for p in directory.iterdir() if p.is_dir() and not (top and p.name == "bin")):
        bad += check(f"{label}::{sub.name}", sub, f"{prefix}{sub.name}::", False)
    return bad


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    crates = sys.argv[1:] or [p.parent.name for p in root.glob("*/Cargo.toml")]
    bad = 0
    for crate in crates:
        src = root / crate / "src"
        if src.is_dir():
            bad += check(crate, src, "", True)
    sys.exit(1 if bad else 0)


main()
