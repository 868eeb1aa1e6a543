"""Corpus manifests: what goes in (hashes, licences, duplicates kept once), reading back with every hash
checked, and training's document list from a manifest."""

from __future__ import annotations

import hashlib
import json

import pytest

from dsv4.errors import UserError
from dsv4.train import corpus
from dsv4.train.data import find_documents


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _manifest(tmp_path):
    a = _write(tmp_path / "pkg_a" / "mod.py", "def f():\n    return 1\n")
    dup = _write(tmp_path / "pkg_b" / "vendored.py", "def f():\n    return 1\n")  # the same bytes as a
    b = _write(tmp_path / "pkg_b" / "README.md", "# b\n")
    empty = _write(tmp_path / "pkg_b" / "empty.py", "")
    big = _write(tmp_path / "pkg_b" / "table.py", "x" * (corpus.MAX_FILE_BYTES + 1))
    groups = [
        ("a", "1.0", "MIT", [("a/mod.py", a)]),
        ("b", "2.0", "BSD", [("b/vendored.py", dup), ("b/README.md", b), ("b/empty.py", empty), ("b/table.py", big)]),
    ]
    m = corpus.manifest_of(groups)
    out = tmp_path / "corpus.json"
    out.write_text(json.dumps(m), encoding="utf-8")
    return m, out, a, b


def test_manifest_records_versions_licences_hashes_and_keeps_repeated_bytes_once(tmp_path):
    m, _, a, b = _manifest(tmp_path)
    assert [(e["package"], e["version"], e["licence"]) for e in m["packages"]] == [
        ("a", "1.0", "MIT"),
        ("b", "2.0", "BSD"),
    ]
    names = [d["name"] for e in m["packages"] for d in e["documents"]]
    assert names == ["a/mod.py", "b/README.md"]  # the duplicate, the empty and the oversized file left out
    assert m["duplicates_dropped"] == 1
    docs = {d["name"]: d for e in m["packages"] for d in e["documents"]}
    assert docs["a/mod.py"]["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    assert m["bytes"] == a.stat().st_size + b.stat().st_size


def test_training_reads_a_manifest_and_refuses_a_changed_or_missing_file(tmp_path):
    _, path, a, b = _manifest(tmp_path)
    assert find_documents([path]) == [("a/mod.py", a), ("b/README.md", b)]
    a.write_text("def f():\n    return 2\n", encoding="utf-8")
    with pytest.raises(UserError, match="a/mod.py changed since the manifest"):
        find_documents([path])
    a.unlink()
    with pytest.raises(UserError, match="a/mod.py is missing"):
        find_documents([path])
    bad = tmp_path / "bad.json"
    bad.write_text('{"dsv4_corpus": 1, "packages": [{"documents": [{}]}]}', encoding="utf-8")
    with pytest.raises(UserError, match="not a readable corpus manifest"):
        find_documents([bad])


def test_stdlib_documents_keep_the_default_corpus_names_so_the_held_out_split_is_the_same():
    m = corpus.build_manifest(packages=[], stdlib=True)
    assert [e["package"] for e in m["packages"]] == ["python-stdlib"]
    names = {d["name"] for d in m["packages"][0]["documents"]}
    default = {name for name, _ in find_documents(None)}
    assert names <= default and len(names) > 0.9 * len(default)  # minus empty, oversized and repeated files


def test_an_installed_package_is_listed_with_its_metadata_and_an_unknown_one_is_refused():
    m = corpus.build_manifest(packages=["safetensors"], stdlib=False)
    (entry,) = m["packages"]
    import safetensors

    assert entry["package"] == "safetensors" and entry["version"] == safetensors.__version__
    assert any(d["name"].endswith(".py") for d in entry["documents"])
    with pytest.raises(UserError, match="not installed here: no-such-package-xyz"):
        corpus.build_manifest(packages=["no-such-package-xyz"], stdlib=False)


def test_dsv4_itself_is_never_training_text(monkeypatch):
    # its source holds `dsv4 eval`'s prompts and the test cases that judge the answers
    real = corpus.metadata.distributions
    keep = {"dsv4", "safetensors"}
    monkeypatch.setattr(corpus.metadata, "distributions", lambda: [d for d in real() if d.metadata["Name"] in keep])
    if "dsv4" not in {d.metadata["Name"] for d in corpus.metadata.distributions()}:
        pytest.skip("dsv4 is not installed as a distribution here (run from a source tree)")
    m = corpus.build_manifest(packages=None, stdlib=False)
    assert [e["package"] for e in m["packages"]] == ["safetensors"]
    with pytest.raises(UserError, match="cannot be training text"):
        corpus.build_manifest(packages=["DSV4"], stdlib=False)
