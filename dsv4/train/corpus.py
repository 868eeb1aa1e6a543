"""A reproducible code corpus from what is installed: the standard library plus installed packages' sources.

    python3 -m dsv4.train.corpus --out corpus.json                  # stdlib + every installed package
    python3 -m dsv4.train.corpus --out corpus.json --packages numpy scipy
    dsv4 train --data corpus.json ...                               # train on it

The manifest lists every document (a `.py` file, and `.md` / `.rst` / `.txt` docs where a package ships
them) with its package, the package's version and licence field (from its metadata), the file's
size and SHA-256. Files whose bytes repeat (vendored copies, generated stubs) are kept once: the first in
(package, path) order. Reading a manifest back (`--data corpus.json`) checks every hash, so a corpus is
either rebuilt exactly or refused with the file that changed. Standard-library documents keep their
plain relative names (`json/decoder.py`), so the held-out split of the stdlib is the same as with the
default corpus; package documents are named `package/relative/path`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import os
import sys
import sysconfig
from pathlib import Path

from ..errors import UserError

MANIFEST_KEY = "dsv4_corpus"
DOC_SUFFIXES = (".py", ".md", ".rst", ".txt")
SKIP_PARTS = {"__pycache__", "site-packages", "dist-packages"}
SELF = "dsv4"  # never in a corpus: `dsv4 eval`'s prompts and test cases are part of its source
MAX_FILE_BYTES = 400_000  # generated tables and minified data are not text to learn from
Group = tuple[str, str, str, list[tuple[str, Path]]]  # package, version, licence, (name, path) of its files


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _licence(dist: metadata.Distribution) -> str:
    meta = dist.metadata
    for key in ("License-Expression", "License"):
        v = meta.get(key)
        if v and v.strip() and v.strip().upper() != "UNKNOWN" and len(v) < 200:
            return v.strip()
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
    return "; ".join(classifiers) or "unknown"


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_PARTS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py"):
                p = Path(dirpath) / f
                out.append((str(p.relative_to(root)), p))
    return out


def _package_files(dist: metadata.Distribution) -> list[tuple[str, Path]]:
    out = []
    for f in dist.files or []:
        rel = str(f)
        if not rel.endswith(DOC_SUFFIXES) or rel.startswith("..") or SKIP_PARTS & set(Path(rel).parts):
            continue
        if ".dist-info" in rel or ".egg-info" in rel:
            continue
        p = Path(dist.locate_file(f))
        if p.is_file():
            out.append((rel, p))
    return out


def build_manifest(packages: list[str] | None = None, stdlib: bool = True) -> dict:
    """packages None = every installed distribution but dsv4 itself (sorted by name); [] = none."""
    dists = {(d.metadata["Name"] or "").lower(): d for d in metadata.distributions() if d.metadata["Name"]}
    if packages is None:
        names = sorted(n for n in dists if n != SELF)
    else:
        missing = [p for p in packages if p.lower() not in dists]
        if missing:
            raise UserError(f"--packages: not installed here: {', '.join(missing)}")
        if SELF in {p.lower() for p in packages}:
            raise UserError(f"--packages {SELF}: its evaluation prompts and their answers cannot be training text")
        names = sorted({p.lower() for p in packages})
    groups: list[Group] = []
    if stdlib:
        groups.append(("python-stdlib", sys.version.split()[0], "PSF-2.0", _stdlib_files()))
    for n in names:
        d = dists[n]
        groups.append((n, d.version, _licence(d), [(f"{n}/{rel}", p) for rel, p in _package_files(d)]))
    return manifest_of(groups)


def manifest_of(groups: list[Group]) -> dict:
    """The manifest of these groups, in order: empty and oversized files left out, repeated bytes kept once."""
    seen: set[str] = set()
    entries, dropped, total = [], 0, 0
    for name, version, licence, files in groups:
        docs = []
        for doc_name, p in sorted(files):
            size = p.stat().st_size
            if size == 0 or size > MAX_FILE_BYTES:
                continue
            digest = _sha256(p)
            if digest in seen:
                dropped += 1
                continue
            seen.add(digest)
            docs.append({"name": doc_name, "path": str(p), "bytes": size, "sha256": digest})
            total += size
        if docs:
            entries.append({"package": name, "version": version, "licence": licence, "documents": docs})
    return {
        MANIFEST_KEY: 1,
        "python": sys.version.split()[0],
        "packages": entries,
        "documents": sum(len(e["documents"]) for e in entries),
        "bytes": total,
        "duplicates_dropped": dropped,
    }


def is_manifest(path: Path) -> bool:
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(64)
    except (OSError, UnicodeDecodeError):
        return False
    return MANIFEST_KEY in head


def read_manifest(path: Path, verify: bool = True) -> list[tuple[str, Path]]:
    """(name, path) of every document of a manifest; verify: each file's SHA-256 must match."""
    try:
        m = json.loads(Path(path).read_text(encoding="utf-8"))
        entries = m["packages"]
        docs = [(d["name"], Path(d["path"]), d["sha256"]) for e in entries for d in e["documents"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--data {path}: not a readable corpus manifest ({e.__class__.__name__}: {e})") from None
    out = []
    for name, p, digest in docs:
        if verify:
            if not p.is_file():
                raise UserError(f"--data {path}: {name} is missing ({p}); rebuild the manifest where it was written")
            if _sha256(p) != digest:
                raise UserError(
                    f"--data {path}: {name} changed since the manifest was written ({p}): the corpus "
                    f"would not be the same; rebuild it with python3 -m dsv4.train.corpus"
                )
        out.append((name, p))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m dsv4.train.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the manifest to write (JSON)")
    ap.add_argument(
        "--packages",
        nargs="*",
        default=None,
        help="installed distributions to include (default: all of them; none: --packages alone)",
    )
    ap.add_argument("--no-stdlib", action="store_true", help="leave out the Python standard library")
    args = ap.parse_args(argv)
    try:
        m = build_manifest(args.packages, stdlib=not args.no_stdlib)
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(m, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, out)  # atomic: a reader never sees half a manifest
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: --out {args.out}: {e.strerror}", file=sys.stderr)
        return 1
    print(
        f"{out}: {m['documents']} documents, {m['bytes'] / 1e6:.1f} MB from {len(m['packages'])} packages "
        f"({m['duplicates_dropped']} duplicate files dropped)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
