#!/usr/bin/env python3
"""The workspace's functions and modules a request crosses, from callgrind files.

Reads callgrind out files (benches/path_callgrind.sh keeps them with OUT=dir) and counts the
distinct functions whose source file lies in this workspace (not in a dependency, the standard
library or libc) that were called at least once per two requests in the measured window, and the
distinct source files (modules) and crates they are in. A function's calls are the `calls=`
lines naming it as `cfn=`; its file is the `fl=` in force at its `fn=` line, and where that is
a dependency's or the standard library's file (its first instructions were inlined from there)
while its name is a workspace crate's path (`tunnel::…`, `<tunnel::… as …>::…`), the first
workspace file among the lines of its body (`fl=`, `fi=`, `fe=`). The allocator shims the
compiler generates (`__rustc::__rust_alloc` and the like, filed under `#[global_allocator]`)
are not counted. Code the compiler inlined into its caller makes no call, so it is not counted:
a release build with LTO shows fewer functions than its source has.

Usage: callgrind_path.py [--requests N] [--per 0.5] [--root DIR] [--list] [--without FILE...] FILE...
  --requests N  requests in the window (default: the PATH.requests file beside the first FILE,
                as benches/path_callgrind.sh writes it)
  --per X       least calls per request of a counted function (default 0.5: once per two)
  --root DIR    the workspace root as the files name it (default: any directory holding a
                member crate of this repository's Cargo.toml at `MEMBER/src/`, outside the cargo
                registry, the toolchain and target directories)
  --list        print the counted functions with their calls per request and files
  --without F.. leave out the functions another path's files count (by their own PATH.requests
                and the same --per): what one path crosses that the other does not (the tunnel
                path --without the direct path: the tunnel's own part)
Prints one line per FILE and one for all FILEs together (the union of their functions); each
line ends with `all_code=`: the functions of any file (dependencies, the standard library, libc)
called as often.
"""
import argparse
import re
from collections import defaultdict
from pathlib import Path

COMPRESSED = re.compile(r"^\((\d+)\)(?: (.*))?$")
NOT_WORKSPACE = ("/.cargo/registry/", "/.cargo/git/", "/rustc/", "/rust/deps/", "/.rustup/", "/target/")
CARGO_TOML = Path(__file__).resolve().parents[2] / "Cargo.toml"


def members():
    """The workspace's member directories, from the `members` list of the root Cargo.toml."""
    text = CARGO_TOML.read_text()
    listed = text[text.index("members"):]
    return re.findall(r'"([^"]+)"', listed[:listed.index("]")])


MEMBER_SRC = re.compile("/(" + "|".join(re.escape(m) for m in members()) + ")/src/")


def name(table, value):
    """Resolves callgrind's name compression: `(id) name` defines id, `(id)` refers to it."""
    m = COMPRESSED.match(value)
    if not m:
        return value
    if m.group(2) is not None:
        table[m.group(1)] = m.group(2)
    return table.get(m.group(1), value)


CRATE_PATH = re.compile("^<?(" + "|".join(re.escape(m.replace("-", "_")) for m in members()) + ")::")


def parse(path):
    """{function: calls} and {function: file} of one callgrind file."""
    files, fns = {}, {}
    calls = defaultdict(int)
    file_of = {}
    body_files = defaultdict(list)  # the workspace files of a function's lines, in order
    fl = fn = cfn = None
    with open(path, errors="replace") as f:
        for line in f:
            if line[0].isdigit() or line[0] in "+-*":
                continue  # cost lines
            key, _, value = line.rstrip("\n").partition("=")
            if key in ("fl", "fi", "fe"):
                file = name(files, value)
                if key == "fl":
                    fl = file
                if fn is not None and in_workspace(file, None) and file not in body_files[fn]:
                    body_files[fn].append(file)
            elif key in ("cfi", "cfl"):
                name(files, value)
            elif key == "fn":
                fn = name(fns, value)
                file_of.setdefault(fn, fl)
                if in_workspace(fl, None) and fl not in body_files[fn]:
                    body_files[fn].append(fl)
            elif key == "cfn":
                cfn = name(fns, value)
            elif key == "calls" and cfn is not None:
                calls[cfn] += int(value.split()[0])
                cfn = None
    for fn, fl in file_of.items():
        if not in_workspace(fl, None) and CRATE_PATH.match(fn) and body_files[fn]:
            file_of[fn] = body_files[fn][0]
    return calls, file_of


def in_workspace(file, root):
    if not file or not file.startswith("/"):
        return False
    if root:
        return file.startswith(root.rstrip("/") + "/") and "/target/" not in file[len(root):]
    return MEMBER_SRC.search(file) is not None and not any(part in file for part in NOT_WORKSPACE)


def crate(file, root):
    """The crate's directory in the workspace."""
    if root:
        return file[len(root.rstrip("/")) + 1:].split("/")[0]
    return MEMBER_SRC.search(file).group(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--per", type=float, default=0.5)
    ap.add_argument("--root")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--without", nargs="+", default=[])
    opts = ap.parse_args()
    n = opts.requests if opts.requests is not None else requests_of(opts.files[0])
    left_out = set()
    for path in opts.without:
        calls, _ = parse(path)
        left_out |= {f for f, c in calls.items() if c >= opts.per * requests_of(path)}
    union, union_all = {}, set()
    for path in opts.files:
        calls, file_of = parse(path)
        calls = {f: c for f, c in calls.items() if f not in left_out}
        all_code = {f for f, c in calls.items() if c >= opts.per * n}
        union_all |= all_code
        counted = {f: (c, file_of.get(f)) for f, c in calls.items()
                   if c >= opts.per * n and not f.startswith("__rustc::")
                   and in_workspace(file_of.get(f), opts.root)}
        for f, (c, fl) in counted.items():
            prev = union.get(f)
            union[f] = (c + (prev[0] if prev else 0), fl)
        report(path, counted, len(all_code), n, opts)
    if len(opts.files) > 1:
        report("all", union, len(union_all), n, opts)


def requests_of(path):
    """The requests of a window, from the PATH.requests file beside its callgrind file."""
    path = Path(path)
    return int((path.parent / (path.name.split(".")[0] + ".requests")).read_text())


def report(label, counted, all_code, n, opts):
    modules = {fl for _, fl in counted.values()}
    crates = sorted({crate(fl, opts.root) for fl in modules})
    print(f"{label}: requests={n} functions={len(counted)} modules={len(modules)} "
          f"crates={len(crates)} ({' '.join(crates)}) all_code={all_code}")
    if opts.list:
        for f, (c, fl) in sorted(counted.items(), key=lambda kv: (kv[1][1], kv[0])):
            print(f"  {c / n:8.2f}  {fl}  {f}")


if __name__ == "__main__":
    main()
